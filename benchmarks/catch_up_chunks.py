"""What a draft catch-up call costs by its chunk size (issue 46): the shipped token draft, B = 4 slots.

    PYTHONPATH=. python benchmarks/catch_up_chunks.py --json docs/results/goodput/catch_up_chunks.json

One engine of the default model with the shipped draft, its catch-up compiled at chunks of 8, 16, 32, 64 and 256
tokens (window 256). Each round, for every chunk size C, prefills a C-token prompt into each of 4 slots (prefill
leaves the draft behind by the whole prompt) and times `Engine.catch_up` over the 4 slots: one call of the C chunk
each. A call computes its whole chunk, so this is also what a call costs that feeds fewer tokens in that chunk (a
few tokens after a short stretch at k = 0 ran as a 64-token chunk before the catch-up chunks below the smallest
prefill bucket). Reported per chunk: median and mean milliseconds per call, and per token of the chunk.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import jax

from jaxspec.bench.common import machine, write_json
from jaxspec.engine.api import prefill_prompt
from jaxspec.engine.build import build_engine
from jaxspec.menu import Menu
from jaxspec.types import SamplingParams

SLOTS = [0, 1, 2, 3]
CHUNKS = (8, 16, 32, 64, 256)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args(argv)
    load_before = os.getloadavg()
    menu = Menu(num_slots=4, max_len=512, batch_buckets=(4,), k_menu=(0, 1), window_buckets=(256, 512),
                prefill_buckets=(64, 256))
    assert menu.catch_up_buckets == CHUNKS
    engine = build_engine(proposer="draft", menu=menu)[0]
    engine.warmup(progress=False)
    params = SamplingParams(temperature=0.0, max_tokens=64)
    times: dict[int, list[float]] = {c: [] for c in CHUNKS}
    for _ in range(args.rounds):
        for chunk in CHUNKS:
            prompt = [int(2 + (i * 7919) % 4000) for i in range(chunk)]
            for slot in SLOTS:
                prefill_prompt(engine, slot, prompt, params, seed=0)
            jax.block_until_ready(engine.state)
            plans = [engine.catch_up_plan(slot) for slot in SLOTS]
            assert all([call.key.chunk for call in plan] == [chunk] for plan in plans), plans
            started = time.perf_counter()
            engine.catch_up(SLOTS)
            jax.block_until_ready(engine.state)
            times[chunk].append((time.perf_counter() - started) / len(SLOTS))
    rows = {str(c): {"median_ms": 1e3 * statistics.median(v), "mean_ms": 1e3 * statistics.mean(v),
                     "median_ms_per_token": 1e3 * statistics.median(v) / c, "calls": len(v) * len(SLOTS)}
            for c, v in times.items()}
    for chunk, row in rows.items():
        print(f"chunk {chunk:>3}: {row['median_ms']:.2f} ms a call median ({row['mean_ms']:.2f} mean), "
              f"{row['median_ms_per_token']:.3f} ms a token")
    result = {"meta": {"command": "python " + " ".join(sys.argv), "machine": machine(),
                       "loadavg_before": load_before, "loadavg_after": os.getloadavg(), "rounds": args.rounds,
                       "slots": len(SLOTS)},
              "chunks": rows}
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
