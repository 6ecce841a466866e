"""Where goodput's time went, from a bench file written with `--decision-log` (issue 46).

    python -m benchmarks.goodput_decisions docs/results/goodput/intervals_cpu.json

For every goodput cell, per padded k the policy ran: steps, steps run to explore, the predicted and realised
tokens and seconds (ratios realised / predicted), and the realised goodput (tokens / second of step executable).
Then goodput's time outside its priced steps and its prefills, per step: (Σ latency − Σ time to first token −
Σ step seconds) / steps (host work the price leaves out), the conditional acceptance per position
P(accept j | 1..j−1 accepted) its steps measured (a missing proposal a rejection), and per policy of the cell the
totals (fixed policies keep no log): Σ latency, steps, tokens per step. `all_accepted_priced`: the k > 0 steps
priced as if every proposal would be accepted (the cold start before it priced the first proposal alone so), their
share of the logged step seconds and their tokens per second against the other steps'. `speculating_runs`: the
stretches of consecutive k > 0 steps (their count, mean length, longest, and what ended each: the next step's batch
grew, or at the same batch the last speculating step had accepted nothing or something), the batch sizes the k > 0
steps ran at, and the cell's draft catch-up calls and seconds: a catch-up is priced over up to 32 of the row's
tokens, and a stretch shorter than that paid it over fewer. `--json OUT` writes every cell's report.
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path

from jaxspec.bench.common import write_json


def cell_report(cell: list[dict]) -> dict:
    """The records of one (workload, proposer, load) cell -> the per-k breakdown of goodput's decision logs."""
    by_policy = {r["policy"]: r for r in cell}
    g = by_policy["goodput"]
    per_k = collections.defaultdict(lambda: collections.Counter())
    step_seconds = 0.0
    optimistic = collections.Counter()  # the k > 0 steps priced with every proposal accepted
    for log in g.get("decision_logs", []):
        for d in log:
            if d["k"] > 0 and d["predicted_tokens"] is not None and \
                    abs(d["predicted_tokens"] - (d["k"] + 1) * d["batch"]) < 1e-9:
                optimistic.update(steps=1, tokens=d["tokens"], seconds=d["seconds"])
            c = per_k[d["k"]]
            c["steps"] += 1
            c["explored"] += int(d["explored"])
            c["tokens"] += d["tokens"]
            c["seconds"] += d["seconds"]
            step_seconds += d["seconds"]
            if d["predicted_tokens"] is not None:
                c["pred_tokens"] += d["predicted_tokens"]
                c["pred_seconds"] += d["predicted_seconds"]
                c["real_tokens_priced"] += d["tokens"]
                c["real_seconds_priced"] += d["seconds"]
    ks = {}
    for k, c in sorted(per_k.items()):
        ks[k] = {"steps": c["steps"], "explored": c["explored"],
                 "tokens_per_step": c["tokens"] / c["steps"],
                 "realised_goodput": c["tokens"] / c["seconds"] if c["seconds"] else None,
                 "tokens_real_over_pred": c["real_tokens_priced"] / c["pred_tokens"] if c["pred_tokens"] else None,
                 "seconds_real_over_pred": (c["real_seconds_priced"] / c["pred_seconds"]
                                            if c["pred_seconds"] else None),
                 "mean_step_s": c["seconds"] / c["steps"]}
    totals = {}
    for p, r in sorted(by_policy.items()):
        lat = [v for row in r.get("latencies_s", []) for v in row if v is not None]
        totals[p] = {"sum_latency_s": sum(lat), "steps": r.get("steps"), "tokens_per_step": r.get("tokens_per_step"),
                     "k_hist": r.get("k_hist")}
    ttft = (g.get("mean_ttft_s") or 0.0) * (g["requests"] - g.get("errors", 0))
    unpriced = (totals["goodput"]["sum_latency_s"] - ttft - step_seconds) / max(1, totals["goodput"]["steps"] or 1)
    reached, trials = collections.Counter(), collections.Counter()
    for log in g.get("decision_logs", []):
        for d in log:
            if d["batch"] != 1:  # per-row outcomes are summed over rows: positions only at batch 1
                continue
            allowed = d["k"] if d["row_k"] is None else d["row_k"][0]
            for j in range(1, allowed + 1):
                if d["accepted"] >= j - 1:
                    trials[j] += 1
                    reached[j] += d["accepted"] >= j
    positions = {j: (reached[j] / trials[j], trials[j]) for j in sorted(trials)}
    rest_tokens = sum(c["tokens"] for c in per_k.values()) - optimistic["tokens"]
    rest_seconds = step_seconds - optimistic["seconds"]
    all_accepted = {"steps": optimistic["steps"],
                    "seconds_share": optimistic["seconds"] / step_seconds if step_seconds else None,
                    "tokens_per_s": optimistic["tokens"] / optimistic["seconds"] if optimistic["seconds"] else None,
                    "others_tokens_per_s": rest_tokens / rest_seconds if rest_seconds else None}
    return {"per_k": ks, "policies": totals, "goodput_outside_steps_per_step_s": unpriced,
            "acceptance_by_position": positions, "all_accepted_priced": all_accepted,
            "speculating_runs": speculating_runs(g)}


def speculating_runs(goodput: dict) -> dict:
    """Stretches of consecutive k > 0 steps in goodput's decision logs, the batch sizes of its k > 0 steps and the
    cell's draft catch-ups."""
    lengths, batches, ended = [], collections.Counter(), collections.Counter()
    for log in goodput.get("decision_logs", []):
        run, last = 0, None
        for d in log:
            if d["k"] > 0:
                run += 1
                batches[d["batch"]] += 1
            elif run:
                lengths.append(run)
                run = 0
                ended["batch_grew" if d["batch"] > last["batch"] else
                      "rejected" if last["accepted"] == 0 else "accepted"] += 1
            last = d
        if run:
            lengths.append(run)
    return {"count": len(lengths), "mean_length": sum(lengths) / len(lengths) if lengths else None,
            "longest": max(lengths, default=0), "ended_by": dict(ended),
            "steps_by_batch": dict(sorted(batches.items())),
            "catch_up_calls": goodput.get("catch_up_calls"), "catch_up_s": goodput.get("catch_up_s")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("file", type=Path)
    parser.add_argument("--json", type=Path, help="write every cell's report here")
    args = parser.parse_args(argv)
    data = json.loads(args.file.read_text(encoding="utf-8"))
    key = "rate" if any(r.get("mode") == "open" for r in data["records"]) else "concurrency"
    cells = collections.defaultdict(list)
    for r in data["records"]:
        cells[(r["workload"], r["proposer"], r.get(key))].append(r)
    reports = []
    for name, cell in cells.items():
        if not any(r["policy"] == "goodput" for r in cell):
            continue
        rep = cell_report(cell)
        reports.append({"workload": name[0], "proposer": name[1], key: name[2], **rep})
        print(f"== {name}")
        for k, v in rep["per_k"].items():
            print(f"  k={k}: " + ", ".join(f"{a}={b:.4g}" if isinstance(b, float) else f"{a}={b}"
                                           for a, b in v.items()))
        for p, v in rep["policies"].items():
            print(f"  {p:>8}: Σlatency {v['sum_latency_s']:.2f} s, steps {v['steps']}, "
                  f"tokens/step {v['tokens_per_step']:.3f}, k_hist {v['k_hist']}")
        print(f"  goodput time outside its steps and prefills: {1e3 * rep['goodput_outside_steps_per_step_s']:.2f} "
              f"ms per step")
        print("  P(accept j | 1..j-1), trials: " + ", ".join(f"{j}: {a:.2f} ({n})"
                                                              for j, (a, n) in rep["acceptance_by_position"].items()))
        runs = rep["speculating_runs"]
        if runs["count"]:
            print(f"  speculating runs: {runs['count']}, mean {runs['mean_length']:.1f} steps, longest "
                  f"{runs['longest']}, ended by {runs['ended_by']}; k > 0 steps by batch {runs['steps_by_batch']}; "
                  f"catch-up {runs['catch_up_calls']} calls, {runs['catch_up_s'] or 0.0:.3f} s")
        opt = rep["all_accepted_priced"]
        if opt["steps"]:
            print(f"  priced all accepted: {opt['steps']} steps, {100 * opt['seconds_share']:.1f} % of step seconds, "
                  f"{opt['tokens_per_s']:.0f} tokens/s (other steps {opt['others_tokens_per_s']:.0f})")
    if args.json is not None:
        write_json(args.json, {"file": str(args.file), "cells": reports})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
