"""End to end on a real (tiny) checkpoint: a Qwen3-MoE and a Mixtral Hugging Face folder written
with NumPy, converted by ``expertmesh convert``, served by ``expertmesh up --weights`` (its own
router and worker processes, exact mode); the Python client's output for every MoE layer, in
every input dtype, equals ``expertmesh infer``'s for the same input bit for bit."""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest

import expertmesh
from fabric_util import EXAMPLES, UpFabric, expertmesh_bin, topology_with_free_ports
from tiny_checkpoint import write_tiny_checkpoint

HIDDEN = 64


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def served(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(request.param)
    ckpt = tmp / "ckpt"
    cfg = write_tiny_checkpoint(ckpt, request.param, hidden=HIDDEN, seed=3)
    topo = topology_with_free_ports(EXAMPLES / "single-host.toml", tmp / "convert-topology.toml")
    weights = tmp / "weights"
    r = subprocess.run(
        [str(expertmesh_bin()), "convert", "--threads", "2", "--checkpoint", str(ckpt), "--topology", str(topo), "--out", str(weights)],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, f"convert failed:\n{r.stdout}\n{r.stderr}"
    fabric = UpFabric(tmp, ["--weights", weights])
    moe_layers = [l for l in range(cfg["num_hidden_layers"]) if l not in cfg.get("mlp_only_layers", [])]
    yield fabric, moe_layers, tmp
    fabric.close()


def infer(fabric: UpFabric, layer: int, x: np.ndarray, tmp: Path) -> np.ndarray:
    inp, outp = tmp / "x.npy", tmp / "y.npy"
    np.save(inp, x)
    r = subprocess.run(
        [str(expertmesh_bin()), "infer", "--router", fabric.addr, "--cluster", fabric.cluster,
         "--layer", str(layer), "--input", str(inp), "--output", str(outp)],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, f"infer failed:\n{r.stdout}\n{r.stderr}"
    return np.load(outp)


def test_python_client_equals_expertmesh_infer_bit_for_bit(served):
    fabric, layers, tmp = served
    assert fabric.cluster == "single-host"
    rng = np.random.default_rng(11)
    with expertmesh.RouterClient(fabric.addr, fabric.cluster) as c:
        for layer in layers:
            for tokens in (1, 5, 40):
                x = rng.standard_normal((tokens, HIDDEN), dtype=np.float32)
                inputs = {
                    "float32": x,
                    "float16": x.astype(np.float16),
                    "bf16 bits": (x.view(np.uint32) >> 16).astype(np.uint16),
                }
                for name, a in inputs.items():
                    want = infer(fabric, layer, a, tmp)
                    assert want.dtype == np.float32 and want.shape == (tokens, HIDDEN)
                    got = c.moe(layer, a)
                    assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (
                        f"layer {layer}, {tokens} tokens, {name}: the Python client and "
                        "`expertmesh infer` differ"
                    )
                    assert np.abs(got).sum() > 0
        # the dense layer and a layer past the end are refused, as the CLI refuses them
        with pytest.raises(expertmesh.NotFound):
            c.moe(99, np.zeros((1, HIDDEN), np.float32))
        if 0 not in layers:
            with pytest.raises(expertmesh.NotFound, match="dense"):
                c.moe(0, np.zeros((1, HIDDEN), np.float32))
