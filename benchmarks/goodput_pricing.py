"""How well goodput priced plain decoding: from recorded decision logs, how often the k = 0 option was priced
above `--over` times what k = 0 steps of that batch bucket actually took (their median).

    python -m benchmarks.goodput_pricing docs/results/goodput_calibration/before.json \
        docs/results/goodput_calibration/after.json

A file holds {"decisions": [...]} (one goodput cell) or {"cells": [{"decisions": [...]}, ...]}; a decision has
bucket, batch (live rows), k, seconds and predicted_goodput ({k: tokens/s}); at k = 0 every live row yields
one token, so the price of the k = 0 option is batch / predicted_goodput["0"].
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path

import numpy as np


def k0_pricing(decisions: list[dict], over: float) -> dict:
    """decisions -> {decisions, mispriced, worst}: how many priced k = 0, how many above `over` × observed."""
    observed = collections.defaultdict(list)
    for d in decisions:
        if d["k"] == 0:
            observed[d["bucket"]].append(d["seconds"])
    median = {b: float(np.median(v)) for b, v in observed.items()}
    ratios = [d["batch"] / d["predicted_goodput"]["0"] / median[d["bucket"]] for d in decisions
              if (d.get("predicted_goodput") or {}).get("0") and d["bucket"] in median]
    return {"decisions": len(ratios), "mispriced": int(sum(r > over for r in ratios)),
            "worst": round(max(ratios), 2) if ratios else None}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--over", type=float, default=1.5, help="a price above this × the observed median is wrong")
    args = parser.parse_args(argv)
    for path in args.files:
        data = json.loads(path.read_text(encoding="utf-8"))
        cells = data["cells"] if "cells" in data else [data]
        total = {"decisions": 0, "mispriced": 0, "worst": 0.0}
        for cell in cells:
            one = k0_pricing(cell["decisions"], args.over)
            total["decisions"] += one["decisions"]
            total["mispriced"] += one["mispriced"]
            total["worst"] = max(total["worst"], one["worst"] or 0.0)
        print(f"{path}: {total['mispriced']} of {total['decisions']} decisions priced k = 0 above {args.over}x "
              f"its observed median (worst {total['worst']}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
