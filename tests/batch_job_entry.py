"""Test-only entry point: jaxspec.serving.batch_job.run_batch on the fake engine (jaxspec.engine.fake).

    python -m tests.batch_job_entry IN.jsonl OUT.jsonl [--step-delay SECONDS]

The fake engine continues every prompt by counting (token after t is t + 1 mod 64) and gets the first
`ACCEPT` proposals of every step right, so each record's output is known by hand and the same in every
process. `--step-delay` slows every decode step so a test can kill the job at chosen points.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from jaxspec.engine.fake import FakeEngine  # noqa: E402
from jaxspec.menu import Menu  # noqa: E402
from jaxspec.policy.fixed import FixedPolicy  # noqa: E402
from jaxspec.serving.batch_job import run_batch  # noqa: E402
from tests.fake_tokenizer import EOS, FakeTokenizer, ascii_tokenizer  # noqa: E402

MENU = Menu(num_slots=4, max_len=64, batch_buckets=(4,), k_menu=(0, 3), window_buckets=(64,),
            prefill_buckets=(16,))
VOCAB = 64  # the ascii tokenizer's
ACCEPT = 1


def build(step_delay: float = 0.0) -> tuple[FakeEngine, FakeTokenizer, FixedPolicy]:
    """The job's engine, tokenizer and policy."""
    engine = FakeEngine(MENU, vocab_size=VOCAB, eos_token_ids=(EOS,), accept=ACCEPT)
    engine.warmup()
    if step_delay > 0:
        dispatch = engine.dispatch_step  # the scheduler dispatches every step through it

        def slow_dispatch(*args, **kwargs):
            time.sleep(step_delay)
            return dispatch(*args, **kwargs)

        engine.dispatch_step = slow_dispatch
    return engine, ascii_tokenizer(), FixedPolicy(3)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("input")
    parser.add_argument("output")
    parser.add_argument("--step-delay", type=float, default=0.0)
    args = parser.parse_args(argv)
    engine, tokenizer, policy = build(step_delay=args.step_delay)
    return run_batch(engine, tokenizer, policy, args.input, args.output, progress=False).exit_code


if __name__ == "__main__":
    sys.exit(main())
