"""How much of a bench cell's spread is the machine: runs of the same settings one after another and interleaved.

    python -m benchmarks.interleave_check docs/results/goodput/aa_slice_0.json \
        docs/results/goodput/aa_slice_0.5.json --json docs/results/goodput/interleave_check.json

Per file (one `jaxspec bench --repeats R` run) and cell, three measures of what the machine's drift does to a
comparison of policies, none of which depends on the policies' choices:

- `prefill_spread`: each policy's seconds per prompt chunk over `none`'s (`jaxspec.bench.cli.prefill_drift`).
  Every policy prefills the same chunks from an empty prefix cache, so away from 1 is the machine's speed moving
  between the policies' runs (reported: the largest |ratio − 1| of the cell, and the mean of it over cells).
- `a_a`: `fixed:0` (k = 0 every step on the proposer's engine) against `none` (k = 0 on the plain engine): the
  same work, so its ratio and 95 % paired interval (jaxspec/bench/intervals.py) show how far two equal policies
  land apart; present when the run had `fixed:0`.
- `interval_width`: the width of goodput's interval against the best fixed k (high − low).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from jaxspec.bench.cli import paired_latencies, prefill_drift
from jaxspec.bench.intervals import ratio_interval


def cells(records: list[dict]) -> dict[tuple, dict[str, dict]]:
    """(workload, proposer, load) -> {policy: record}."""
    out: dict[tuple, dict[str, dict]] = {}
    for r in records:
        if "mean_latency_s" in r and "loop" in r:
            load = r.get("concurrency", r.get("rate"))
            out.setdefault((r["workload"], r["proposer"], load), {})[r["policy"]] = r
    return out


def check(result: dict) -> dict:
    """The module doc's measures for one bench result."""
    goodput_checks = {(c["workload"], c["proposer"], c.get("concurrency", c.get("rate"))): c
                      for c in result["checks"]["goodput_vs_best_fixed"]}
    rows = []
    for key, pol in sorted(cells(result["records"]).items(), key=lambda kv: str(kv[0])):
        if "none" not in pol:
            continue
        # each policy's seconds per prompt chunk over none's (left out where the chunks differ: preemptions)
        spread = {p: d for p, r in pol.items() if p != "none" and (d := prefill_drift(r, pol["none"])) is not None}
        row = {"workload": key[0], "proposer": key[1], "load": key[2],
               "prefill_over_none": spread,
               "prefill_spread": max((abs(v - 1.0) for v in spread.values()), default=None)}
        if "fixed:0" in pol:
            pair = paired_latencies(pol["fixed:0"], pol["none"])
            if pair is not None:
                iv = ratio_interval(*pair)
                row["a_a"] = {"ratio": iv.ratio, "ci95": [iv.low, iv.high], "verdict": iv.verdict()}
        g = goodput_checks.get(key)
        if g is not None and "ci95" in g:
            row["interval_width"] = g["ci95"][1] - g["ci95"][0]
            row["goodput_over_best"] = {"best": g["best"], "ratio": g["ratio"], "ci95": g["ci95"],
                                        "verdict": g["verdict"]}
        rows.append(row)

    def mean(field):
        vals = [r[field] for r in rows if r.get(field) is not None]
        return float(np.mean(vals)) if vals else None

    a_a = [r["a_a"] for r in rows if "a_a" in r]
    return {"slice_s": result["meta"]["settings"].get("slice_s", 0.0), "command": result["meta"]["command"],
            "loadavg_before": result["meta"]["loadavg_before"], "loadavg_after": result["meta"]["loadavg_after"],
            "wall_s": result["meta"]["wall_s"], "cells": rows,
            "mean_prefill_spread": mean("prefill_spread"), "mean_interval_width": mean("interval_width"),
            "a_a_mean_abs_error": float(np.mean([abs(x["ratio"] - 1.0) for x in a_a])) if a_a else None,
            "a_a_mean_width": float(np.mean([x["ci95"][1] - x["ci95"][0] for x in a_a])) if a_a else None,
            "a_a_not_ok": sum(x["verdict"] != "ok" for x in a_a)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+", type=Path, help="bench JSON files (jaxspec bench --json)")
    ap.add_argument("--json", type=Path, help="write the measures here")
    args = ap.parse_args(argv)
    out = {}
    for path in args.files:
        out[str(path)] = c = check(json.loads(path.read_text()))
        print(f"{path}: slice {c['slice_s']} s, wall {c['wall_s']:.0f} s; prefill spread mean "
              f"{c['mean_prefill_spread']:.3f}; goodput interval width mean {c['mean_interval_width']:.3f}; "
              f"A/A |ratio - 1| mean {c['a_a_mean_abs_error']}, width {c['a_a_mean_width']}, "
              f"not ok {c['a_a_not_ok']}", file=sys.stderr)
        for row in c["cells"]:
            a_a = row.get("a_a")
            g = row.get("goodput_over_best", {})
            spread = row["prefill_spread"]
            print(f"  {row['workload']:14s} {row['load']!s:6s} prefill spread "
                  + ("n/a" if spread is None else f"{spread:.3f}")
                  + (f"; A/A {a_a['ratio']:.3f} [{a_a['ci95'][0]:.3f}, {a_a['ci95'][1]:.3f}]" if a_a else "")
                  + (f"; goodput/{g['best']} {g['ratio']:.3f} [{g['ci95'][0]:.3f}, {g['ci95'][1]:.3f}] "
                     f"{g['verdict']}" if g else ""), file=sys.stderr)
    if args.json:
        from jaxspec.bench.common import write_json
        write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
