#!/usr/bin/env python3
"""Print the workspace's crate graph and check its layering rules (exit 1 on a violation).

Why this exists: ARCHITECTURE.md promises a layered workspace: `quant` at the bottom depending
on nothing of ours, the `backend` trait crate depending on no implementation, `hip-kernels` a
leaf that only the worker and the binary use, the file parser and the transport free of
kernels, the launcher (`fabric`) free of the measurement method (`benches`), and the command
line (clap) and the catch-all error type (anyhow) only in the binary. This script reads `cargo metadata` and fails CI when a dependency breaks that.

Usage: scripts/crate-graph.py [--dot]
"""
import json
import subprocess
import sys

# crate -> the workspace crates it may depend on (normal and build dependencies).
ALLOWED = {
    "expertmesh-quant": set(),
    # Temporary files under a lock and the sweep of leftovers: std only, below everything.
    "expertmesh-files": set(),
    "expertmesh-backend": {"expertmesh-quant"},
    "expertmesh-cpu-backend": {"expertmesh-quant", "expertmesh-backend", "expertmesh-files"},
    "expertmesh-hip-kernels": {"expertmesh-quant", "expertmesh-backend"},
    "expertmesh-topology": {"expertmesh-quant"},
    "expertmesh-planner": {"expertmesh-quant", "expertmesh-topology", "expertmesh-files"},
    "expertmesh-shard": {"expertmesh-quant", "expertmesh-files"},
    "expertmesh-checkpoint": {
        "expertmesh-quant", "expertmesh-topology", "expertmesh-shard", "expertmesh-files",
    },
    "expertmesh-transport": {"expertmesh-quant", "expertmesh-files"},
    "expertmesh-router": {
        "expertmesh-quant", "expertmesh-backend", "expertmesh-topology", "expertmesh-transport",
    },
    "expertmesh-worker": {
        "expertmesh-quant", "expertmesh-backend", "expertmesh-cpu-backend",
        "expertmesh-hip-kernels", "expertmesh-topology", "expertmesh-transport",
        "expertmesh-router", "expertmesh-shard", "expertmesh-files",
    },
    # A fabric's processes on one host: composes the serving libraries, measures nothing.
    "expertmesh-fabric": {
        "expertmesh-topology", "expertmesh-planner", "expertmesh-transport",
        "expertmesh-router", "expertmesh-worker", "expertmesh-files",
    },
    # The benches measure the backends themselves, and start fabrics through the launcher.
    "expertmesh-benches": {
        "expertmesh-quant", "expertmesh-backend", "expertmesh-cpu-backend",
        "expertmesh-topology", "expertmesh-planner", "expertmesh-checkpoint",
        "expertmesh-transport", "expertmesh-router", "expertmesh-worker", "expertmesh-fabric",
    },
    # The binary and its commands: the top of the graph, anything below it.
    "expertmesh": {
        "expertmesh-quant", "expertmesh-topology", "expertmesh-planner",
        "expertmesh-checkpoint", "expertmesh-shard", "expertmesh-transport", "expertmesh-router",
        "expertmesh-worker", "expertmesh-fabric", "expertmesh-benches", "expertmesh-files",
    },
}
# External crates that belong to one layer: the command line and the binary's error type stay
# at the binary's edge, so libraries return typed errors (thiserror) and take plain options.
EXTERNAL_ONLY_IN = {
    "anyhow": {"expertmesh"},
    "clap": {"expertmesh"},
    "tracing-subscriber": {"expertmesh"},
}
# Backend implementations: only these crates may depend on them.
IMPLEMENTATIONS = {"expertmesh-cpu-backend", "expertmesh-hip-kernels"}
MAY_USE_IMPLEMENTATIONS = {"expertmesh-worker", "expertmesh-benches", "expertmesh"}


def main():
    meta = json.loads(subprocess.check_output(
        ["cargo", "metadata", "--format-version", "1", "--no-deps"]))
    members = {p["name"]: p for p in meta["packages"]}
    graph = {}
    external = {}
    for name, p in members.items():
        external[name] = {d["name"] for d in p["dependencies"]
                          if d["name"] not in members and d.get("kind") in (None, "build")}
        deps = {d["name"] for d in p["dependencies"]
                if d["name"] in members and d.get("kind") in (None, "build")}
        graph[name] = sorted(deps)
    if "--dot" in sys.argv:
        print("digraph crates {")
        for n, ds in sorted(graph.items()):
            for d in ds:
                print(f'  "{n}" -> "{d}";')
        print("}")
        return 0
    problems = []
    for n, ds in sorted(graph.items()):
        print(f"{n:26} -> {', '.join(ds) if ds else '(nothing of ours)'}")
        if n in ALLOWED:
            for d in ds:
                if d not in ALLOWED[n]:
                    problems.append(f"{n} depends on {d}, which its layer may not use")
        for d in ds:
            if d in IMPLEMENTATIONS and n not in MAY_USE_IMPLEMENTATIONS:
                problems.append(f"{n} depends on the backend implementation {d}")
    for n, ext in sorted(external.items()):
        for d in sorted(ext):
            if d in EXTERNAL_ONLY_IN and n not in EXTERNAL_ONLY_IN[d]:
                problems.append(f"{n} depends on {d}, which only {sorted(EXTERNAL_ONLY_IN[d])} may use")
    for n in ALLOWED:
        if n not in graph:
            problems.append(f"{n} is not a workspace member")
    for p in problems:
        print("layering violation:", p, file=sys.stderr)
    print(f"{len(problems)} layering violation(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
