#!/usr/bin/env python3
"""Do several `expertmesh bench` JSON runs agree within their reported spreads?

For every figure (name, batch) present in all runs: it agrees when each run's median ratio lies
inside every other run's p10-p90 of the per-repetition ratios (the criterion of issue 17).
Prints one line per figure that does not, then `agree: N of M`, and also how many of them
`bench compare`'s rank test would flag is left to `expertmesh bench compare`.

usage: scripts/bench-agree.py [--markdown] RUN1.json RUN2.json [RUN3.json ...]
  --markdown: also print a Markdown table (figure, bound, each run's ratio [p10-p90], and
  whether it agrees), as BENCHMARKS.md shows them.
"""
import json
import sys


def figures(path):
    with open(path) as f:
        d = json.load(f)
    out = {}
    for r in d["results"]:
        if "ratio_p10" in r:
            out[(r["name"], r["batch"])] = (
                r["ratio"],
                r["ratio_p10"],
                r["ratio_p90"],
                r.get("bound", ""),
                r.get("bench_bug", False),
            )
    return d["machine"], out


def main(argv):
    markdown = "--markdown" in argv
    paths = [a for a in argv if a != "--markdown"]
    if len(paths) < 2:
        sys.exit(__doc__)
    runs = [figures(p) for p in paths]
    for p, (m, _) in zip(paths, runs):
        bw = m.get("read_bandwidth_gbs_median")
        print(f"{p}: read limit median {bw if bw is None else round(bw, 2)} GB/s")
    keys = set.intersection(*(set(f) for _, f in runs))
    bad = 0
    rows = []
    for k in sorted(keys):
        vals = [f[k] for _, f in runs]
        ok = all(
            v[1] <= u[0] <= v[2]
            for i, u in enumerate(vals)
            for j, v in enumerate(vals)
            if i != j
        )
        cells = [f"{m:.3f} [{lo:.3f}–{hi:.3f}]" + (" BUG" if bug else "") for m, lo, hi, _, bug in vals]
        rows.append((k, vals[0][3], cells, ok))
        if not ok:
            bad += 1
            print(f"DISAGREE {k[0]} B={k[1]}: " + "  ".join(cells))
    bugs = sum(1 for _, f in runs for v in f.values() if v[4])
    print(f"agree: {len(keys) - bad} of {len(keys)}; bench bugs: {bugs}")
    if markdown:
        runs_h = " | ".join(f"run {i + 1}" for i in range(len(runs)))
        print(f"\n| figure | B | bound | {runs_h} | agree |")
        print("|---|---|---|" + "---|" * len(runs) + "---|")
        for (name, batch), bound, cells, ok in rows:
            print(f"| {name} | {batch} | {bound} | " + " | ".join(cells) + f" | {'yes' if ok else '**no**'} |")
    return 0 if bad == 0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
