"""``python -m expertmesh.bench --router ADDR``: the Python client against the Rust client.

For each batch size (tokens per call, 1 to 64 by default) it measures, on the fabric at
``--router``, in the same process and run:

* **throughput** — layer calls per second with ``--depth`` requests in flight on one
  connection (``submit`` / ``wait(out=)``), from Python and from the Rust client alone (the
  same loop in Rust with the GIL released: the limit);
* **latency** — p50 and p99 of sequential calls (``moe(out=)``), Python and Rust.

Python and Rust runs alternate in short runs (``--rounds`` pairs of about ``--seconds`` each,
the order swapped every round) so that drift on a shared machine hits both; throughput is the
median of the rounds (``paired_ratio_min``/``max``: the spread of the per-round ratios),
latencies are pooled over the rounds. The report has the shape of the other ExpertMesh benches (``expertmesh bench --help``):
``{"machine": {...}, "results": [{"name", "batch", "achieved", "limit", "unit", "ratio",
"better", ...}]}`` where ``achieved`` is Python, ``limit`` is Rust and ``ratio`` = achieved /
limit. The targets (issue 12): throughput ratio ≥ 0.9 at 64 tokens, latency ratio ≤ 1.2 at 1
token.

The layer and hidden size are asked from the router when not given (``--layer``,
``--hidden``): the first MoE layer it serves and its model's hidden size, read from its answers
to two probes that it refuses.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import re
import socket
import sys
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from . import _native
from ._errors import BadRequest, NotFound

__all__ = ["main", "discover", "run"]


def discover(client: _native.RouterClient) -> Tuple[int, int]:
    """The first MoE layer the router serves and its hidden size, from the router's refusals of
    a request for a layer it cannot serve and of one of hidden size 1."""
    layer = 0
    try:
        client.check_shape(2**32 - 1, 1, 1)
    except NotFound as e:
        m = re.search(r"serves MoE layers (\d+)\.\.=(\d+)", e.message)
        if not m:
            raise RuntimeError(f"cannot read the served layers from: {e}; pass --layer") from e
        layer = int(m.group(1))
    try:
        client.check_shape(layer, 1, 1)
    except BadRequest as e:
        m = re.search(r"\(hidden (\d+)\)", e.message)
        if not m:
            raise RuntimeError(f"cannot read the hidden size from: {e}; pass --hidden") from e
        return layer, int(m.group(1))
    return layer, 1


def _python_loop(
    c: _native.RouterClient, layer: int, x: np.ndarray, out: np.ndarray, n: int, depth: int
) -> Tuple[int, List[int]]:
    """The Python twin of ``_native._rust_loop``: ``(elapsed_ns, latencies_ns)``."""
    clock = time.perf_counter_ns
    moe, submit, wait = c.moe, c.submit, c.wait
    if depth == 1:
        lat = [0] * n
        t0 = clock()
        for i in range(n):
            t = clock()
            moe(layer, x, out=out)
            lat[i] = clock() - t
        return clock() - t0, lat
    q: "collections.deque[Any]" = collections.deque()
    t0 = clock()
    for _ in range(n):
        if len(q) == depth:
            wait(q.popleft(), out)
        q.append(submit(layer, x))
    while q:
        wait(q.popleft(), out)
    return clock() - t0, []


def _percentile(v: Sequence[int], p: float) -> float:
    return float(np.percentile(np.asarray(v, dtype=np.float64), p)) if v else 0.0


def run(
    addr: str,
    cluster: str = "single-host",
    secret: Optional[str] = None,
    *,
    layer: Optional[int] = None,
    hidden: Optional[int] = None,
    tokens: Sequence[int] = (1, 4, 16, 64),
    depth: int = 8,
    seconds: float = 0.25,
    rounds: int = 10,
    log: Any = None,
) -> List[Dict[str, Any]]:
    """Measure and return the results (see the module docs); progress lines go to ``log``."""
    c = _native.RouterClient(addr, cluster, secret)
    if layer is None or hidden is None:
        l, h = discover(c)
        layer = l if layer is None else layer
        hidden = h if hidden is None else hidden
    if log:
        print(f"router {c.addr}, layer {layer}, hidden {hidden}, depth {depth}", file=log)
    rng = np.random.default_rng(7)
    results: List[Dict[str, Any]] = []
    for t in tokens:
        x = rng.standard_normal((t, hidden), dtype=np.float32)
        out = np.empty_like(x)
        # Size the runs from a short calibration: about `seconds` each.
        n0 = 10
        el, _ = _python_loop(c, layer, x, out, n0, 1)
        per_call = max(el / n0, 1.0)
        n_lat = max(20, int(seconds * 1e9 / per_call))
        n_thr = max(40, int(seconds * 1e9 / per_call * min(depth, 4)))
        py_thr: List[float] = []
        rs_thr: List[float] = []
        py_lat: List[int] = []
        rs_lat: List[int] = []
        for r in range(rounds):
            order = ("rust", "python") if r % 2 == 0 else ("python", "rust")
            for who in order:
                if who == "rust":
                    # Alone on the router, as the Python loop is: an idle connection left
                    # open would make the router wait its batch window for the Rust calls
                    # (it skips the window only for a lone frontend), and the limit would be
                    # slower than the client it limits.
                    c.close()
                    el, _ = _native._rust_loop(addr, cluster, secret, layer, x, n_thr, depth, 10)
                    rs_thr.append(n_thr / (el / 1e9))
                    _, lat = _native._rust_loop(addr, cluster, secret, layer, x, n_lat, 1, 10)
                    rs_lat.extend(lat)
                    c = _native.RouterClient(addr, cluster, secret)
                else:
                    _python_loop(c, layer, x, out, 10, depth)  # warm-up, as the Rust loop
                    el, _ = _python_loop(c, layer, x, out, n_thr, depth)
                    py_thr.append(n_thr / (el / 1e9))
                    _, lat = _python_loop(c, layer, x, out, n_lat, 1)
                    py_lat.extend(lat)
        common = {"rounds": rounds, "layer": layer, "hidden": hidden}
        thr = (float(np.median(py_thr)), float(np.median(rs_thr)))
        paired = [p / r for p, r in zip(py_thr, rs_thr)]
        results.append(
            _result(
                "python_client_calls_per_s", t, thr[0], thr[1], "calls/s", common,
                depth=depth, calls=n_thr, paired_ratio_min=min(paired), paired_ratio_max=max(paired),
            )
        )
        for p in (50, 99):
            a, b = _percentile(py_lat, p) / 1e3, _percentile(rs_lat, p) / 1e3
            results.append(_result(f"python_client_latency_p{p}", t, a, b, "us", common, calls=len(py_lat)))
        if log:
            lo = results[-2]
            print(
                f"tokens {t:>3}: {thr[0]:9.1f} calls/s vs Rust {thr[1]:9.1f} (ratio {thr[0] / thr[1]:.3f}); "
                f"p50 {lo['achieved']:8.1f} us vs Rust {lo['limit']:8.1f} (ratio {lo['ratio']:.3f}); "
                f"p99 {results[-1]['achieved']:8.1f} us vs {results[-1]['limit']:8.1f}",
                file=log,
            )
    c.close()
    return results


def _result(
    name: str, batch: int, achieved: float, limit: float, unit: str, common: Dict[str, Any], **extra: Any
) -> Dict[str, Any]:
    return {
        "name": name,
        "batch": batch,
        "achieved": achieved,
        "limit": limit,
        "unit": unit,
        "ratio": achieved / limit if limit > 0 else 0.0,
        "better": "lower" if unit == "us" else "higher",
        "limit_is": "the Rust RouterClient running the same loop in this process (GIL released)",
        **common,
        **extra,
    }


def _machine() -> Dict[str, Any]:
    cpu = None
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "hostname": socket.gethostname(),
        "os": sys.platform,
        "arch": platform.machine(),
        "cpus": os.cpu_count(),
        "cpu_model": cpu,
        "python": platform.python_version(),
        "numpy": np.__version__,
    }


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m expertmesh.bench",
        description="Python client vs Rust client: MoE layer calls per second and latency p50/p99 "
        "on a running fabric (start one with `expertmesh up`).",
    )
    ap.add_argument("--router", required=True, help="router frontend address HOST:PORT")
    ap.add_argument("--cluster", default="single-host", help="cluster name (the topology's name)")
    ap.add_argument("--layer", type=int, help="MoE layer (default: the first the router serves)")
    ap.add_argument("--hidden", type=int, help="hidden size (default: asked from the router)")
    ap.add_argument("--tokens", default="1,4,16,64", help="tokens per call, comma-separated")
    ap.add_argument("--depth", type=int, default=8, help="requests in flight for the throughput runs")
    ap.add_argument("--seconds", type=float, default=0.25, help="about how long each run takes")
    ap.add_argument("--rounds", type=int, default=10, help="Python/Rust pairs per batch size")
    ap.add_argument("--json", help="write the report here")
    a = ap.parse_args(argv)
    tokens = [int(t) for t in a.tokens.split(",") if t]
    results = run(
        a.router,
        a.cluster,
        None,
        layer=a.layer,
        hidden=a.hidden,
        tokens=tokens,
        depth=max(1, a.depth),
        seconds=a.seconds,
        rounds=max(1, a.rounds),
        log=sys.stderr,
    )
    w = max(len(r["name"]) for r in results)
    print(f"{'name':<{w}} {'batch':>6} {'achieved':>12} {'limit':>12} {'unit':>8} {'ratio':>7}  direction")
    for r in results:
        print(
            f"{r['name']:<{w}} {r['batch']:>6} {r['achieved']:>12.3f} {r['limit']:>12.3f} "
            f"{r['unit']:>8} {r['ratio']:>7.3f}  {r['better']} is better"
        )
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"machine": _machine(), "results": results}, f, indent=2)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
