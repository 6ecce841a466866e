"""What sets the width of goodput's interval in a bench cell: its repeats or its requests.

    python -m benchmarks.interval_parts docs/results/goodput/sliced_poisson_ngram_edit_r32.json \
        --json docs/results/goodput/interval_parts_edit_r32.json

The bench's interval (jaxspec/bench/intervals.py) resamples a cell's [repeats, requests] latencies over both at
once: request q is the same prompt in every repeat, so a prompt that favours one policy weighs on every resample
that draws it. Per cell, goodput against the cell's best fixed choice (`checks.goodput_vs_best_fixed`):

- `both`: the bench's interval (repeats and requests resampled);
- `repeats`: repeats alone resampled (each repeat's requests kept whole): what more repeats narrow;
- `requests`: requests alone resampled (each request's repeats kept whole): what only more distinct requests narrow;
- `per_request`: each request's ratio of mean latencies over the repeats (min, max), and `per_repeat` each repeat's
  ratio (mean, standard deviation).

All three from `jaxspec.bench.intervals.ratio_interval` (`over`), with the bench's resample count, level and seed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from jaxspec.bench.cli import paired_latencies
from jaxspec.bench.common import write_json
from jaxspec.bench.intervals import ratio_interval


def cell_parts(goodput: dict, best: dict) -> dict | None:
    """The module doc's measures for goodput's record against the best fixed choice's (None without latencies)."""
    pair = paired_latencies(goodput, best)
    if pair is None:
        return None
    x, y = pair  # [R, n] each
    both, repeats, requests = (ratio_interval(x, y, over=over) for over in ("both", "repeats", "requests"))
    per_request = x.mean(axis=0) / y.mean(axis=0)  # [n]
    per_repeat = x.mean(axis=1) / y.mean(axis=1)  # [R]
    return {"repeats_x_requests": list(x.shape), "ratio": both.ratio, "both": [both.low, both.high],
            "repeats": [repeats.low, repeats.high], "requests": [requests.low, requests.high],
            "per_request": [float(per_request.min()), float(per_request.max())],
            "per_repeat": [float(per_repeat.mean()), float(per_repeat.std())]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    out = {"command": "python -m benchmarks.interval_parts " + " ".join(sys.argv[1:]), "cells": []}
    for path in args.files:
        data = json.loads(path.read_text())
        records = {(r["workload"], r["proposer"], r.get("concurrency", r.get("rate")), r["policy"]): r
                   for r in data["records"] if "mean_latency_s" in r}
        for check in data["checks"].get("goodput_vs_best_fixed", []):
            load = check.get("concurrency", check.get("rate"))
            key = (check["workload"], check["proposer"], load)
            parts = cell_parts(records[(*key, "goodput")], records[(*key, check["best"])])
            if parts is None:
                continue
            cell = {"file": str(path), "workload": key[0], "proposer": key[1], "load": load, "best": check["best"],
                    **parts}
            out["cells"].append(cell)
            print(f"{key[0]} {key[1]} {load} vs {check['best']} ({parts['repeats_x_requests'][0]} x "
                  f"{parts['repeats_x_requests'][1]}): {parts['ratio']:.3f} both [{parts['both'][0]:.3f}, "
                  f"{parts['both'][1]:.3f}], repeats [{parts['repeats'][0]:.3f}, {parts['repeats'][1]:.3f}], "
                  f"requests [{parts['requests'][0]:.3f}, {parts['requests'][1]:.3f}]; per request "
                  f"{parts['per_request'][0]:.3f}-{parts['per_request'][1]:.3f}, per repeat "
                  f"{parts['per_repeat'][0]:.3f} ± {parts['per_repeat'][1]:.3f}")
    if args.json:
        write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
