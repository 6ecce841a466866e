"""`jaxspec batch`: the batch job's flags plus the shared engine flags, wired to the runtime."""

from __future__ import annotations

import argparse

from jaxspec.engine_args import EngineArgs
from serving import batch_job
from serving.runtime import build_runtime


def add_arguments(parser: argparse.ArgumentParser) -> None:
    batch_job.add_arguments(parser)
    EngineArgs.add_arguments(parser, default_menu="default")


def run(args: argparse.Namespace) -> int:
    def build(a: argparse.Namespace):
        runtime = build_runtime(EngineArgs.from_namespace(a), progress=not a.no_progress)
        return runtime.engine, runtime.tokenizer, runtime.policy

    return batch_job.run(args, build)
