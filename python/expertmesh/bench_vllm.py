"""vLLM with its experts on the fabric against vLLM with its own CPU experts: ``python -m
expertmesh.bench_vllm``.

Same checkpoint, same machine, same run: the bench converts the checkpoint (unless ``--weights``
names a conversion), starts ``expertmesh up`` on it, then runs vLLM in child processes,
alternating the two arms ``--repeats`` times:

* ``local``: unmodified vLLM (``EXPERTMESH_VLLM_ROUTER`` unset, its CPU fused-MoE kernel);
* ``fabric``: the same vLLM with the plugin (:mod:`expertmesh.vllm`) and ``load_format=
  "expertmesh"``.

Each child loads the model, warms up, then generates ``--max-tokens`` greedy tokens for
``--batch`` token-id prompts of ``--prompt-len`` tokens, and reports decode tokens/s (generated
tokens over the timed generate, prefill included), the time per MoE call (a forward hook on every
MoE runner; decode calls, one token per sequence, and prefill calls apart), its resident memory
after loading (``VmRSS``) and its peak (``VmHWM``), and the greedy tokens. The report gives
medians per arm and the fabric/local ratios, and ``--json`` writes every repetition.

``python -m expertmesh.bench_vllm child SPEC_JSON`` is one child (what the bench and the tests
run); it prints one JSON line starting with ``RESULT ``.

Needs vLLM (``scripts/vllm-venv.sh``) and the ``expertmesh`` binary (``$EXPERTMESH_BIN``, else
``target/release/expertmesh`` then ``target/debug/expertmesh`` under the repository, else
``PATH``).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

from ._ports import topology_with_free_ports

RESULT = "RESULT "


def _proc_status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def child(spec: Dict[str, Any]) -> Dict[str, Any]:
    """One vLLM run in this process (call it in a fresh process: vLLM's state is per process).
    ``spec``: model, dtype, prompts (lists of token ids), max_tokens, logprobs, fabric (bool),
    warmup (bool), max_model_len, load_format (overrides the arm's), rounds,
    pause_between_rounds and later_prompts (generate again; see below), attention_backend (e.g. ``CPU_MLA``: vLLM's reference MLA,
    which runs float32 where the AMX one needs 16-bit weights)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from . import vllm as plugin

    fabric = bool(spec.get("fabric"))
    if fabric != (plugin.PluginConfig.from_env() is not None):
        raise SystemExit(f"spec says fabric={fabric} but {plugin.ENV_ROUTER} is "
                         f"{'unset' if not fabric else 'set'}")
    kwargs: Dict[str, Any] = dict(
        model=spec["model"], skip_tokenizer_init=True, dtype=spec.get("dtype", "float32"),
        enforce_eager=True, max_model_len=int(spec.get("max_model_len", 128)),
        seed=0,
    )
    if spec.get("attention_backend"):
        kwargs["attention_backend"] = spec["attention_backend"]
    if fabric:
        kwargs["load_format"] = plugin.LOAD_FORMAT
    if spec.get("load_format"):
        kwargs["load_format"] = spec["load_format"]
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    load_s = time.perf_counter() - t0
    rss_after_load = _proc_status_bytes("VmRSS")

    calls: List[List[float]] = []  # [tokens, seconds, start, end] per MoE runner forward
    runner_classes: List[str] = []

    def hook_runners(model: Any) -> int:
        from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

        n = 0
        for m in model.modules():
            if isinstance(m, MoERunner):
                runner_classes.append(type(m).__name__)
                def pre(mod: Any, args: Any, kwargs: Any) -> None:
                    mod._em_t0 = time.perf_counter()

                def post(mod: Any, args: Any, kwargs: Any, out: Any) -> None:
                    x = args[0] if args else kwargs["hidden_states"]
                    now = time.perf_counter()
                    calls.append([float(x.shape[0]), now - mod._em_t0, mod._em_t0, now])

                m.register_forward_pre_hook(pre, with_kwargs=True)
                m.register_forward_hook(post, with_kwargs=True)
                n += 1
        return n

    hooked = sum(llm.apply_model(hook_runners))
    prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in spec["prompts"]]
    sp = SamplingParams(max_tokens=int(spec["max_tokens"]), temperature=0.0,
                        logprobs=int(spec.get("logprobs", 0)) or None, detokenize=False,
                        ignore_eos=True)
    if spec.get("warmup", True):
        llm.generate(prompts, SamplingParams(max_tokens=2, temperature=0.0, detokenize=False,
                                             ignore_eos=True), use_tqdm=False)
    calls.clear()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    gen_s = time.perf_counter() - t0
    timed_calls = list(calls)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    logprobs = []
    for o in outs:
        per = []
        for tok, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs or []):
            per.append(float(lp[tok].logprob))
        logprobs.append(per)
    later = []
    for i in range(1, int(spec.get("rounds", 1))):
        # The same prompts again; with pause_between_rounds the parent acts first (it reads
        # "ROUND-DONE i" and answers with a line), e.g. stops or restarts the fabric.
        if spec.get("pause_between_rounds"):
            print(f"ROUND-DONE {i - 1}", flush=True)
            sys.stdin.readline()
        later_prompts = spec.get("later_prompts")
        these = ([TokensPrompt(prompt_token_ids=list(p)) for p in later_prompts[i - 1]]
                 if later_prompts else prompts)
        again = llm.generate(these, sp, use_tqdm=False)
        later.append({"tokens": [list(o.outputs[0].token_ids) for o in again],
                      "finish_reasons": [o.outputs[0].finish_reason for o in again]})
    batch = len(prompts)
    decode = [c[1] for c in timed_calls if c[0] <= batch]
    prefill = [c[1] for c in timed_calls if c[0] > batch]
    gaps = [b[2] - a[3] for a, b in zip(timed_calls, timed_calls[1:]) if a[0] <= batch and b[0] <= batch]
    return {
        "fabric": fabric,
        "model": spec["model"],
        "dtype": kwargs["dtype"],
        "load_s": load_s,
        "rss_after_load_bytes": rss_after_load,
        "peak_rss_bytes": _proc_status_bytes("VmHWM"),
        "moe_runners": hooked,
        "runner_classes": sorted(set(runner_classes)),
        "generated_tokens": sum(len(t) for t in tokens),
        "generate_s": gen_s,
        "tokens_per_s": sum(len(t) for t in tokens) / gen_s if gen_s > 0 else 0.0,
        "moe_seconds_total": sum(c[1] for c in timed_calls),
        # From the end of one decode MoE call to the start of the next (vLLM's own work between
        # them: a layer's attention and norms, or the step's sampling and scheduling).
        "between_decode_moe_calls_us_median": 1e6 * statistics.median(gaps) if gaps else None,
        "moe_call_decode_us_p90": 1e6 * sorted(decode)[int(0.9 * (len(decode) - 1))] if decode else None,
        "moe_calls_decode": len(decode),
        "moe_call_decode_us_median": 1e6 * statistics.median(decode) if decode else None,
        "moe_calls_prefill": len(prefill),
        "moe_call_prefill_us_median": 1e6 * statistics.median(prefill) if prefill else None,
        "tokens": tokens,
        "finish_reasons": [o.outputs[0].finish_reason for o in outs],
        "logprobs": logprobs,
        "later_rounds": later,
        "plugin_stats": plugin.stats() if fabric else None,
        "torch_threads": torch.get_num_threads(),
    }


def run_child(spec: Dict[str, Any], env: Dict[str, str], timeout_s: float = 900.0,
              log: Optional[Path] = None) -> Dict[str, Any]:
    """Run :func:`child` in a fresh Python process with ``env`` and return its result; raises
    ``RuntimeError`` with the child's last output when it fails."""
    r = subprocess.run(
        [sys.executable, "-m", "expertmesh.bench_vllm", "child", json.dumps(spec)],
        env=env, capture_output=True, text=True, timeout=timeout_s,
    )
    if log is not None:
        log.write_text(r.stdout + "\n--- stderr ---\n" + r.stderr)
    for line in r.stdout.splitlines():
        if line.startswith(RESULT):
            return json.loads(line[len(RESULT):])
    tail = "\n".join((r.stdout + r.stderr).splitlines()[-25:])
    raise RuntimeError(f"vLLM child (fabric={spec.get('fabric')}) exited {r.returncode}:\n{tail}")


def plugin_env(router: str, cluster: str, extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """The environment of a child that runs vLLM with the plugin on ``router``."""
    env = dict(os.environ)
    env["EXPERTMESH_VLLM_ROUTER"] = router
    env["EXPERTMESH_VLLM_CLUSTER"] = cluster
    env.update(extra or {})
    return env


def local_env() -> Dict[str, str]:
    """The environment of a child that runs unmodified vLLM (the plugin off)."""
    env = dict(os.environ)
    for k in list(env):
        if k.startswith("EXPERTMESH_VLLM_"):
            del env[k]
    return env


# --- the bench -----------------------------------------------------------------------------

def _repo() -> Path:
    return Path(__file__).resolve().parents[2]


def expertmesh_bin() -> Path:
    """The ``expertmesh`` binary: ``$EXPERTMESH_BIN``, the repository's release then debug
    build, else ``PATH``."""
    env = os.environ.get("EXPERTMESH_BIN")
    candidates = [Path(env)] if env else []
    candidates += [_repo() / "target" / "release" / "expertmesh",
                   _repo() / "target" / "debug" / "expertmesh"]
    for c in candidates:
        if c.is_file():
            return c
    found = shutil.which("expertmesh")
    if found:
        return Path(found)
    raise SystemExit("no expertmesh binary: build it (cargo build --release -p expertmesh) or "
                     "set EXPERTMESH_BIN")


class Fabric:
    """``expertmesh up --weights W`` on loopback, ready when it says so; ``close()`` stops it."""

    def __init__(self, binary: Path, topology: Path, weights: Path, mode: str, log: Path) -> None:
        self.log = log.open("w")
        self.proc = subprocess.Popen(
            [str(binary), "up", "--topology", str(topology), "--weights", str(weights),
             "--mode", mode],
            stdout=subprocess.PIPE, stderr=self.log, text=True, start_new_session=True,
        )
        self.addr = ""
        self.cluster = ""
        deadline = time.monotonic() + 120
        seen: List[str] = []
        lines: "queue.Queue[Optional[str]]" = queue.Queue()
        stdout = self.proc.stdout
        assert stdout is not None

        def pump() -> None:  # a thread, so a silent `up` cannot hold the bench past the deadline
            for raw in stdout:
                lines.put(raw)
            lines.put(None)

        threading.Thread(target=pump, daemon=True).start()
        while time.monotonic() < deadline:
            try:
                line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                break
            if line is None:
                break
            seen.append(line.rstrip())
            m = re.search(r"frontends: (\S+) \(cluster \"([^\"]+)\"\)", line)
            if m and not self.addr:
                self.addr, self.cluster = m.group(1), m.group(2)
            if "Ctrl-C to stop." in line:
                break
        if not self.addr or self.proc.poll() is not None:
            self.close()
            raise RuntimeError(f"expertmesh up did not come up: {seen[-20:]}")

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


def synthetic_checkpoint(folder: Path, args: argparse.Namespace) -> Path:
    """A Qwen3-MoE-shaped checkpoint with random weights (bf16, seed 0) in ``folder``, built by
    transformers unless ``folder/config.json`` exists; attention is 16 heads of 64 (4 KV heads),
    the vocabulary 1024 tokens. Returns ``folder``."""
    if (folder / "config.json").is_file():
        return folder
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=1024, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
        moe_intermediate_size=args.moe_intermediate, num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64, num_key_value_heads=max(1, args.hidden // 256),
        head_dim=64, num_experts=args.experts, num_experts_per_tok=args.top_k,
        norm_topk_prob=True, max_position_embeddings=max(512, args.max_model_len))
    with torch.device("cpu"):
        model = transformers.Qwen3MoeForCausalLM(cfg).to(torch.bfloat16).eval()
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def _median(rows: List[Dict[str, Any]], key: str) -> Optional[float]:
    vals = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["child"]:
        result = child(json.loads(argv[1]))
        print(RESULT + json.dumps(result), flush=True)
        return 0
    ap = argparse.ArgumentParser(prog="python -m expertmesh.bench_vllm", description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", type=Path, help="HF checkpoint folder (safetensors)")
    ap.add_argument("--synthetic", type=Path, metavar="DIR",
                    help="instead: build a Qwen3-MoE-shaped checkpoint with random weights in DIR "
                         "(if it is not there yet; shape from --hidden/--moe-intermediate/"
                         "--experts/--top-k/--layers, bf16, seed 0) and bench it")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--moe-intermediate", type=int, default=512)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--topology", type=Path, default=_repo() / "examples" / "single-host.toml")
    ap.add_argument("--weights", type=Path, help="its conversion (default: convert into a temporary folder)")
    ap.add_argument("--mode", default="serving", choices=["exact", "exact-bf16", "accurate", "serving"],
                    help="the fabric's mode (up's default: serving)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--batch", type=int, default=4, help="sequences decoded together")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-model-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2, help="children per arm, alternating")
    ap.add_argument("--json", type=Path, help="write every repetition here")
    args = ap.parse_args(argv)

    if (args.checkpoint is None) == (args.synthetic is None):
        ap.error("give --checkpoint DIR or --synthetic DIR")
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")
    if args.synthetic is not None:
        args.checkpoint = synthetic_checkpoint(args.synthetic, args)
    # The conversion (a whole model's experts), the topology and the logs: removed after a
    # run that succeeded; after a failure the logs are kept (and named) and the conversion
    # removed.
    work = Path(tempfile.mkdtemp(prefix="em-bench-vllm-"))
    try:
        code = _bench(args, work)
    except BaseException:
        shutil.rmtree(work / "weights", ignore_errors=True)
        print(f"bench_vllm: failed; its logs are in {work}", file=sys.stderr)
        raise
    shutil.rmtree(work, ignore_errors=True)
    return code


def _bench(args: Any, work: Path) -> int:
    """The two arms' runs and their summary (``main``, once the arguments are checked)."""
    binary = expertmesh_bin()
    topo = topology_with_free_ports(args.topology, work / "topology.toml")
    weights = args.weights
    if weights is None:
        weights = work / "weights"
        r = subprocess.run([str(binary), "convert", "--checkpoint", str(args.checkpoint),
                            "--topology", str(topo), "--out", str(weights)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise SystemExit(f"expertmesh convert failed:\n{r.stderr}")
    fabric = Fabric(binary, topo, weights, args.mode, work / "up.log")
    prompts = [[(7 * b + 3 * i + 1) % 50 + 1 for i in range(args.prompt_len)] for b in range(args.batch)]
    spec = dict(model=str(args.checkpoint), dtype=args.dtype, prompts=prompts,
                max_tokens=args.max_tokens, max_model_len=args.max_model_len)
    rows: List[Dict[str, Any]] = []
    try:
        for rep in range(args.repeats):
            for arm in ("local", "fabric"):
                env = plugin_env(fabric.addr, fabric.cluster) if arm == "fabric" else local_env()
                res = run_child({**spec, "fabric": arm == "fabric"}, env,
                                log=work / f"child-{arm}-{rep}.log")
                res["arm"], res["repeat"] = arm, rep
                rows.append(res)
                print(f"{arm:6s} rep {rep}: {res['tokens_per_s']:8.1f} tok/s, MoE call decode "
                      f"{res['moe_call_decode_us_median'] or 0:8.1f} us, between MoE calls "
                      f"{res['between_decode_moe_calls_us_median'] or 0:8.1f} us, RSS after load "
                      f"{res['rss_after_load_bytes'] / 2**20:7.0f} MiB", flush=True)
    finally:
        fabric.close()
    local = [r for r in rows if r["arm"] == "local"]
    fab = [r for r in rows if r["arm"] == "fabric"]
    # Only a lossless conversion served in accurate mode gives vLLM's own tokens (the tests
    # check that); here the share of greedy tokens equal to the first local run's is a figure.
    ref = [t for seq in local[0]["tokens"] for t in seq]
    agree = {arm: statistics.median(
        sum(a == b for a, b in zip([t for seq in r["tokens"] for t in seq], ref)) / max(1, len(ref))
        for r in rows if r["arm"] == arm) for arm in ("local", "fabric")}
    summary = {}
    for key in ("tokens_per_s", "moe_call_decode_us_median", "moe_call_decode_us_p90",
                "moe_call_prefill_us_median", "between_decode_moe_calls_us_median",
                "rss_after_load_bytes", "peak_rss_bytes"):
        lo, fa = _median(local, key), _median(fab, key)
        summary[key] = {"local": lo, "fabric": fa, "fabric_over_local": (fa / lo) if lo and fa else None}
    print(f"\n{'figure (median)':34s} {'local vLLM':>14s} {'vLLM + fabric':>14s} {'fabric/local':>12s}")
    for key, v in summary.items():
        ratio = v["fabric_over_local"]
        print(f"{key:34s} {v['local'] or 0:14.1f} {v['fabric'] or 0:14.1f} "
              f"{ratio if ratio is not None else float('nan'):12.3f}")
    print(f"greedy tokens equal to the first local run's (median share): local {agree['local']:.3f}, "
          f"fabric {agree['fabric']:.3f} (mode {args.mode}; equal only for INT4-grid weights in "
          "accurate mode)")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                         "summary": summary, "tokens_equal_share": agree,
                                         "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
