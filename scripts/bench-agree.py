#!/usr/bin/env python3
"""Do several `expertmesh bench` JSON runs agree within their reported spreads?

For every figure (name, batch) present in all runs: it agrees when each run's median ratio lies
inside every other run's p10-p90 of the per-repetition ratios (the criterion of issue 17).
Prints one line per figure that does not, then `agree: N of M`, and also how many of them
`bench compare`'s rank test would flag is left to `expertmesh bench compare`.

usage: scripts/bench-agree.py RUN1.json RUN2.json [RUN3.json ...]
"""
import json
import sys


def figures(path):
    with open(path) as f:
        d = json.load(f)
    out = {}
    for r in d["results"]:
        if "ratio_p10" in r:
            out[(r["name"], r["batch"])] = (r["ratio"], r["ratio_p10"], r["ratio_p90"])
    return d["machine"], out


def main(paths):
    if len(paths) < 2:
        sys.exit(__doc__)
    runs = [figures(p) for p in paths]
    for p, (m, _) in zip(paths, runs):
        bw = m.get("read_bandwidth_gbs_median")
        print(f"{p}: read limit median {bw if bw is None else round(bw, 2)} GB/s")
    keys = set.intersection(*(set(f) for _, f in runs))
    bad = 0
    for k in sorted(keys):
        vals = [f[k] for _, f in runs]
        ok = all(
            lo <= med <= hi
            for i, (med, _, _) in enumerate(vals)
            for j, (_, lo, hi) in enumerate(vals)
            if i != j
        )
        if not ok:
            bad += 1
            cells = "  ".join(f"{m:.3f} [{lo:.3f}-{hi:.3f}]" for m, lo, hi in vals)
            print(f"DISAGREE {k[0]} B={k[1]}: {cells}")
    print(f"agree: {len(keys) - bad} of {len(keys)}")
    return 0 if bad == 0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
