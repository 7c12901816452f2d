"""transformers integration (`expertmesh.hf.attach`): tiny Qwen3-MoE, Mixtral, OLMoE, Qwen2-MoE
and DeepSeek-V3 models built by transformers from a config, saved, converted and served by
`expertmesh up --weights`; every
replaced block's output equals the Python client's for the same input, the model runs end to
end (forward and greedy generate), and its MoE blocks stay close to the local experts (the
fabric serves INT4).

Needs torch and transformers, which CI does not install (torch's PyPI wheels pull GBs of CUDA
libraries): without them this module is skipped with the reason printed (`pytest -rs`). To run
it: `pip install torch transformers` (tested layout: transformers 4.57), then
`python -m pytest python/tests/test_hf.py -rs`.
"""

from __future__ import annotations

import numpy as np
import pytest

try:
    import torch
    import transformers
except ImportError as e:  # pragma: no cover - the CI case
    pytest.skip(
        f"transformers integration NOT TESTED: it needs torch and transformers ({e}); "
        "pip install torch transformers, then run python -m pytest python/tests/test_hf.py -rs",
        allow_module_level=True,
    )

import expertmesh
from expertmesh import hf
from fabric_util import UpFabric
from moe_models import make_int4_exact, save_and_convert, tiny


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    model = tiny("qwen3_moe").eval()
    ckpt = save_and_convert(model, tmp)
    fabric = UpFabric(tmp, ["--weights", tmp / "w"])
    yield model, fabric
    fabric.close()


def test_attach_serves_the_moe_blocks_from_the_fabric(served):
    model, fabric = served
    client = expertmesh.RouterClient(fabric.addr, fabric.cluster)
    x = torch.randn(1, 5, 64)
    with torch.no_grad():
        local = {l: model.model.layers[l].mlp(x) for l in (1, 2)}
        layers = hf.attach(model, client, drop_experts=False)
        assert sorted(layers) == [1, 2]
        for l in (1, 2):
            block = model.model.layers[l].mlp
            assert isinstance(block, hf.FabricMoE)
            y = block(x)
            y = y[0] if isinstance(y, tuple) else y
            want = client.moe(l, x.reshape(5, 64).numpy())
            assert np.array_equal(y.reshape(5, 64).numpy().view(np.uint32), want.view(np.uint32))
            ref = local[l][0] if isinstance(local[l], tuple) else local[l]
            rel = float((y - ref).norm() / ref.norm())
            assert rel < 0.25, f"layer {l}: fabric vs local experts relative error {rel}"
        logits = model(torch.tensor([[1, 2, 3]])).logits
        assert logits.shape == (1, 3, 64) and torch.isfinite(logits).all()
        out = model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4, do_sample=False)
        assert out.shape == (1, 7)


@pytest.mark.parametrize("kind", ["mixtral", "olmoe", "qwen2_moe", "deepseek_v3"])
def test_attach_each_architecture(kind, tmp_path):
    """Saved by transformers (its own config.json, without e.g. DeepSeek's scoring_func),
    converted, served; every replaced block returns the fabric's output bit for bit, stays
    within INT4 error of the local experts, and the model still generates."""
    torch.manual_seed(0)
    model = tiny(kind).eval()
    ckpt = save_and_convert(model, tmp_path)
    fabric = UpFabric(tmp_path, ["--weights", tmp_path / "w"])
    try:
        client = expertmesh.RouterClient(fabric.addr, fabric.cluster)
        x = torch.randn(1, 5, 64)
        with torch.no_grad():
            moe = [i for i, l in enumerate(model.model.layers)
                   if type(l.mlp).__name__ in hf.MOE_BLOCK_CLASSES]
            local = {l: model.model.layers[l].mlp(x) for l in moe}
            layers = hf.attach(model, client, drop_experts=False)
            assert sorted(layers) == moe and moe
            for l in moe:
                y = model.model.layers[l].mlp(x)
                y = y[0] if isinstance(y, tuple) else y
                want = client.moe(l, x.reshape(5, 64).numpy())
                assert np.array_equal(y.reshape(5, 64).numpy().view(np.uint32), want.view(np.uint32))
                ref = local[l][0] if isinstance(local[l], tuple) else local[l]
                rel = float((y - ref).norm() / ref.norm())
                assert rel < 0.25, f"{kind} layer {l}: fabric vs local experts {rel}"
            out = model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4, do_sample=False)
            assert out.shape == (1, 7)
    finally:
        fabric.close()


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral", "olmoe", "qwen2_moe", "deepseek_v3"])
def test_logits_and_greedy_tokens_match_the_unmodified_model(kind, tmp_path):
    """With expert weights already on the INT4 grid (so conversion is lossless), the model
    with the fabric attached (accurate mode) gives the unmodified model's logits within 1e-4
    relative and the same greedy tokens."""
    torch.manual_seed(1)
    model = tiny(kind).eval()
    make_int4_exact(model)
    ckpt = save_and_convert(model, tmp_path)
    ids = torch.tensor([[3, 14, 15, 9, 26, 5]])
    with torch.no_grad():
        want = model(ids).logits
        want_tokens = model.generate(ids, max_new_tokens=6, do_sample=False)
    fabric = UpFabric(tmp_path, ["--weights", tmp_path / "w", "--mode", "accurate"])
    try:
        client = expertmesh.RouterClient(fabric.addr, fabric.cluster)
        with torch.no_grad():
            hf.attach(model, client)
            got = model(ids).logits
            tokens = model.generate(ids, max_new_tokens=6, do_sample=False)
        rel = float((got - want).norm() / want.norm())
        assert rel < 1e-4, f"{kind}: logits differ by {rel} relative"
        assert torch.equal(tokens, want_tokens), f"{kind}: {tokens} vs {want_tokens}"
    finally:
        fabric.close()


@pytest.mark.parametrize("kind", ["qwen3_moe", "deepseek_v3"])
def test_load_without_experts_reads_no_expert_and_gives_the_same_logits(kind, tmp_path):
    """The frontend path of examples/hf_generate.py: the model built with only its non-expert
    tensors read gives the logits of the fully loaded model with the same fabric attached."""
    torch.manual_seed(2)
    model = tiny(kind).eval()
    ckpt = save_and_convert(model, tmp_path)
    fabric = UpFabric(tmp_path, ["--weights", tmp_path / "w"])
    try:
        client = expertmesh.RouterClient(fabric.addr, fabric.cluster)
        ids = torch.tensor([[3, 14, 15, 9]])
        with torch.no_grad():
            full = transformers.AutoModelForCausalLM.from_pretrained(ckpt).eval()
            hf.attach(full, client)
            want = full(ids).logits
            lean = hf.load_without_experts(ckpt, client)
            got = lean(ids).logits
        assert not [k for k in lean.expertmesh_loaded if "experts" in k], lean.expertmesh_loaded
        assert torch.equal(got, want)
    finally:
        fabric.close()
