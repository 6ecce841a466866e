"""Goodput's cold start, "first" against "all", in the policy tests' simulator (issue 46).

    PYTHONPATH=. python benchmarks/cold_start_sim.py --json docs/results/goodput/cold_start_sim.json

Each case is a proposer whose every proposal is accepted with probability α, B rows a step, and a synthetic step
cost (`tests/policy/sim.py`, `linear_cost`: a step, per verified token, per draft step). For every seed a fresh
shipped goodput policy (jaxspec/configs/policy.yaml, profiled on that cost) runs `--steps` steps; the same for
each fixed k of the menu and `none`. Reported per case and cold start ("first": the first proposal priced as
accepted until 8 trials, the deeper ones at their prior; "all": every proposal): goodput's tokens per second over
the best fixed k's (mean and worst seed), the k it ran most over its last 50 steps on each seed, and its first k.
No clock is read: the step costs are the synthetic ones.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import sys
from pathlib import Path

import numpy as np

from jaxspec.bench.common import write_json
from jaxspec.policy.registry import load_defaults, make_policy
from tests.policy.sim import MENU_K, cost_model, linear_cost, run

CASES = {  # name: (cost, α, rows)
    "expensive draft, α = 0.8, B = 1 (k = 1 pays 12 %)": (dict(step=10e-3, draft_step=6e-3), 0.8, 1),
    "expensive draft, α = 0.8, B = 4": (dict(step=10e-3, draft_step=6e-3), 0.8, 4),
    "cheap draft, α = 0.7, B = 1": (dict(step=10e-3, draft_step=1e-3), 0.7, 1),
    "cheap draft, α = 0.4, B = 4, dear tokens": (dict(step=10e-3, draft_step=1.5e-3, per_token=0.6e-3), 0.4, 4),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args(argv)
    defaults = load_defaults()
    rows = []
    for name, (cost_args, alpha, batch) in CASES.items():
        cost = linear_cost(**cost_args)
        fixed = {k: float(np.mean([run(make_policy(f"fixed:{k}" if k else "none"), lambda t: [alpha] * batch,
                                       args.steps, cost, seed=s)["goodput"] for s in range(args.seeds)]))
                 for k in MENU_K}
        best_k = max(fixed, key=fixed.get)
        row = {"case": name, "alpha": alpha, "batch": batch, "cost": cost_args, "best_fixed_k": best_k,
               "best_fixed_goodput": fixed[best_k], "cold_start": {}}
        for mode in ("first", "all"):
            settings = dataclasses.replace(defaults, goodput=dataclasses.replace(defaults.goodput, cold_start=mode))
            ratios, finals, firsts = [], [], []
            for s in range(args.seeds):
                policy = make_policy("goodput", cost_model=cost_model(cost, **dataclasses.asdict(settings.cost_online)),
                                     defaults=settings)
                result = run(policy, lambda t: [alpha] * batch, args.steps, cost, seed=s)
                ratios.append(result["goodput"] / fixed[best_k])
                finals.append(collections.Counter(result["ks"][-50:]).most_common(1)[0][0])
                firsts.append(result["ks"][0])
            row["cold_start"][mode] = {"mean_over_best_fixed": float(np.mean(ratios)),
                                       "worst_over_best_fixed": float(min(ratios)), "final_k": finals,
                                       "first_k": firsts}
            print(f"{name} [{mode}]: {np.mean(ratios):.3f} of fixed:{best_k} (worst seed {min(ratios):.3f}), "
                  f"final k {finals}, first k {firsts[0]}")
        rows.append(row)
    result = {"meta": {"command": "python " + " ".join(sys.argv), "seeds": args.seeds, "steps": args.steps},
              "cases": rows}
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
