"""The goodput policy's own host time per step: `choose` and `observe`, without a model or a device.

    python -m benchmarks.policy_host_cost --out docs/results/goodput/policy_host_cost.json

The policy runs on the host between two steps. Suffix decoding's loop is synchronous, so every microsecond of it
adds to each step; on a GPU, where a step of the default 1.5B model takes 3–5 ms, 0.5 ms of policy work is a tenth
of it (docs/design.md, "The goodput policy": host cost). This drives the shipped goodput policy
(jaxspec/configs/policy.yaml) on synthetic batches, with a cost model profiled on a synthetic CPU-like step cost,
and times each call:

    chain        prompt lookup's proposals: positional rates, runs priced, all-or-nothing outcomes
    confidences  suffix decoding's: each row's ready chain with its trie confidences (`BatchView.proposal_rates`)

at batch sizes B (`--batch`), each row a request that finishes after `--request-steps` steps and is replaced by a
new one (so per-request state is created and forgotten as in serving). Reports the median and mean µs per call
of `choose` and `observe` over `--steps` timed steps after `--warmup` ones. Record the load with the result.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from jaxspec.bench.common import machine, write_json
from jaxspec.menu import step_shape
from jaxspec.policy.base import BatchView
from jaxspec.policy.cost_model import CostEntry, CostModel, LinearCostFit
from jaxspec.policy.registry import load_defaults, make_policy
from jaxspec.types import StepResult

BATCH_BUCKETS = (1, 2, 4, 8, 16)
K_MENU = (0, 1, 2, 3, 5, 8)
WINDOWS = (256, 1024)


def step_seconds(batch: int, k: int, window: int) -> float:
    """A CPU-like step cost: 20 ms, plus 0.35 ms per verified token, plus attention over the window."""
    tokens = batch * (k + 1)  # verified tokens
    return 20e-3 + 0.35e-3 * tokens + 0.02e-3 * tokens * window / 256


def cost_model() -> CostModel:
    entries = [CostEntry(b, k, w, step_seconds(b, k, w)) for b in BATCH_BUCKETS for k in K_MENU for w in WINDOWS]
    return CostModel({e.shape: e.seconds for e in entries}, LinearCostFit.fit(entries), window_buckets=WINDOWS,
                     online=load_defaults().cost_online)


class Batch:
    """B live requests; each finishes after `request_steps` steps and a new one takes its row."""

    def __init__(self, batch: int, request_steps: int, scenario: str, rng: np.random.Generator):
        self.scenario, self.rng, self.request_steps = scenario, rng, request_steps
        self.next_id = 0
        self.rows = [self._new() for _ in range(batch)]

    def _new(self) -> dict:
        self.next_id += 1
        return {"id": self.next_id, "len": 200 + int(self.rng.integers(0, 200)), "steps": 0,
                "copy": float(self.rng.uniform(0.1, 0.9))}  # how often its proposals hold

    def view(self) -> BatchView:
        rates = ()
        if self.scenario == "confidences":  # a ready chain of 0..8 tokens with trie confidences
            rates = tuple(tuple(float(c) for c in self.rng.choice((1.0, 1.0, 1.0, 0.5, 0.33),
                                                                   size=int(self.rng.integers(0, 9))))
                          for _ in self.rows)
        return BatchView(request_ids=tuple(r["id"] for r in self.rows),
                         context_lens=tuple(r["len"] for r in self.rows),
                         row_max_k=(max(K_MENU),) * len(self.rows), k_menu=K_MENU,
                         batch_bucket=next(b for b in BATCH_BUCKETS if b >= len(self.rows)), proposal_rates=rates)

    def result(self, view: BatchView, k: int, row_k) -> StepResult:
        """Each row's outcome: its proposals accepted one by one with its copy rate (prompt lookup's runs: a row
        that finds no match, one time in two, proposes nothing)."""
        allowed = row_k if row_k is not None else (k,) * len(self.rows)
        proposed, accepted = [], []
        for i, row in enumerate(self.rows):
            n = allowed[i] if self.scenario == "chain" else min(allowed[i], len(view.proposal_rates[i]))
            if self.scenario == "chain" and self.rng.random() < 0.5:
                n = 0
            a = 0
            while a < n and self.rng.random() < row["copy"]:
                a += 1
            proposed.append(n)
            accepted.append(a)
        counts = np.asarray(accepted) + 1  # [B] tokens committed a row
        return StepResult(tokens=np.zeros((len(self.rows), k + 1), np.int32), counts=counts,
                          proposed=np.asarray(proposed))

    def advance(self, counts: np.ndarray, policy) -> None:
        for i, row in enumerate(self.rows):
            row["len"] += int(counts[i])
            row["steps"] += 1
            if row["steps"] >= self.request_steps:
                policy.forget(row["id"])
                self.rows[i] = self._new()


def measure(scenario: str, batch: int, steps: int, warmup: int, request_steps: int, seed: int) -> dict:
    """µs per `choose` and per `observe` of the shipped goodput policy (see the module doc)."""
    rng = np.random.default_rng(seed)
    policy = make_policy("goodput", cost_model=cost_model())
    live = Batch(batch, request_steps, scenario, rng)
    choose_us, observe_us = [], []
    for t in range(warmup + steps):
        view = live.view()
        t0 = time.perf_counter()
        decision = policy.choose(view)
        t1 = time.perf_counter()
        result = live.result(view, decision.k, decision.row_k)
        shape = step_shape(view.context_lens, decision.row_k, decision.k, view.k_menu, WINDOWS)
        elapsed = step_seconds(view.batch_bucket, shape.k, shape.window) * float(rng.uniform(0.95, 1.05))
        t2 = time.perf_counter()
        policy.observe(view, decision, result, elapsed)
        t3 = time.perf_counter()
        live.advance(result.counts, policy)
        if t >= warmup:
            choose_us.append((t1 - t0) * 1e6)
            observe_us.append((t3 - t2) * 1e6)
    return {"scenario": scenario, "B": batch, "steps": steps,
            "choose_us_median": statistics.median(choose_us), "choose_us_mean": statistics.fmean(choose_us),
            "observe_us_median": statistics.median(observe_us), "observe_us_mean": statistics.fmean(observe_us),
            "total_us_median": statistics.median(c + o for c, o in zip(choose_us, observe_us, strict=True))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=lambda v: tuple(int(x) for x in v.split(",")), default=(1, 4, 8))
    parser.add_argument("--scenarios", type=lambda v: tuple(v.split(",")), default=("chain", "confidences"))
    parser.add_argument("--steps", type=int, default=2000, help="timed steps a (scenario, B)")
    parser.add_argument("--warmup", type=int, default=300,
                        help="steps before timing (the policy leaves its cold start)")
    parser.add_argument("--request-steps", type=int, default=40, help="steps a request lives")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    bad = set(args.scenarios) - {"chain", "confidences"}
    if bad:
        parser.error(f"unknown scenario(s) {sorted(bad)}; choose from chain, confidences")
    load_before = os.getloadavg()
    rows = []
    for scenario in args.scenarios:
        for batch in args.batch:
            row = measure(scenario, batch, args.steps, args.warmup, args.request_steps, args.seed)
            rows.append(row)
            print(f"{scenario:12s} B={batch:2d}  choose {row['choose_us_median']:7.1f} µs  observe "
                  f"{row['observe_us_median']:7.1f} µs  (means {row['choose_us_mean']:.1f}, "
                  f"{row['observe_us_mean']:.1f})")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = {"meta": {"command": " ".join([sys.executable.rsplit("/", 1)[-1], "-m", "benchmarks.policy_host_cost",
                                            *(argv if argv is not None else sys.argv[1:])]),
                       "machine": machine(), "commit": commit,
                       "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                       "loadavg_before": load_before, "loadavg_after": os.getloadavg()},
              "rows": rows}
    if args.out:
        write_json(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
