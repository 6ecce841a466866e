"""Does a plain step (k = 0) cost more on an engine with a draft than on one without (issue 46)?

    PYTHONPATH=. python benchmarks/draft_k0_step.py --json docs/results/goodput/draft_k0_step.json

Two engines of the default model on the bench's menu (batch buckets 1 and 4, one window of 256): `none`, and the
shipped token draft. Each round prefills the same 120-token prompt into 4 slots of both, lets the draft catch up
(one untimed k = 1 step and one k = 0 step), then times B = 4 steps alternately: `none` at k = 0, the draft engine
at k = 0 after a k = 0 step, at k = 1, at k = 0 right after that k = 1 step, and `none` at k = 0 again. Reported:
median and mean milliseconds per kind of step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

from jaxspec.bench.common import machine, write_json
from jaxspec.engine.api import prefill_prompt
from jaxspec.engine.build import build_engine
from jaxspec.menu import Menu
from jaxspec.types import SamplingParams

ROWS = [0, 1, 2, 3]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args(argv)
    load_before = os.getloadavg()
    menu = Menu(num_slots=4, max_len=256, batch_buckets=(1, 4), k_menu=(0, 1, 2, 3, 4, 5), window_buckets=(256,))
    engines = {"none": build_engine(proposer="none", menu=Menu(num_slots=4, max_len=256, batch_buckets=(1, 4),
                                                               k_menu=(0,), window_buckets=(256,)))[0],
               "draft": build_engine(proposer="draft", menu=menu)[0]}
    params = SamplingParams(temperature=0.0, max_tokens=256)
    prompt = [int(2 + (i * 7919) % 4000) for i in range(120)]
    for engine in engines.values():
        engine.warmup(progress=False)

    def timed(name: str, k: int) -> float:
        t0 = time.perf_counter()
        engines[name].step(ROWS, k, None)
        return time.perf_counter() - t0

    times: dict[str, list[float]] = {"none k=0": [], "draft k=0 after k=0": [], "draft k=1": [],
                                     "draft k=0 after k=1": []}
    for _ in range(args.rounds):
        for engine in engines.values():
            for slot in ROWS:
                prefill_prompt(engine, slot, prompt, params, seed=0)
        engines["draft"].step(ROWS, 1, None)  # the draft catches up on the prompt: untimed
        engines["draft"].step(ROWS, 0, None)
        times["none k=0"].append(timed("none", 0))
        times["draft k=0 after k=0"].append(timed("draft", 0))
        times["draft k=1"].append(timed("draft", 1))
        times["draft k=0 after k=1"].append(timed("draft", 0))
        times["none k=0"].append(timed("none", 0))
    rows = {name: {"median_ms": 1e3 * statistics.median(v), "mean_ms": 1e3 * statistics.mean(v), "steps": len(v)}
            for name, v in times.items()}
    for name, row in rows.items():
        print(f"{name:>20}: {row['median_ms']:.2f} ms median, {row['mean_ms']:.2f} mean ({row['steps']} steps)")
    result = {"meta": {"command": "python " + " ".join(sys.argv), "machine": machine(),
                       "loadavg_before": load_before, "loadavg_after": os.getloadavg(), "rounds": args.rounds},
              "steps": rows}
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
