"""The `jaxspec` command: generate, serve, client, batch, bench, profile, distill, models.

Bad input (empty prompt, unknown model, unreadable checkpoint, over-long prompt, bad flag values)
prints one clear line on stderr and exits 2; no tracebacks unless JAXSPEC_DEBUG=1.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import NamedTuple

from jaxspec.bench import cli as bench_cli
from jaxspec.bench import profile_cmd
from jaxspec.serving import batch_cmd, client, generate, models_cmd, serve_cmd
from jaxspec.training import cli as distill_cli


class Command(NamedTuple):
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int | None]
    help: str


COMMANDS = {
    "generate": Command(generate.add_arguments, generate.run, "generate text for one prompt"),
    "serve": Command(serve_cmd.add_serve_arguments, serve_cmd.run_serve, "run the gRPC server"),
    "client": Command(client.add_client_arguments, client.run_client, "stream a completion from a server"),
    "batch": Command(batch_cmd.add_arguments, batch_cmd.run, "offline, resumable batch generation (JSONL)"),
    "bench": Command(bench_cli.add_arguments, bench_cli.run, "serving benchmark: load × workloads × policies"),
    "profile": Command(profile_cmd.add_arguments, profile_cmd.run, "measure the step cost model on this device"),
    "distill": Command(distill_cli.add_arguments, distill_cli.run, "train a draft model for a target"),
    "models": Command(models_cmd.add_arguments, models_cmd.run, "list models, or convert one for fast loading"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxspec", description="JAX/Flax LLM serving with goodput-driven "
                                                                 "speculative decoding")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, command in COMMANDS.items():
        p = sub.add_parser(name, help=command.help, description=command.help)
        command.add_arguments(p)
    return parser


def _bad_input_errors() -> tuple[type[BaseException], ...]:
    from jaxspec.menu import CapacityError, MenuMissError
    from jaxspec.models.loading import ModelLoadError
    return (ModelLoadError, ValueError, KeyError, FileNotFoundError, CapacityError, MenuMissError)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    run = COMMANDS[args.command].run
    try:
        return int(run(args) or 0)
    except KeyboardInterrupt:
        print("jaxspec: interrupted", file=sys.stderr)
        return 130
    except _bad_input_errors() as exc:
        if os.environ.get("JAXSPEC_DEBUG"):
            raise
        message = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        print(f"jaxspec {args.command}: error: {message}", file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001 - last line of defence: one line, not a traceback
        if os.environ.get("JAXSPEC_DEBUG"):
            raise
        print(f"jaxspec {args.command}: internal error: {type(exc).__name__}: {exc} "
              f"(rerun with JAXSPEC_DEBUG=1 for a traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
