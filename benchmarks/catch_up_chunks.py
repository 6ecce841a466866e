"""What a draft catch-up call costs by its chunk size (issue 46): the shipped token draft, B = 4 slots.

    PYTHONPATH=. python benchmarks/catch_up_chunks.py --json docs/results/goodput/catch_up_chunks.json

One engine of the default model with the shipped draft, its catch-up compiled at every chunk of 8, 16, 32, 64 and
256 tokens (window 256). Each round feeds each of 4 slots the same `--missing` committed tokens at every chunk
size in turn (a catch-up after a few k = 0 steps: before the right-sized chunks it ran as a 64-token chunk) and
times the 4 calls together. Reported per chunk: median and mean milliseconds per call, and per padded token.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import jax
import numpy as np

from jaxspec.bench.common import machine, write_json
from jaxspec.engine.api import prefill_prompt
from jaxspec.engine.build import build_engine
from jaxspec.menu import CatchUpKey, Menu
from jaxspec.types import SamplingParams

SLOTS = [0, 1, 2, 3]
CHUNKS = (8, 16, 32, 64, 256)
START = 100  # the committed position the fed tokens start at (inside the 120-token prompt)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--missing", type=int, default=5, help="tokens each call feeds (at most 8)")
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args(argv)
    if not 1 <= args.missing <= CHUNKS[0]:
        parser.error(f"--missing must be in [1, {CHUNKS[0]}]")
    load_before = os.getloadavg()
    menu = Menu(num_slots=4, max_len=256, batch_buckets=(4,), k_menu=(0, 1), window_buckets=(256,),
                prefill_buckets=(64, 256))
    assert menu.catch_up_buckets == CHUNKS
    engine = build_engine(proposer="draft", menu=menu)[0]
    engine.warmup(progress=False)
    prompt = [int(2 + (i * 7919) % 4000) for i in range(120)]
    for slot in SLOTS:
        prefill_prompt(engine, slot, prompt, SamplingParams(temperature=0.0, max_tokens=64), seed=0)
    times: dict[int, list[float]] = {c: [] for c in CHUNKS}
    for _ in range(args.rounds):
        for chunk in CHUNKS:
            run = engine.executables.get(CatchUpKey(chunk, 256))
            started = time.perf_counter()
            for slot in SLOTS:  # [1] slot, start, tokens fed: as `Engine.catch_up` calls it
                engine.state = run(engine._proposer_params, engine.state, np.array([slot], np.int32),
                                   np.array([START], np.int32), np.array([args.missing], np.int32))
            jax.block_until_ready(engine.state)
            times[chunk].append((time.perf_counter() - started) / len(SLOTS))
    rows = {str(c): {"median_ms": 1e3 * statistics.median(v), "mean_ms": 1e3 * statistics.mean(v),
                     "median_ms_per_padded_token": 1e3 * statistics.median(v) / c, "calls": len(v) * len(SLOTS)}
            for c, v in times.items()}
    for chunk, row in rows.items():
        print(f"chunk {chunk:>3}: {row['median_ms']:.2f} ms a call median ({row['mean_ms']:.2f} mean), "
              f"{row['median_ms_per_padded_token']:.3f} ms a padded token")
    result = {"meta": {"command": "python " + " ".join(sys.argv), "machine": machine(),
                       "loadavg_before": load_before, "loadavg_after": os.getloadavg(), "rounds": args.rounds,
                       "missing": args.missing, "slots": len(SLOTS)},
              "chunks": rows}
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
