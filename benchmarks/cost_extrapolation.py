"""What goodput's cost model charged for the plain step (k = 0) while it speculated, against what the plain step cost.

    python -m benchmarks.cost_extrapolation docs/results/goodput/intervals_draft_tree.json --proposer draft \
        --profile docs/results/goodput/cost_profile_draft.json \
        --variant two_sided_weak:cost_online.faster_draft_prior=0.0001 \
        --json docs/results/goodput/cost_extrapolation_draft_tree.json

A policy that speculates seldom runs k = 0, so the cost model prices it from the shared correction of the shapes it
does run (jaxspec/policy/cost_model.py, layer 3): at π = 0, the device factor alone. This replays the step times
of every goodput cell of one proposer in a bench file written with `--decision-log` through a fresh `CostModel` from
the profile the bench used, once per setting of the online correction (the shipped one from
jaxspec/configs/policy.yaml, and each `--variant NAME:cost_online.key=value,...`, as `goodput_replay` takes
them), fresh for each
decision log (one per repeat, as the bench's policy is). Before each observation it prices the k = 0 step at the
cell's batch bucket (the bucket of its concurrency). Reported per cell and setting: that price's mean over the
decisions, over the plain step the same cell's `none` policy ran (its decode seconds over its decode steps, rows
as they came: mostly the full batch).

The profile must have one attention window and no real-token price (the decision log records neither the window
nor the rows' caps).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import numpy as np

from benchmarks.goodput_replay import parse_variant
from jaxspec.bench.common import machine, write_json
from jaxspec.policy.cost_model import CostModel, CostProfile, OnlineCostConfig
from jaxspec.policy.registry import load_defaults


def k0_prices(profile: CostProfile, online: OnlineCostConfig, logs: list[list[dict]], bucket: int) -> list[float]:
    """The k = 0 price at `bucket` before each observed step of each log, a fresh model per log."""
    (window,) = profile.key.window_buckets
    prices = []
    for log in logs:
        model = CostModel.from_profile(profile, online)
        for d in log:
            prices.append(model.step_time(bucket, 0, window))
            if d["seconds"] > 0:  # a step whose time was not observed (none in the bench) leaves the model as it is
                model.observe(d["bucket"], d["k"], window, d["seconds"])
    return prices


def cell_reports(bench: dict, proposer: str, profile: CostProfile, settings: dict[str, OnlineCostConfig]) -> list[dict]:
    buckets = profile.key.batch_buckets
    cells = {}
    for r in bench["records"]:
        if r["proposer"] != proposer:
            continue
        cells.setdefault((r["workload"], r["proposer"], r["concurrency"]), {})[r["policy"]] = r
    out = []
    for (workload, proposer, concurrency), by_policy in sorted(cells.items()):
        if "goodput" not in by_policy or "none" not in by_policy:
            continue
        plain = by_policy["none"]["loop"]
        plain_step_s = plain["decode_s"] / plain["decode_steps"]
        bucket = next(b for b in buckets if b >= concurrency)
        row = {"workload": workload, "proposer": proposer, "concurrency": concurrency, "bucket": bucket,
               "none_step_s": plain_step_s, "profiled_k0_s": profile_entry(profile, bucket), "settings": {}}
        for name, online in settings.items():
            prices = k0_prices(profile, online, by_policy["goodput"]["decision_logs"], bucket)
            row["settings"][name] = {"mean_k0_price_s": float(np.mean(prices)),
                                     "over_none_step": float(np.mean(prices)) / plain_step_s,
                                     "max_over_none_step": float(np.max(prices)) / plain_step_s}
        out.append(row)
    return out


def profile_entry(profile: CostProfile, bucket: int) -> float:
    (window,) = profile.key.window_buckets
    return next(e.seconds for e in profile.entries if e.shape == (bucket, 0, window))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bench", type=Path, help="a `jaxspec bench --decision-log` JSON")
    parser.add_argument("--proposer", required=True, help="the bench's proposer whose cells to replay")
    parser.add_argument("--profile", type=Path, required=True, help="the cost profile that proposer's goodput used")
    parser.add_argument("--variant", action="append", default=[], help="NAME:cost_online.key=value,... (policy.yaml)")
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args(argv)
    profile = CostProfile.load(args.profile)
    if len(profile.key.window_buckets) != 1 or profile.real_token_s:
        raise SystemExit(f"{args.profile}: needs one attention window and no real-token price (module doc)")
    defaults = load_defaults()
    settings = {"shipped": defaults.cost_online}
    for text in args.variant:
        name, changes = parse_variant(text)
        if set(changes) != {"cost_online"}:
            raise SystemExit(f"--variant {text!r}: only cost_online.* settings change the cost model")
        settings[name] = dataclasses.replace(defaults.cost_online, **changes["cost_online"])
    bench = json.loads(args.bench.read_text(encoding="utf-8"))
    rows = cell_reports(bench, args.proposer, profile, settings)
    for row in rows:
        ratios = ", ".join(f"{n} {s['over_none_step']:.3f}" for n, s in row["settings"].items())
        print(f"{row['workload']:>13} {row['proposer']} c={row['concurrency']}: none's step "
              f"{1e3 * row['none_step_s']:.1f} ms; k = 0 priced over it: {ratios}")
    result = {"meta": {"command": " ".join([Path(sys.argv[0]).name] + (argv if argv is not None else sys.argv[1:])),
                       "machine": machine(), "bench": str(args.bench), "proposer": args.proposer,
                       "profile": str(args.profile),
                       "settings": {n: dataclasses.asdict(s) for n, s in settings.items()}},
              "cells": rows}
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
