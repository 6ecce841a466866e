"""`jaxspec profile`: measure the step cost model T(B, k, W) of an engine on this device and save it
(jaxspec.engine.profiler); `--floor` also times each step against the bare chain of its own matmuls
(jaxspec.bench.floor)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

from jaxspec.bench.floor import format_growth, format_rows, load, step_vs_bare, window_growth
from jaxspec.engine.args import EngineArgs
from jaxspec.engine.profiler import profile_engine
from jaxspec.models.kernel_plan import kernel_choice
from jaxspec.policy.cost_model import default_profile_dir


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # a profile is only valid for the proposer (and menu) it was measured with
    EngineArgs.add_arguments(parser, only=("model", "proposer", "draft", "menu", "dtype", "mesh", "kernels"),
                             default_menu=None,
                             defaults={"proposer": "ngram"})
    parser.add_argument("--batch-buckets", type=_ints, default=None, help="override the menu, e.g. 1,4,8")
    parser.add_argument("--k-menu", type=_ints, default=None, help="override the menu, e.g. 0,1,2,4")
    parser.add_argument("--window-buckets", type=_ints, default=None, help="override the menu, e.g. 256,1024")
    parser.add_argument("--contexts", type=_ints, default=None,
                        help="context lengths to time at (default: one per window bucket)")
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per shape (median kept)")
    parser.add_argument("--no-real-token-probe", action="store_true", help="skip measuring c_real")
    parser.add_argument("--out", type=Path, default=None,
                        help="output JSON file (default: $JAXSPEC_PROFILE_DIR or ~/.cache/jaxspec/profiles/<key>.json)")
    parser.add_argument("--json", action="store_true", help="print the profile as JSON on stdout")
    parser.add_argument("--floor", action="store_true",
                        help="also time each (k, W) step at B = 1 against a bare chain of the model's own matmuls "
                             "(jaxspec/bench/floor.py) and print the ratios")
    parser.add_argument("--no-progress", action="store_true")


def build_from_args(args: argparse.Namespace):
    """The engine `jaxspec profile` times: jaxspec.engine.build.build_engine with the chosen menu."""
    from jaxspec.engine.build import build_engine, load_menu  # lazy: loads JAX and the model

    config = load_menu(args.menu, batch_buckets=args.batch_buckets, k_menu=args.k_menu,
                       window_buckets=args.window_buckets)
    mesh = EngineArgs(menu=args.menu or "default", mesh=args.mesh).mesh_spec()
    engine, _tokenizer = build_engine(model=args.model, proposer=args.proposer, draft=args.draft, menu=config,
                                      dtype=args.dtype, mesh=mesh, kernels=kernel_choice(args.kernels))
    return engine


def run(args: argparse.Namespace, builder: Callable[[argparse.Namespace], object] = build_from_args) -> int:
    """Build the engine, profile it, save the JSON (and print a table or the JSON). Returns 0."""
    engine = builder(args)
    profile = profile_engine(engine, contexts=args.contexts, repeats=args.repeats, progress=not args.no_progress,
                             real_token_probe=not args.no_real_token_probe)
    out = args.out or default_profile_dir() / profile.key.filename()
    profile.save(out)
    if args.json:
        print(json.dumps(profile.to_json(), indent=1))
    else:
        print(f"{profile.key.device_kind} {profile.key.model} / {profile.key.draft}: "
              f"{len(profile.entries)} shapes, c_real = {profile.real_token_s * 1e6:.2f} µs/token")
        for e in sorted(profile.entries, key=lambda e: (e.window, e.batch, e.k)):
            print(f"  B={e.batch:<3d} k={e.k:<2d} W={e.window:<5d} {e.seconds * 1e3:9.3f} ms")
    print(f"saved {out}", file=sys.stderr)
    if args.floor:
        rows = step_vs_bare(engine)
        print(f"the step against the bare chain of its own matmuls at B = 1 ({load()}):")
        print(format_rows(rows))
        print(format_growth(window_growth(engine, rows)))
    return 0
