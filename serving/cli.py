"""The `jaxspec` command: generate, serve, client, batch, bench, profile, distill, models.

Bad input (empty prompt, unknown model, unreadable checkpoint, over-long prompt, bad flag values)
prints one clear line on stderr and exits 2; no tracebacks unless JAXSPEC_DEBUG=1.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# subcommand -> (module, add-arguments function, run function, help)
COMMANDS = {
    "generate": ("serving.generate", "add_arguments", "run", "generate text for one prompt"),
    "serve": ("serving.serve_cmd", "add_serve_arguments", "run_serve", "run the gRPC server"),
    "client": ("serving.client", "add_client_arguments", "run_client", "stream a completion from a server"),
    "batch": ("serving.batch_cmd", "add_arguments", "run", "offline, resumable batch generation (JSONL)"),
    "bench": ("benchmarks.cli", "add_arguments", "run", "serving benchmark: load × workloads × policies"),
    "profile": ("jaxspec.profiler", "add_arguments", "run", "measure the step cost model on this device"),
    "distill": ("jaxspec.distill", "add_arguments", "run", "train a draft model for a target"),
    "models": ("serving.models_cmd", "add_arguments", "run", "list models, or convert one for fast loading"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxspec", description="JAX/Flax LLM serving with goodput-driven "
                                                                 "speculative decoding")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module, add, _run, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module, _run=_run)
        try:
            getattr(importlib.import_module(module), add)(p)
        except ImportError as exc:  # a command whose optional parts are not installed/built
            p.set_defaults(_unavailable=f"`jaxspec {name}` is unavailable: {exc}")
            p.add_argument("_ignored", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)  # report why, not its flags
    return parser


def _bad_input_errors() -> tuple[type[BaseException], ...]:
    from jaxspec.menu import CapacityError, MenuMissError
    from models.loading import ModelLoadError
    return (ModelLoadError, ValueError, KeyError, FileNotFoundError, CapacityError, MenuMissError)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "_unavailable", None):
        print(f"jaxspec: {args._unavailable}", file=sys.stderr)
        return 2
    run = getattr(importlib.import_module(args._module), args._run)
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
