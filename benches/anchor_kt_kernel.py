#!/usr/bin/env python3
"""The competitor in our benches: KTransformers' CPU MoE kernels (PyPI `kt-kernel`) measured on
the same expert shapes, routing, batches and threads as `expertmesh bench kernels`, printed beside
our rows and judged against the same limits (issue 26, item 6).

Why this exists: a ratio of our kernels against the machine's read bandwidth or int8 peak says how
close we are to the hardware, not whether the kernel people would otherwise run is faster. This
script runs both in one go, so a hardware evaluator sees our rows and kt-kernel's rows side by side
without assembling anything:

  1. checks that kt-kernel can be imported (exit 2 with the install command when not);
  2. runs `expertmesh bench kernels` with the same models, batches, prefill tokens, threads,
     seconds and repetitions, and takes our rows and the same-run limits from its JSON
     (`machine.read_bandwidth_gbs_median`, `machine.int8_peak_tops_median`,
     `machine.amx_contract_tops_median` when present);
  3. for each model and kt-kernel format (AMXINT4: int4 with one fp32 scale per output row;
     RAWINT4: int4 with a scale per group of 32 columns; AMXINT8 on request), builds a MoE layer of
     the model's shape in kt-kernel with random weights, a pool of experts larger than the
     last-level cache (a few generated experts, the rest copies, as ours), and times decode calls
     (B tokens routed top-k uniformly without replacement over the model's routed experts, rotating
     over the pool as ours) and a prefill (N tokens on one expert per call, as ours), each in its
     own process (kt-kernel does not free a layer's memory);
  4. after each model and format, re-reads our limits with a short `bench kernels` run, so a limit
     that moved while kt-kernel ran is seen;
  5. prints one table, ours and theirs per case, with kt-kernel's ratio against our limits, and
     writes our JSON with kt-kernel's rows appended (`"anchor": "kt-kernel VERSION FORMAT"`).

Bytes per call are counted as our bench counts them, weight bytes of the touched experts, in
kt-kernel's own format (printed per format); ops = 2 * 3 * H * F per (token, expert) pair.
kt-kernel's formats are not our exact contract (AMXINT4: one scale per output row; RAWINT4:
group 32 with fp32 scales in memory), so this compares speed only, not accuracy.

Install kt-kernel (its Python wrappers need torch; this script imports only its extension, so
numpy is enough):
    python3 -m venv /tmp/ktvenv
    /tmp/ktvenv/bin/pip install numpy
    /tmp/ktvenv/bin/pip install --no-deps kt-kernel==0.7.2

Run (the full comparison of issue 26):
    /tmp/ktvenv/bin/python benches/anchor_kt_kernel.py --expertmesh ./target/release/expertmesh \\
        --models kimi-k2,qwen3-30b-a3b --batches 1,16 --prefill-tokens 256 --threads 2 \\
        --seconds 300 --json kt-anchor.json
or with any python3 for this script and `--kt-python /tmp/ktvenv/bin/python` for kt-kernel's side.
That takes about --seconds (our bench) plus 3-5 minutes (per model and format: setup, up to --kt-seconds of
calls, a --reread-seconds re-read of our limits). kt-kernel's dispatcher thread busy-waits during calls on top
of its --threads workers; `--kt-threads` sets its workers apart from ours (e.g. 1 on a 2-vCPU machine).
Dependencies: the standard library here, numpy and kt_kernel in the kt-kernel processes.
Exit codes: 0 measured (and --json written); 2 kt-kernel missing, bad options, or our bench failed.
"""

import argparse
import glob
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

try:
    import tomllib
except ImportError:  # Python < 3.11: the model presets are read from `expertmesh models` instead
    tomllib = None

KT_VERSION_TESTED = "0.7.2"
INSTALL = (
    "python3 -m venv /tmp/ktvenv && /tmp/ktvenv/bin/pip install numpy && "
    "/tmp/ktvenv/bin/pip install --no-deps kt-kernel==0.7.2   "
    "(then run this script with /tmp/ktvenv/bin/python, or pass --kt-python /tmp/ktvenv/bin/python)"
)
FORMATS = ("amxint4", "rawint4", "amxint8")
DEFAULT_FORMATS = "amxint4,rawint4"
# As `bench kernels`: a slot of calls per repetition lasts at least this long (at least one call).
SLOT_S = 0.03
# As `bench kernels`: what the weight pool may take of the memory available at its start.
MEMORY_SHARE = 0.5
# As `bench kernels`: generated experts in a pool (the rest are copies of them).
DISTINCT = 4
# A limit re-read that differs from the main run's by more than this is reported (as LIMIT_MOVED).
LIMIT_MOVED = 1.15
# The kt-kernel output of one token on one expert must match the numpy reference this closely
# (relative L2; the weights are exactly representable, so only activation quantization and bf16
# rounding remain: 1-2% measured).
CHECK_TOLERANCE = 0.10


def log(msg):
    print(msg, flush=True)


# ----------------------------------------------------------------------------------------------
# Statistics, as benches/src/method/stats.rs (nearest-rank percentiles).


def percentile(sorted_s, p):
    if not sorted_s:
        return 0.0
    rank = math.ceil(p / 100.0 * len(sorted_s))
    return sorted_s[min(max(rank, 1), len(sorted_s)) - 1]


def spread(samples):
    s = sorted(x for x in samples if isinstance(x, (int, float)) and math.isfinite(x))
    n = len(s)
    if n == 0:
        med = 0.0
    elif n % 2:
        med = s[n // 2]
    else:
        med = 0.5 * (s[n // 2 - 1] + s[n // 2])
    return {"n": n, "median": med, "p10": percentile(s, 10), "p90": percentile(s, 90)}


# ----------------------------------------------------------------------------------------------
# kt-kernel side (runs in its own processes: `--_probe` and `--_worker SPEC`).


def load_kt():
    """kt-kernel's best extension for this CPU, without its Python wrappers (they need torch):
    its own CPU detection (`_cpu_detect.py`, loaded by path) picks and loads the variant."""
    import importlib.metadata
    import importlib.util

    spec = importlib.util.find_spec("kt_kernel")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"kt_kernel is not installed for {sys.executable}")
    pkg = list(spec.submodule_search_locations)[0]
    det_spec = importlib.util.spec_from_file_location("kt_kernel_cpu_detect", os.path.join(pkg, "_cpu_detect.py"))
    det = importlib.util.module_from_spec(det_spec)
    det_spec.loader.exec_module(det)
    ext, variant = det.initialize()
    try:
        version = importlib.metadata.version("kt-kernel")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    return ext, str(getattr(ext, "__cpu_variant__", variant)), version


def host_flags():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def kt_class(ext, fmt):
    """(class name, class) kt-kernel would use for `fmt` on this CPU, or (None, reason)."""
    moe = ext.moe
    if fmt == "amxint4":
        c = getattr(moe, "AMXInt4_MOE", None)
        return ("AMXInt4_MOE", c) if c else (None, "AMXInt4_MOE is not compiled into this kt-kernel variant")
    if fmt == "amxint8":
        c = getattr(moe, "AMXInt8_MOE", None)
        return ("AMXInt8_MOE", c) if c else (None, "AMXInt8_MOE is not compiled into this kt-kernel variant")
    if fmt == "rawint4":
        # As kt_kernel/utils/amx.py `_select_rawint4_backend` (KT_RAWINT4_BACKEND overrides it).
        forced = os.environ.get("KT_RAWINT4_BACKEND", "").strip().lower()
        names = {
            "amx": ["AMXInt4_KGroup_MOE"],
            "amx_blocked": ["AMXInt4_KGroupBlocked_MOE"],
            "blocked": ["AMXInt4_KGroupBlocked_MOE"],
            "avxvnni": ["AVXVNNI256RawInt4_MOE"],
            "avxvnni256": ["AVXVNNI256RawInt4_MOE"],
            "avx2": ["AVX2RawInt4_MOE"],
        }.get(forced)
        if names is None:
            names = ["AMXInt4_KGroup_MOE"]
            if host_flags() & {"avx_vnni", "avxvnni"}:
                names.append("AVXVNNI256RawInt4_MOE")
            names.append("AVX2RawInt4_MOE")
        for n in names:
            c = getattr(moe, n, None)
            if c:
                return n, c
        return None, f"none of {names} is compiled into this kt-kernel variant"
    return None, f"unknown format {fmt}"


def probe_main():
    """`--_probe`: print what this interpreter's kt-kernel offers, as JSON on the last line."""
    try:
        ext, variant, version = load_kt()
    except Exception as e:  # noqa: BLE001 - any failure means "not usable", said in the message
        print(json.dumps({"ok": False, "error": f"{type(e).__name__}: {e}"}))
        return
    try:
        import numpy  # noqa: F401
    except ImportError as e:
        print(json.dumps({"ok": False, "error": f"numpy: {e}"}))
        return
    formats = {}
    for fmt in FORMATS:
        name, c = kt_class(ext, fmt)
        formats[fmt] = {"class": name} if name else {"class": None, "why": c}
    print(json.dumps({"ok": True, "version": version, "variant": variant, "python": sys.executable,
                      "int8_kernel": getattr(ext, "__int8_kernel__", None),
                      "rawint4_kernel": getattr(ext, "__rawint4_kernel__", None),
                      "formats": formats}))


def rss_bytes():
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def worker_main(spec_path):
    """`--_worker SPEC`: one model and one format in kt-kernel; writes the result JSON."""
    with open(spec_path) as f:
        spec = json.load(f)
    out_path = spec["out"]
    t_start = time.perf_counter()
    try:
        res = worker_run(spec, t_start)
    except Exception as e:  # noqa: BLE001 - reported to the parent as this block's skip reason
        import traceback

        traceback.print_exc()
        res = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    res["elapsed_s"] = time.perf_counter() - t_start
    with open(out_path, "w") as f:
        json.dump(res, f)


def say(msg):
    # kt-kernel's C++ writes to stdout (sent to a log by the parent); our progress goes to stderr.
    print(f"    [kt] {msg}", file=sys.stderr, flush=True)


def worker_run(spec, t_start):
    import numpy as np

    ext, variant, version = load_kt()
    fmt = spec["format"]
    name, cls = kt_class(ext, fmt)
    if name is None:
        return {"ok": False, "error": cls}
    H, F, E, K = spec["hidden"], spec["intermediate"], spec["experts"], spec["top_k"]
    threads = spec["threads"]
    batches = spec["batches"]
    prefill = spec["prefill_tokens"]
    # kt-kernel's scratch is sized by max_len (its chunked_prefill_size), a multiple of its 32-row tiles.
    max_len = 64 * math.ceil(max([1] + batches + [prefill]) / 64)
    params = 3 * H * F
    rng = np.random.default_rng(spec.get("seed", 7))

    # Bytes per expert in kt-kernel's own resident format.
    if fmt == "rawint4":
        ckpt = 3 * (H * F // 2 + 2 * (H * F // 32))
        if name.startswith("AMXInt4_KGroup"):
            bpe = 3 * (H * F // 2 + 4 * (H * F // 32))
            basis = ("packed int4 nibbles + one fp32 scale per 32 columns (BufferBInt4KGroupImpl::required_size; "
                     "the checkpoint's bf16 scales are widened to fp32 at load)")
        else:
            bpe = ckpt
            basis = f"checkpoint format (int4 + bf16 scale per 32 columns); {name}'s resident layout not counted"
    else:
        bpe = None  # from the sizes of the expert files kt-kernel writes (below)
        ckpt = None
        basis = None

    wc = ext.WorkerPoolConfig()
    wc.subpool_count = 1
    wc.subpool_numa_map = [0]
    wc.subpool_thread_count = [threads]
    cpu = ext.CPUInfer(wc)

    def bf16_bits(a32):
        return (np.ascontiguousarray(a32, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)

    def bf16_round(a32):
        u = np.ascontiguousarray(a32, dtype=np.float32).view(np.uint32)
        return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)

    def make_config(n_experts):
        mask = np.zeros(n_experts, dtype=np.bool_)
        cfg = ext.moe.MOEConfig(n_experts, K, H, F, mask.ctypes.data)
        cfg.layer_idx = 0
        cfg.pool = cpu.backend_
        cfg.max_len = max_len
        return cfg, mask

    shapes = {"gate": (F, H), "up": (F, H), "down": (H, F)}
    ref = {}  # expert 0's integer weights and scales, for the numpy check
    keep = []  # buffers kt-kernel reads from (alive until loaded)
    tmpdir = tempfile.mkdtemp(prefix="kt-anchor-")
    t0 = time.perf_counter()
    say(f"{fmt} ({name}, variant {variant}): generating {DISTINCT} experts of H{H} F{F}")
    try:
        if fmt in ("amxint4", "amxint8"):
            # bf16 weights q * s with q in [-7, 7] (7 in every row) and s a power of two per row: kt-kernel's
            # per-row quantization (amax / 112 for int4) represents them exactly. Quantized online by a small
            # layer of the distinct experts that saves them, then every pool layer loads its experts from
            # those files (physical expert i <- file of expert i % DISTINCT: distinct memory, same values).
            src = {}
            for mat, (rows, cols) in shapes.items():
                buf = np.empty((DISTINCT, rows, cols), dtype=np.uint16)
                for d in range(DISTINCT):
                    q = rng.integers(-7, 8, size=(rows, cols), dtype=np.int8)
                    q[:, 0] = 7
                    s = (2.0 ** rng.integers(-8, -4, size=rows)).astype(np.float32)
                    buf[d] = bf16_bits(q.astype(np.float32) * s[:, None])
                    if d == 0:
                        ref[mat] = (q, s)
                src[mat] = buf
            del buf
            cfg, mask = make_config(DISTINCT)
            cfg.gate_proj, cfg.up_proj, cfg.down_proj = (src[m].ctypes.data for m in ("gate", "up", "down"))
            cfg.save, cfg.load, cfg.path = True, False, tmpdir
            small = cls(cfg)
            p2l = np.arange(DISTINCT, dtype=np.int64)
            cpu.submit(small.load_weights_task(p2l.ctypes.data))
            cpu.sync()
            keep.append((small, mask, p2l))
            del src
            sizes = {}
            pat = re.compile(r"_(gate|up|down)_0_(\d+)Byte_(quant|scale)_\.kt$")
            for path in glob.glob(os.path.join(tmpdir, "**", "*.kt"), recursive=True):
                m = pat.search(path)
                if m:
                    sizes[(m.group(1), m.group(3))] = os.path.getsize(path)
            if len(sizes) != 6:
                return {"ok": False, "error": f"kt-kernel wrote {len(sizes)} of the 6 files of expert 0 to {tmpdir}"}
            bpe = sum(sizes.values())
            ckpt = bpe
            per_row = "one fp32 scale per output row" if fmt == "amxint4" else "one fp32 scale per output row (int8)"
            basis = (f"kt-kernel's resident {fmt.upper()} format: quantized weights + {per_row} "
                     f"(sizes of the expert files it saves: {json.dumps({f'{a}_{b}': v for (a, b), v in sorted(sizes.items())})})")
        else:
            # RAWINT4 (compressed-tensors pack-quantized, g32): int32 words of 8 nibbles (value + 8, value j at
            # bits 4j), bf16 scales [rows, cols / 32]; here q in [-8, 7] and power-of-two scales (exact).
            src = {}
            for mat, (rows, cols) in shapes.items():
                packed = np.empty((DISTINCT, rows, cols // 8), dtype=np.uint32)
                scales = np.empty((DISTINCT, rows, cols // 32), dtype=np.uint16)
                for d in range(DISTINCT):
                    q = rng.integers(-8, 8, size=(rows, cols), dtype=np.int8)
                    v = (q.astype(np.int16) + 8).astype(np.uint32).reshape(rows, cols // 8, 8)
                    w = v[:, :, 0].copy()
                    for j in range(1, 8):
                        w |= v[:, :, j] << np.uint32(4 * j)
                    packed[d] = w
                    del v, w
                    s = (2.0 ** rng.integers(-8, -4, size=(rows, cols // 32))).astype(np.float32)
                    scales[d] = bf16_bits(s)
                    if d == 0:
                        ref[mat] = (q, s)
                src[mat] = (packed, scales)
        say(f"generated in {time.perf_counter() - t0:.1f} s; {bpe} bytes per expert ({bpe / params:.4f} per weight)")

        # The pool: at least pool_bytes of experts. Up to the model's routed experts it is one layer of that
        # many experts; past it, several layers of E experts each (kt-kernel chooses its AMX or AVX-512 path
        # from qlen against 4 * experts / top_k, so a layer never holds more experts than the model has).
        # A layer object holds a multiple of 8 experts where the model allows: kt-kernel 0.7.2's RAWINT4 layer
        # (AMXInt4_KGroup_MOE) crashed at its first forward with an odd expert count (7, 9, 17, 23 here).
        pool = max(8, 8 * math.ceil(spec["pool_bytes"] / bpe / 8))
        if pool < E:
            layers, epl = 1, pool
        else:
            layers, epl = math.ceil(pool / E), E
        pool = layers * epl
        distinct = min(DISTINCT, epl)
        say(f"pool: {pool} experts ({pool * bpe / 1e9:.2f} GB) in {layers} layer object(s) of {epl} experts")
        rss0 = rss_bytes()
        t1 = time.perf_counter()
        moes = []
        p2l = (np.arange(epl) % distinct).astype(np.int64)
        for _ in range(layers):
            cfg, mask = make_config(epl)
            if fmt == "rawint4":
                cfg.quant_config.bits = 4
                cfg.quant_config.group_size = 32
                cfg.quant_config.zero_point = False
                cfg.gate_proj, cfg.up_proj, cfg.down_proj = (src[m][0].ctypes.data for m in ("gate", "up", "down"))
                cfg.gate_scale, cfg.up_scale, cfg.down_scale = (src[m][1].ctypes.data for m in ("gate", "up", "down"))
            else:
                cfg.save, cfg.load, cfg.path = False, True, tmpdir
            moe = cls(cfg)
            cpu.submit(moe.load_weights_task(p2l.ctypes.data))
            cpu.sync()
            moes.append((moe, mask, cfg))  # kt-kernel may keep pointers into the config and mask
        load_s = time.perf_counter() - t1
        rss_growth = rss_bytes() - rss0
        say(f"loaded in {load_s:.1f} s; resident +{rss_growth / 1e9:.2f} GB ({rss_growth / pool / 1e6:.2f} MB per expert)")
    finally:
        # The sources go before the check: what kt-kernel computes with must be its own copy.
        shutil.rmtree(tmpdir, ignore_errors=True)
    if fmt == "rawint4":
        for packed, scales in src.values():
            packed.fill(0)
            scales.fill(0)

    x_bits = bf16_round(rng.standard_normal((max_len, H)).astype(np.float32))
    out = np.zeros((max_len, H), dtype=np.uint16)
    ids = np.zeros(max_len * K, dtype=np.int64)
    w_decode = np.full(max_len * K, 1.0 / K, dtype=np.float32)
    w_one = np.ones(max_len, dtype=np.float32)
    bsz = np.zeros(1, dtype=np.int64)

    def as_f32(bits):
        return (bits.astype(np.uint32) << 16).view(np.float32)

    def run(layer, qlen, k, weights):
        bsz[0] = qlen
        task = moes[layer][0].forward_task(bsz.ctypes.data, k, ids.ctypes.data, weights.ctypes.data,
                                           x_bits.ctypes.data, out.ctypes.data, False)
        t = time.perf_counter()
        cpu.submit(task)
        cpu.sync()
        return time.perf_counter() - t

    # Check: one token on physical experts that hold generated expert 0, against numpy.
    def dequant(mat):
        q, s = ref[mat]
        if fmt == "rawint4":
            return q.astype(np.float32) * np.repeat(s, 32, axis=1)
        return q.astype(np.float32) * s[:, None]

    xr = as_f32(x_bits[0])
    g, u = dequant("gate") @ xr, dequant("up") @ xr
    y_ref = dequant("down") @ (g / (1.0 + np.exp(-g)) * u)
    checks = []
    last = ((epl - 1) // distinct) * distinct
    for layer, phys in sorted({(0, 0), (layers - 1, last)}):
        ids[0] = phys
        run(layer, 1, 1, w_one)
        y = as_f32(out[0])
        err = float(np.linalg.norm(y - y_ref) / max(np.linalg.norm(y_ref), 1e-30))
        checks.append({"layer": layer, "expert": phys, "rel_err": err, "finite": bool(np.isfinite(y).all())})
    max_err = max(c["rel_err"] for c in checks)
    check = {"tolerance": CHECK_TOLERANCE, "max_rel_err": max_err, "points": checks,
             "sources_cleared": True,
             "what": "one token, k=1, weight 1 on pool experts holding generated expert 0, against numpy "
                     "(silu(x Wg) * (x Wu)) Wd from the same integer weights and scales, after kt-kernel's "
                     "sources were cleared (zeroed / files deleted)"}
    ok = all(c["finite"] for c in checks) and max_err <= CHECK_TOLERANCE
    say(f"check against numpy: max relative error {max_err:.4f} ({'ok' if ok else 'FAILED'})")
    if not ok:
        return {"ok": False, "error": f"kt-kernel output does not match the numpy reference: {checks}", "check": check}

    # The cases, routed as `bench kernels` routes them.
    state = {"offset": 0, "decode_calls": 0, "prefill_calls": 0}

    def call(kind, n):
        if kind == "decode":
            logical = np.argsort(rng.random((n, E)), axis=1)[:, :K]  # top-k uniform without replacement
            uniq = np.unique(logical)  # ascending
            touched = int(uniq.size)
            if layers == 1:
                # As ours: the call's touched experts, ascending, take consecutive physical slots
                # from the rotation's offset (no two share one unless the call touches more than
                # the pool holds); the rotation then moves past them.
                phys = (state["offset"] + np.searchsorted(uniq, logical)) % epl
                layer = 0
                state["offset"] = (state["offset"] + touched + 1) % epl
            else:
                layer = state["decode_calls"] % layers
                phys = logical
            state["decode_calls"] += 1
            ids[: n * K] = phys.ravel()
            secs = run(layer, n, K, w_decode)
            pairs = n * K
        else:
            c = state["prefill_calls"]
            state["prefill_calls"] += 1
            if layers == 1:
                layer, phys = 0, c % epl
            else:
                layer, phys = c % layers, (c // layers) % epl
            ids[:n] = phys
            secs = run(layer, n, 1, w_one)
            touched, pairs = 1, n
        return {"bytes": touched * bpe, "ops": 2.0 * pairs * params, "touched": touched, "secs": secs, "calls": 1}

    cases = [{"kind": "decode", "batch": b} for b in batches]
    if prefill > 0:
        cases.append({"kind": "prefill", "batch": prefill})
    for c in cases:
        c["call_s"] = call(c["kind"], c["batch"])["secs"]  # warm-up, as ours
        c["slots"] = []
        c["output_finite"], c["output_nonzero_share"] = None, None
    deadline = time.perf_counter() + spec["seconds"]
    order = list(range(len(cases)))
    reps_done = 0
    stopped = None
    for rep in range(max(1, spec["repeats"])):
        for i in order:
            c = cases[i]
            guaranteed = rep == 0 and i == order[0]
            if not guaranteed and time.perf_counter() + 1.2 * max(c["call_s"], SLOT_S) > deadline:
                stopped = f"--kt-seconds {spec['seconds']} reached in repetition {rep + 1}"
                break
            slot = {"bytes": 0.0, "ops": 0.0, "touched": 0, "secs": 0.0, "calls": 0}
            while slot["calls"] == 0 or slot["secs"] < SLOT_S:
                r = call(c["kind"], c["batch"])
                for key in slot:
                    slot[key] += r[key]
            c["slots"].append(slot)
            c["call_s"] = slot["secs"] / slot["calls"]
            y = as_f32(out[: c["batch"]])  # the slot's last output: kt-kernel really computed
            c["output_finite"] = bool(np.isfinite(y).all())
            c["output_nonzero_share"] = float(np.count_nonzero(y) / y.size)
        if stopped:
            break
        reps_done = rep + 1
        order.reverse()
    if stopped:
        say(stopped)
    dispatch = None
    if name in ("AMXInt4_MOE", "AMXInt8_MOE"):
        dispatch = {"threshold_used": 4 * epl // K, "threshold_full_layer": 4 * E // K,
                    "rule": "AMX tiles when qlen > 4 * experts / top_k, else AVX-512 (AMX_MOE_TP::do_gate_up_gemm)"}
    return {
        "ok": True, "format": fmt, "kt_class": name, "kt_variant": variant, "kt_version": version,
        "bytes_per_expert": bpe, "bytes_per_expert_basis": basis, "bytes_per_expert_checkpoint": ckpt,
        "pool_experts": pool, "experts_per_layer": epl, "layers": layers, "distinct_experts": distinct,
        "pool_bytes": pool * bpe, "rss_growth_bytes": rss_growth, "load_s": load_s, "check": check,
        "cases": cases, "repetitions_done": reps_done, "stopped": stopped, "dispatch": dispatch,
        "threads": threads, "max_len": max_len,
    }


# ----------------------------------------------------------------------------------------------
# The parent: our bench, the kt-kernel processes, the table and the JSON.


def mem_available():
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def resolve_model(exm, name):
    """H, F, routed experts, top-k and our bytes per expert of a preset (or model TOML file)."""
    p = subprocess.run([exm, "models", name, "--toml"], capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"error: `expertmesh models {name}` failed: {p.stderr.strip() or p.stdout.strip()}")
    if tomllib is not None:
        t = tomllib.loads(p.stdout)
    else:  # flat `key = value` lines are all this needs
        t, section = {}, None
        for line in p.stdout.splitlines():
            line = line.strip()
            if line.startswith("["):
                section = line.strip("[]")
                t.setdefault(section, {})
            elif "=" in line:
                k, v = (s.strip() for s in line.split("=", 1))
                v = v.strip('"')
                (t[section] if section else t)[k] = int(v) if v.isdigit() else v
    quant = t.get("quant", {})
    gs = int(quant.get("group_size", 32))
    scale_bytes = 4 if str(quant.get("scale_dtype", "bf16")) in ("f32", "fp32") else 2
    h, f = int(t["hidden"]), int(t["moe_intermediate"])
    return {
        "name": t.get("name", name), "hidden": h, "intermediate": f,
        "experts": int(t["routed_experts"]), "top_k": int(t["top_k"]),
        "our_expert_bytes": 3 * (h * f // 2 + scale_bytes * (h * f // gs)),
    }


def run_ours(exm, args, models, seconds, repeats, json_path, batches, prefill, quiet):
    cmd = [exm, "bench", "kernels", "--threads", str(args.threads), "--seconds", str(seconds),
           "--repeats", str(repeats), "--models", ",".join(models), "--batches", ",".join(map(str, batches)),
           "--prefill-tokens", str(prefill), "--json", json_path]
    if args.pool_mib and not quiet:
        cmd += ["--pool-mib", str(args.pool_mib)]
    if not quiet:
        log("$ " + " ".join(cmd))
    p = subprocess.run(cmd, stdout=subprocess.PIPE if quiet else None, stderr=subprocess.STDOUT if quiet else None,
                       text=True)
    if p.returncode != 0:
        if quiet and p.stdout:
            log(p.stdout[-3000:])
        return None
    with open(json_path) as f:
        return json.load(f)


def limits_of(report):
    m = report["machine"]
    return {
        "read_gbs": m.get("read_bandwidth_gbs_median"),
        "int8_tops": m.get("int8_peak_tops_median"),
        "amx_tops": m.get("amx_contract_tops_median"),
    }


def roofline(lim, bytes_, ops, kind):
    """As benches/src/method/roofline.rs: the least time of `bytes_` read and `ops` done, as a byte rate
    (GB/s, decode) or an op rate (TOPS, prefill), and which side bounds it."""
    bw = (lim["read_gbs"] or 0.0) * 1e9
    peak = max(lim["int8_tops"] or 0.0, lim["amx_tops"] or 0.0) * 1e12
    mem = bytes_ / bw if bw > 0 else 0.0
    comp = ops / peak if peak > 0 else 0.0
    t, bound = (comp, "compute") if comp > mem else (mem, "memory")
    if t <= 0:
        return 0.0, bound
    return (bytes_ / t / 1e9, bound) if kind == "decode" else (ops / t / 1e12, bound)


def kt_rows(block, model, lim, lim_reread, anchor, ours_by_key, differs):
    rows = []
    fmt = block["format"]
    for c in block["cases"]:
        slots = c["slots"]
        if not slots:
            continue
        kind, b = c["kind"], c["batch"]
        unit = "GB/s" if kind == "decode" else "TOPS"
        achieved = [(s["bytes"] / s["secs"] / 1e9) if kind == "decode" else (s["ops"] / s["secs"] / 1e12)
                    for s in slots]
        tot = {k: sum(s[k] for s in slots) for k in ("bytes", "ops", "touched", "secs", "calls")}
        limit, bound = roofline(lim, tot["bytes"], tot["ops"], kind)
        a = spread(achieved)
        ratios = spread([x / limit for x in achieved]) if limit > 0 else spread([])
        lat = spread([s["secs"] / s["calls"] * 1e6 for s in slots])
        name = f"kt-kernel {fmt} {kind} {model['name']} H{model['hidden']} F{model['intermediate']}"
        r = {
            "name": name, "batch": b, "achieved": a["median"], "limit": limit, "unit": unit,
            "ratio": a["median"] / limit if limit > 0 else 0.0, "better": "higher",
            "anchor": anchor,
            "achieved_p10": a["p10"], "achieved_p90": a["p90"], "limit_p10": limit, "limit_p90": limit,
            "ratio_median_of_pairs": ratios["median"], "ratio_p10": ratios["p10"], "ratio_p90": ratios["p90"],
            "repetitions": a["n"],
            "samples": {"achieved": achieved, "limit": [limit] * len(achieved)},
            "limit_kind": ("roofline min(bytes / read bandwidth, int8 ops / max(int8 peak, AMX contract loop)) "
                           "from the medians of expertmesh's limits in this file's machine section (our run; "
                           "not re-sampled per kt-kernel repetition)"),
            "bound": bound, "mode": f"kt-kernel {fmt}", "kt_class": block["kt_class"],
            "kt_variant": block["kt_variant"],
            "bytes_per_expert": block["bytes_per_expert"],
            "bytes_per_expert_basis": block["bytes_per_expert_basis"],
            "bytes_per_expert_checkpoint": block["bytes_per_expert_checkpoint"],
            "experts_touched": tot["touched"] / tot["calls"],
            "tokens_per_expert": tot["ops"] / 2.0 / (3 * model["hidden"] * model["intermediate"]) / tot["touched"],
            "ops_per_byte": tot["ops"] / tot["bytes"], "int8_tops": tot["ops"] / tot["secs"] / 1e12,
            "latency_us": lat["median"], "latency_us_p10": lat["p10"], "latency_us_p90": lat["p90"],
            "calls": tot["calls"], "threads": block["threads"],
            "pool_bytes": block["pool_bytes"], "pool_experts": block["pool_experts"],
            "experts_per_layer": block["experts_per_layer"], "layer_objects": block["layers"],
            "activations": "bf16 input and output (kt-kernel's interface)",
            "output_finite": c["output_finite"], "output_nonzero_share": c["output_nonzero_share"],
            "differs": differs,
        }
        if kind == "decode":
            bw = lim["read_gbs"] or 0.0
            r["ratio_vs_read_bandwidth"] = a["median"] / bw if bw > 0 else None
        else:
            r["ratio_vs_int8_peak"] = a["median"] / lim["int8_tops"] if lim["int8_tops"] else None
            r["ratio_vs_amx_contract"] = a["median"] / lim["amx_tops"] if lim["amx_tops"] else None
        if lim_reread:
            lr, _ = roofline(lim_reread, tot["bytes"], tot["ops"], kind)
            r["limit_reread"] = lr
            r["ratio_vs_reread"] = a["median"] / lr if lr > 0 else None
            r["limit_reread_is"] = ("the same roofline from the mean of the `bench kernels` limit re-reads "
                                    "just before and just after this kt-kernel block")
        ours = ours_by_key.get((f"{'decode' if kind == 'decode' else 'prefill'}-exact {model['name']} "
                                f"H{model['hidden']} F{model['intermediate']}", b))
        if ours:
            if kind == "decode" and ours.get("latency_us") and ours.get("experts_touched"):
                ours_rate = ours["experts_touched"] / ours["latency_us"]
                kt_rate = r["experts_touched"] / r["latency_us"] if r["latency_us"] > 0 else 0.0
                r["speed_vs_ours"] = kt_rate / ours_rate if ours_rate > 0 else None
                r["speed_vs_ours_is"] = "experts per second (touched experts / median call latency), kt-kernel over ours"
            elif kind == "prefill" and ours.get("achieved"):
                r["speed_vs_ours"] = a["median"] / ours["achieved"]
                r["speed_vs_ours_is"] = "int8-equivalent ops per second, kt-kernel over ours"
        if r["ratio"] > 1.02:
            r["bench_bug"] = True
        rows.append(r)
    return rows


def fmt_row(r, width, source, speed=None):
    sp = f"{r['ratio_p10']:.3f}-{r['ratio_p90']:.3f}" if "ratio_p10" in r else ""
    reps = str(r.get("repetitions", ""))
    x = f"{speed:.2f}x" if speed is not None else ""
    bug = "  BENCH BUG" if r.get("bench_bug") else ""
    return (f"{r['name']:<{width}} {r['batch']:>6} {r['achieved']:>10.3f} {r['limit']:>10.3f} {r['unit']:>6} "
            f"{r['ratio']:>7.3f} {sp:>13} {reps:>4} {x:>7}  {source}{bug}")


def main():
    ap = argparse.ArgumentParser(
        description="kt-kernel's CPU MoE kernels beside `expertmesh bench kernels`, same shapes, routing, "
                    "batches, threads and limits (issue 26 item 6).",
        epilog=f"Install kt-kernel: {INSTALL}")
    ap.add_argument("--expertmesh", default="./target/release/expertmesh", help="our binary")
    ap.add_argument("--models", default="kimi-k2,qwen3-30b-a3b")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--prefill-tokens", type=int, default=256, help="tokens per expert (0 skips prefill)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--seconds", type=float, default=300.0, help="our bench's --seconds")
    ap.add_argument("--repeats", type=int, default=21, help="repetitions per case, ours and kt-kernel's")
    ap.add_argument("--kt-threads", type=int, default=0,
                    help="kt-kernel worker threads (default: --threads); its dispatcher thread comes on top and "
                         "busy-waits during calls, so --threads - 1 gives it a CPU of its own")
    ap.add_argument("--kt-seconds", type=float, default=30.0,
                    help="measuring time per model and kt-kernel format, after its setup (default 30)")
    ap.add_argument("--formats", default=DEFAULT_FORMATS, help=f"kt-kernel formats among {','.join(FORMATS)}")
    ap.add_argument("--pool-mib", type=int, default=0,
                    help="weight pool per model, ours and kt-kernel's (default: ours as it chooses, "
                         "kt-kernel's max(1 GiB, our run's planned pool, machine.settings.pool_bytes), within half the memory available)")
    ap.add_argument("--reread-seconds", type=float, default=15.0,
                    help="a `bench kernels` run of this length after each kt-kernel block re-reads our limits "
                         "(0: none)")
    ap.add_argument("--ours-json", help="use this `bench kernels` JSON instead of running ours (its limits "
                                        "are then not from the same run as kt-kernel's rows)")
    ap.add_argument("--kt-python", default=sys.executable,
                    help="the Python that has kt-kernel and numpy (default: this one)")
    ap.add_argument("--json", help="write our JSON with kt-kernel's rows appended here")
    ap.add_argument("--verbose", action="store_true", help="show kt-kernel's own output")
    ap.add_argument("--_probe", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--_worker", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args._probe:
        probe_main()
        return 0
    if args._worker:
        worker_main(args._worker)
        return 0

    try:
        batches = [int(b) for b in args.batches.split(",") if b.strip()]
        model_names = [m.strip() for m in args.models.split(",") if m.strip()]
        formats = [f.strip().lower() for f in args.formats.split(",") if f.strip()]
    except ValueError as e:
        log(f"error: {e}")
        return 2
    bad = [f for f in formats if f not in FORMATS]
    args.kt_threads = args.kt_threads or args.threads
    if bad or not batches or not model_names or args.threads < 1 or args.kt_threads < 1 or min(batches) < 1:
        log(f"error: bad options (formats {bad or formats}, batches {batches}, models {model_names}, "
            f"threads {args.threads})")
        return 2

    # 1. kt-kernel, in a process of its own (a variant this CPU cannot run must not take this one down).
    p = subprocess.run([args.kt_python, os.path.abspath(__file__), "--_probe"], capture_output=True, text=True)
    probe = None
    for line in reversed(p.stdout.strip().splitlines()):
        try:
            probe = json.loads(line)
            break
        except ValueError:
            continue
    if not probe or not probe.get("ok"):
        why = (probe or {}).get("error") or (p.stderr.strip().splitlines() or [f"exit {p.returncode}"])[-1]
        log(f"kt-kernel is not available to {args.kt_python}: {why}")
        log(f"install it: {INSTALL}")
        return 2
    if probe["version"] != KT_VERSION_TESTED:
        log(f"note: kt-kernel {probe['version']} (this script was written against {KT_VERSION_TESTED})")
    log(f"kt-kernel {probe['version']}, variant {probe['variant']} ({probe['python']}); formats: "
        + ", ".join(f"{f} -> {v['class'] or 'unavailable'}" for f, v in probe["formats"].items() if f in formats))

    exm = args.expertmesh
    if not (os.path.isfile(exm) and os.access(exm, os.X_OK)):
        log(f"error: {exm} is not an executable (build it: cargo build --release)")
        return 2
    models = [resolve_model(exm, m) for m in model_names]

    # 2. Ours.
    work = tempfile.mkdtemp(prefix="kt-anchor-run-")
    try:
        if args.ours_json:
            with open(args.ours_json) as f:
                ours = json.load(f)
            log(f"our rows and limits from {args.ours_json} (not the same run as kt-kernel's rows)")
        else:
            ours = run_ours(exm, args, [m["name"] for m in models], args.seconds, args.repeats,
                            os.path.join(work, "ours.json"), batches, args.prefill_tokens, quiet=False)
            if ours is None:
                log("error: `expertmesh bench kernels` failed")
                return 2
        lim0 = limits_of(ours)
        if not lim0["read_gbs"] or not lim0["int8_tops"]:
            log("error: our JSON has no machine.read_bandwidth_gbs_median / int8_peak_tops_median")
            return 2
        settings = ours["machine"].get("settings", {})
        llc = ours["machine"].get("llc_bytes") or 0
        ours_by_key = {(r["name"], r["batch"]): r for r in ours["results"]}
        smallest = min(models, key=lambda m: m["our_expert_bytes"])["name"]
        log(f"our limits: read {lim0['read_gbs']:.2f} GB/s, int8 peak {lim0['int8_tops']:.3f} TOPS"
            + (f", AMX contract loop {lim0['amx_tops']:.3f} TOPS" if lim0["amx_tops"] else ""))

        # 3./4. kt-kernel, one process per model and format, each followed by a re-read of our limits.
        blocks, skipped, rereads, all_rows = [], [], [], []
        lim_before = lim0
        for model in models:
            for fmt in formats:
                label = f"{fmt} {model['name']}"
                if not probe["formats"][fmt]["class"]:
                    why = probe["formats"][fmt].get("why", "unavailable")
                    log(f"kt-kernel {label}: skipped ({why})")
                    skipped.append({"model": model["name"], "format": fmt, "why": why})
                    continue
                pool = args.pool_mib << 20 if args.pool_mib else max(1 << 30, int(settings.get("pool_bytes") or 0))
                avail = mem_available()
                notes = []
                if avail and pool > MEMORY_SHARE * avail:
                    pool = int(MEMORY_SHARE * avail)
                    notes.append(f"memory-limited: pool {pool >> 20} MiB, {MEMORY_SHARE:.0%} of {avail >> 20} MiB available")
                if llc and pool < 2 * llc:
                    notes.append(f"pool below 2x the {llc >> 20} MiB last-level cache: part of every figure is cache reads")
                for n in notes:
                    log(f"kt-kernel {label}: {n}")
                spec = {"format": fmt, "hidden": model["hidden"], "intermediate": model["intermediate"],
                        "experts": model["experts"], "top_k": model["top_k"], "threads": args.kt_threads,
                        "batches": batches, "prefill_tokens": args.prefill_tokens, "pool_bytes": pool,
                        "repeats": args.repeats, "seconds": args.kt_seconds, "seed": 7,
                        "out": os.path.join(work, f"kt-{fmt}-{model['name']}.json")}
                spec_path = os.path.join(work, f"spec-{fmt}-{model['name']}.json")
                with open(spec_path, "w") as f:
                    json.dump(spec, f)
                log(f"kt-kernel {label}: H{model['hidden']} F{model['intermediate']} E{model['experts']} "
                    f"top-{model['top_k']}, {args.kt_threads} worker threads, pool {pool / 1e9:.2f} GB, "
                    f"up to {args.kt_seconds:g} s of calls")
                log_path = os.path.join(work, f"kt-{fmt}-{model['name']}.log")
                with open(log_path, "w") as lf:
                    wp = subprocess.run([args.kt_python, os.path.abspath(__file__), "--_worker", spec_path],
                                        stdout=None if args.verbose else lf, stderr=None)
                res = None
                if os.path.exists(spec["out"]):
                    with open(spec["out"]) as f:
                        res = json.load(f)
                if wp.returncode != 0 or not res or not res.get("ok"):
                    why = (res or {}).get("error") or (
                        f"kt-kernel process killed by signal {-wp.returncode}" if wp.returncode < 0
                        else f"kt-kernel process ended with exit code {wp.returncode}")
                    with open(log_path) as lf:
                        tail = lf.read()[-1500:]
                    log(f"kt-kernel {label}: failed: {why}" + (f"\n--- its output (tail) ---\n{tail}" if tail else ""))
                    skipped.append({"model": model["name"], "format": fmt, "why": why})
                    continue
                res["notes"] = notes
                res["model"] = model["name"]
                lim_after = None
                if args.reread_seconds > 0:
                    rr = run_ours(exm, args, [smallest], args.reread_seconds, 5, os.path.join(work, "reread.json"),
                                  [1], 0, quiet=True)
                    if rr is None:
                        log("  limit re-read failed (see above); kt-kernel's rows keep our main run's limits only")
                    else:
                        lim_after = limits_of(rr)
                        lim_after["after"] = label
                        rereads.append(lim_after)
                        log(f"  limits re-read after {label}: read {lim_after['read_gbs']:.2f} GB/s, int8 peak "
                            f"{lim_after['int8_tops']:.3f} TOPS"
                            + (f", AMX {lim_after['amx_tops']:.3f} TOPS" if lim_after["amx_tops"] else ""))
                lim_reread = None
                if lim_after:
                    lim_reread = {}
                    for k in ("read_gbs", "int8_tops", "amx_tops"):
                        vals = [v for v in (lim_before[k], lim_after[k]) if v]
                        lim_reread[k] = sum(vals) / len(vals) if vals else None
                    lim_before = lim_after
                anchor = f"kt-kernel {res['kt_version']} {fmt}"
                differs = differences(res, model, settings, batches, args)
                res["differs"] = differs
                rows = kt_rows(res, model, lim0, lim_reread, anchor, ours_by_key, differs)
                all_rows.extend(rows)
                for c in res["cases"]:
                    if not c["slots"]:
                        skipped.append({"model": model["name"], "format": fmt, "case": f"{c['kind']} {c['batch']}",
                                        "why": "set up, but no repetition fitted in --kt-seconds"})
                blocks.append(res)

        # 5. The table and the JSON.
        print_table(ours, all_rows, models, formats, batches, args.prefill_tokens, lim0, blocks, rereads)
        for s in skipped:
            log(f"skipped: kt-kernel {s['format']} {s['model']}{' ' + s['case'] if 'case' in s else ''}: {s['why']}")
        if args.json:
            report = ours
            report["results"] = list(ours["results"]) + all_rows
            report["machine"]["kt_anchor"] = {
                "kt_kernel_version": probe["version"], "variant": probe["variant"], "python": probe["python"],
                "int8_kernel": probe.get("int8_kernel"), "rawint4_kernel": probe.get("rawint4_kernel"),
                "limits_used": lim0, "limit_rereads": rereads, "ours_from_file": args.ours_json,
                "kt_seconds": args.kt_seconds, "repeats": args.repeats, "threads": args.threads,
                "kt_threads": args.kt_threads,
                "blocks": [{k: v for k, v in b.items() if k != "cases"} for b in blocks],
                "skipped": skipped, "command": sys.argv,
                "comparison": ("speed only: kt-kernel's formats are not our exact contract (AMXINT4: int4, one fp32 "
                               "scale per output row; RAWINT4: int4 with a scale per group of 32, fp32 in memory)"),
            }
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1)
            log(f"wrote {args.json}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


def differences(res, model, settings, batches, args):
    """What differs from our bench in this kt-kernel block, in words."""
    d = []
    d.append(f"bytes per expert {res['bytes_per_expert']} ({res['bytes_per_expert'] / (3 * model['hidden'] * model['intermediate']):.4f} "
             f"per weight, kt-kernel's {res['format']} format) vs ours {model['our_expert_bytes']} (int4 + bf16 scale per 32)")
    ours_pool = settings.get("pool_bytes")
    d.append(f"pool {res['pool_bytes'] / 1e9:.2f} GB = {res['pool_experts']} experts in {res['layers']} layer object(s) "
             f"of {res['experts_per_layer']} ({res['distinct_experts']} generated, the rest copies)"
             + (f"; ours planned {ours_pool / 1e9:.2f} GB (machine.settings.pool_bytes; a short run loads less, "
                "as its output says)" if ours_pool else ""))
    if res["experts_per_layer"] < model["experts"]:
        d.append(f"a layer object holds {res['experts_per_layer']} of the model's {model['experts']} experts: logical "
                 f"experts map to physical (e + offset) % {res['experts_per_layer']} as ours")
    dis = res.get("dispatch")
    if dis and dis["threshold_used"] != dis["threshold_full_layer"]:
        lo, hi = sorted((dis["threshold_used"], dis["threshold_full_layer"]))
        hit = [b for b in batches + ([args.prefill_tokens] if args.prefill_tokens else []) if lo < b <= hi]
        d.append(f"kt-kernel's AMX/AVX-512 switch at qlen > {dis['threshold_used']} here, {dis['threshold_full_layer']} with "
                 f"a full layer" + (f": qlen {hit} takes the other path than a full layer would" if hit else
                                    " (no requested qlen falls between)"))
    d.append("activations bf16 in and out (ours: f32 in, f32 per-slot out)")
    d.append(f"{res['threads']} kt-kernel worker thread(s) plus its dispatcher thread, which busy-waits during calls "
             f"({res['threads'] + 1} busy threads; ours: {args.threads})")
    d.append("prefill: N tokens on one expert per call (forward with k=1), rotating over the pool, as ours")
    return d


def print_table(ours, kt, models, formats, batches, prefill, lim, blocks, rereads):
    by_key = {}
    for r in ours["results"]:
        by_key.setdefault((r["name"], r["batch"]), []).append((r, "ours"))
    kt_by = {}
    for r in kt:
        kt_by.setdefault((r["name"], r["batch"]), []).append(r)
    lines = []
    for m in models:
        shape = f"{m['name']} H{m['hidden']} F{m['intermediate']}"
        groups = [("decode", b) for b in batches] + [("accurate", 1)] + ([("prefill", prefill)] if prefill else [])
        for kind, b in groups:
            ours_name = {"decode": "decode-exact", "accurate": "decode-accurate", "prefill": "prefill-exact"}[kind]
            for r, _ in by_key.get((f"{ours_name} {shape}", b), []):
                lines.append((r, "ours", None))
            if kind != "accurate":
                for fmt in formats:
                    for r in kt_by.get((f"kt-kernel {fmt} {kind} {shape}", b), []):
                        lines.append((r, r["anchor"], r.get("speed_vs_ours")))
    shown = {id(r) for r, _, _ in lines}
    lines += [(r, "ours", None) for r in ours["results"] if id(r) not in shown]
    if not lines:
        log("no results")
        return
    width = max(len(r["name"]) for r, _, _ in lines)
    log("")
    log(f"{'name':<{width}} {'batch':>6} {'achieved':>10} {'limit':>10} {'unit':>6} {'ratio':>7} "
        f"{'ratio p10-p90':>13} {'reps':>4} {'x ours':>7}  source")
    for r, src, sp in lines:
        log(fmt_row(r, width, src, sp))
    log("")
    log(f"limits (our run's medians, used for every row's ratio): read {lim['read_gbs']:.2f} GB/s, int8 peak "
        f"{lim['int8_tops']:.3f} TOPS" + (f", AMX contract loop {lim['amx_tops']:.3f} TOPS" if lim["amx_tops"] else "")
        + "; decode limit = read bandwidth unless compute-bound, prefill = max(int8 peak, AMX contract loop) "
          "unless memory-bound (the roofline of `bench kernels`)")
    for r in kt:
        extra = []
        if r.get("ratio_vs_int8_peak") is not None:
            extra.append(f"{r['ratio_vs_int8_peak']:.3f} of the int8 peak")
        if r.get("ratio_vs_amx_contract") is not None:
            extra.append(f"{r['ratio_vs_amx_contract']:.3f} of the AMX contract loop")
        if r.get("ratio_vs_reread") is not None:
            extra.append(f"{r['ratio_vs_reread']:.3f} of the limits re-read around it")
        if extra:
            log(f"  {r['name']} B={r['batch']}: " + ", ".join(extra))
    if rereads:
        bws = [lim["read_gbs"]] + [x["read_gbs"] for x in rereads if x["read_gbs"]]
        if max(bws) / min(bws) > LIMIT_MOVED:
            log(f"NOTE: the read limit moved between our run and the re-reads ({min(bws):.2f}-{max(bws):.2f} GB/s): "
                "compare ratio_vs_reread in the JSON before reading a decode difference as the kernels'")
    log("x ours: kt-kernel's speed over ours on the same case (decode: experts read per second at the same routing; "
        "prefill: ops per second)")
    log("NOTE: kt-kernel's formats are not our exact contract (AMXINT4: int4 with one fp32 scale per output row; "
        "RAWINT4: int4 with a scale per group of 32, fp32 in memory; ours: int4 with a bf16 scale per group of 32 and "
        "the exact-mode arithmetic contract): this compares speed only, not accuracy.")
    for b in blocks:
        log(f"kt-kernel {b['format']} {b['model']}: {b['kt_class']} ({b['kt_variant']}), {b['bytes_per_expert']} bytes per "
            f"expert counted = {b['bytes_per_expert_basis']}; numpy check max relative error "
            f"{b['check']['max_rel_err']:.4f}; resident +{b['rss_growth_bytes'] / 1e9:.2f} GB for a "
            f"{b['pool_bytes'] / 1e9:.2f} GB pool; {b['repetitions_done']} repetitions"
            + (f" ({b['stopped']})" if b.get("stopped") else ""))
        for d in b.get("differs", [])[1:]:
            log(f"    differs: {d}")


if __name__ == "__main__":
    sys.exit(main())
