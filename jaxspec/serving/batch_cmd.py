"""`jaxspec batch`: the batch job's flags plus the shared engine flags, wired to the runtime.

Multi-process (docs/multiprocess.md): process 0 runs the job (reads the input, writes the output); the
others mirror its engine calls. `--ray` runs it on a pool of Ray actors instead (jaxspec/serving/ray_batch.py)."""

from __future__ import annotations

import argparse
import contextlib
import functools
import sys

from jaxspec.engine import distributed
from jaxspec.engine.args import EngineArgs
from jaxspec.serving import batch_job, ray_batch
from jaxspec.serving.runtime import build_runtime, follow_runtime


def add_arguments(parser: argparse.ArgumentParser) -> None:
    batch_job.add_arguments(parser)
    EngineArgs.add_arguments(parser, default_menu="default")
    distributed.add_arguments(parser)
    ray_batch.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    spec = distributed.DistributedSpec.from_args(args)
    engine_args = EngineArgs.from_namespace(args)
    if args.ray:
        if spec.enabled:
            print("jaxspec batch: --ray runs one engine per Ray actor; it does not combine with --num-processes "
                  "(a replica's engine may still use a --mesh)", file=sys.stderr)
            return 2
        return ray_batch.run(args, functools.partial(ray_batch.build_replica, engine_args))
    if flags := ray_batch.ray_flags_without_ray(args):
        print(f"jaxspec batch: {', '.join(flags)} need --ray", file=sys.stderr)
        return 2
    link = distributed.initialize(spec)
    if isinstance(link, distributed.FollowerLink):
        return follow_runtime(engine_args, link)

    def build(a: argparse.Namespace):
        runtime = build_runtime(engine_args, progress=not a.no_progress, leader=link)
        return runtime.engine, runtime.tokenizer, runtime.policy

    with link or contextlib.nullcontext():
        return batch_job.run(args, build)
