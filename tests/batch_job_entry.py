"""Test-only entry point: serving.batch_job.run_batch on a tiny random engine (fixed seed).

    python -m tests.batch_job_entry IN.jsonl OUT.jsonl [--step-delay SECONDS]

`--step-delay` slows every decode step so a test can kill the job at chosen points.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from jaxspec.engine import Engine, EngineConfig, enable_compilation_cache  # noqa: E402
from jaxspec.policy.fixed import NoSpeculation  # noqa: E402
from models.config import TINY  # noqa: E402
from models.llama import Llama, random_model  # noqa: E402
from serving.batch_job import run_batch  # noqa: E402
from tests.fake_tokenizer import FakeTokenizer, ascii_tokenizer  # noqa: E402

CONFIG = EngineConfig(num_slots=4, max_len=64, batch_buckets=(4,), k_menu=(0,), window_buckets=(64,),
                      prefill_buckets=(16,))
MODEL_SEED = 0


def build(model: Llama | None = None, step_delay: float = 0.0) -> tuple[Engine, FakeTokenizer, NoSpeculation]:
    """The job's engine, tokenizer and policy (pass `model` to reuse an identical in-process one)."""
    engine = Engine(model or random_model(TINY, seed=MODEL_SEED), None, CONFIG)
    engine.warmup(progress=False)
    if step_delay > 0:
        step = engine.step

        def slow_step(*args, **kwargs):
            time.sleep(step_delay)
            return step(*args, **kwargs)

        engine.step = slow_step
    return engine, ascii_tokenizer(), NoSpeculation()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("input")
    parser.add_argument("output")
    parser.add_argument("--step-delay", type=float, default=0.0)
    args = parser.parse_args(argv)
    enable_compilation_cache()
    engine, tokenizer, policy = build(step_delay=args.step_delay)
    return run_batch(engine, tokenizer, policy, args.input, args.output, progress=False).exit_code


if __name__ == "__main__":
    sys.exit(main())
