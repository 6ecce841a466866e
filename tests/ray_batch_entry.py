"""Test-only replica builders for `jaxspec batch --ray`, and an entry point around them.

    python -m tests.ray_batch_entry [jaxspec batch flags] --step-delay SECONDS

is `jaxspec batch --ray` except that every replica sleeps SECONDS before each engine step, so a test
can kill the driver or a replica mid-run. The builders run inside the Ray actors: they must be
importable there (the tests put the repository on the cluster's PYTHONPATH).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from jaxspec.engine.args import EngineArgs  # noqa: E402
from jaxspec.serving import batch_cmd, ray_batch  # noqa: E402
from tests import batch_job_entry  # noqa: E402


def _slowed(engine, delay: float):
    dispatch = engine.dispatch_step  # the scheduler dispatches every step through it

    def slow_dispatch(*args, **kwargs):
        time.sleep(delay)
        return dispatch(*args, **kwargs)

    engine.dispatch_step = slow_dispatch
    return engine


def slow_replica(engine_args: EngineArgs, delay: float):
    """`ray_batch.build_replica`, each engine step `delay` seconds slower."""
    engine, tokenizer, policy = ray_batch.build_replica(engine_args)
    return _slowed(engine, delay), tokenizer, policy


def failing_fake_replica():
    """The fake engine of tests/batch_job_entry.py whose prefill raises for a prompt that starts with "!"."""
    engine, tokenizer, policy = batch_job_entry.build()
    prefill_chunk, mark = engine.prefill_chunk, tokenizer.encode("!")[0]

    def failing(slot, tokens, start, *args, **kwargs):
        if start == 0 and len(tokens) and int(tokens[0]) == mark:
            raise RuntimeError("injected prefill failure")
        return prefill_chunk(slot, tokens, start, *args, **kwargs)

    engine.prefill_chunk = failing
    return engine, tokenizer, policy


def broken_replica():
    """A replica whose engine cannot be built."""
    raise ValueError("no such model: 'nowhere'")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    batch_cmd.add_arguments(parser)
    parser.add_argument("--step-delay", type=float, default=0.0)
    args = parser.parse_args(argv)
    build = functools.partial(slow_replica, EngineArgs.from_namespace(args), args.step_delay)
    return ray_batch.run(args, build)


if __name__ == "__main__":
    sys.exit(main())
