"""The decode step over pages against the per-slot cache it replaced: the code before paging, timed alternately.

    python -m benchmarks.paged_step --old /work/wt/oldmain --out docs/results/paged/step.json

`--old` is a checkout of the code before the paged KV cache (commit dc7241c), its XLA:CPU kernels built;
`--new` (default: this repository) the code with it. Each side runs in its own subprocess, a worker (this file,
run with that repository first on sys.path, so the old checkout need not contain it) that builds the engine
(default model, no proposer, Menu(num_slots=8, max_len=1024, batch_buckets=(1, 8), k_menu=(0,),
window_buckets=(256, 1024), prefill_buckets=(64,))), compiles the plain step at each (B, W) it times, holds slots
0..B-1 at each context with `engine.set_length` (untimed, before every call) and times
`engine.run_step_executable(StepKey(B, 0, W), slots, caps)` (the step executable alone, as `Engine.step` calls
it; W the smallest window bucket over the context), the (B, context) pairs alternated `--repeats` times
(`jaxspec.bench.floor.interleaved_medians`); it prints its medians as JSON. The driver runs the old and the new
worker alternately for `--rounds` rounds (old first in even rounds) with JAX's persistent compilation cache on (later
rounds do not recompile) and reports per (B, context) the median of the per-round medians and new / old (goal:
<= 1.05x). Record the load with the result (it is saved).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def worker(repo: Path, model: str | None, batches: list[int], contexts: list[int], repeats: int) -> dict:
    """Median ms of the plain step per (B, context) on the engine of `repo` (imported from there)."""
    sys.path.insert(0, str(repo))
    import numpy as np

    import jaxspec

    if Path(jaxspec.__file__).resolve().parent != (repo / "jaxspec").resolve():
        raise SystemExit(f"imported jaxspec from {jaxspec.__file__}, not from {repo}")
    from jaxspec.bench.floor import interleaved_medians
    from jaxspec.engine.build import build_model
    from jaxspec.engine.engine import Engine, enable_compilation_cache
    from jaxspec.menu import Menu, StepKey

    enable_compilation_cache()
    t0 = time.perf_counter()
    built = build_model(model)
    menu = Menu(num_slots=8, max_len=1024, batch_buckets=(1, 8), k_menu=(0,), window_buckets=(256, 1024),
                prefill_buckets=(64,))
    engine = Engine(built.model, None, menu)
    cases = [(b, c, menu.window(c + 1)) for b in batches for c in contexts]  # the step writes position c
    engine.warmup([StepKey(b, 0, w) for b, _, w in cases], progress=False)
    setup_s = time.perf_counter() - t0

    def call(batch: int, window: int):
        key, slots, caps = StepKey(batch, 0, window), np.arange(batch, dtype=np.int32), np.zeros(batch, np.int32)
        return lambda: engine.run_step_executable(key, slots, caps).block_until_ready()

    def hold(batch: int, context: int):
        def prepare():
            for slot in range(batch):
                engine.set_length(slot, context)
        return prepare

    medians = interleaved_medians([call(b, w) for b, _, w in cases], repeats,
                                  prepares=[hold(b, c) for b, c, _ in cases])
    return {"jaxspec": str(Path(jaxspec.__file__).parent), "setup_s": setup_s,
            "rows": [{"B": b, "context": c, "W": w, "ms": m * 1e3} for (b, c, w), m in zip(cases, medians)]}


def git_commit(repo: Path) -> str:
    return subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()


def run_worker(repo: Path, args) -> dict:
    """This file as a worker over `repo`, in a subprocess; its JSON (the last line of its stdout)."""
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", str(repo),
               "--batch", ",".join(map(str, args.batch)), "--context", ",".join(map(str, args.context)),
               "--repeats", str(args.repeats)] + (["--model", args.model] if args.model else [])
    env = dict(os.environ, PYTHONPATH=str(repo))
    done = subprocess.run(command, env=env, capture_output=True, text=True, cwd=str(repo))
    if done.returncode != 0:
        raise RuntimeError(f"worker over {repo} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ints = lambda v: [int(x) for x in v.split(",")]  # noqa: E731
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", type=Path, default=Path("/work/wt/oldmain"), help="checkout before paging")
    parser.add_argument("--new", type=Path, default=REPO, help="checkout with paging (default: this one)")
    parser.add_argument("--model", default=None, help="model spec or preset (default: SmolLM2-135M)")
    parser.add_argument("--batch", type=ints, default=[1, 8])
    parser.add_argument("--context", type=ints, default=[200, 800])
    parser.add_argument("--repeats", type=int, default=50, help="timed calls per (B, context) per worker")
    parser.add_argument("--rounds", type=int, default=5, help="old and new workers, alternated")
    parser.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if any(b not in (1, 8) for b in args.batch) or any(not 0 < c < 1024 for c in args.context):
        parser.error("--batch takes values of the batch buckets (1, 8); --context values in (0, 1024)")
    if args.worker is not None:
        print(json.dumps(worker(args.worker, args.model, args.batch, args.context, args.repeats)))
        return 0

    sys.path.insert(0, str(REPO))
    from jaxspec.bench.common import machine
    from jaxspec.engine.engine import enable_compilation_cache

    cache = enable_compilation_cache()  # the workers' default location (they turn it on themselves)
    load_before = os.getloadavg()
    sides = {"old": args.old.resolve(), "new": args.new.resolve()}
    rounds = []
    for round_ in range(args.rounds):
        runs = {}
        for side in (("old", "new") if round_ % 2 == 0 else ("new", "old")):
            runs[side] = run_worker(sides[side], args) | {"load": os.getloadavg()}
            print(f"round {round_} {side}: " + ", ".join(f"B={r['B']} ctx={r['context']} {r['ms']:.2f} ms"
                                                         for r in runs[side]["rows"])
                  + f" (setup {runs[side]['setup_s']:.0f} s)", file=sys.stderr)
        rounds.append(runs)
    load_after = os.getloadavg()

    summary = []
    for i, row in enumerate(rounds[0]["old"]["rows"]):
        old = statistics.median(r["old"]["rows"][i]["ms"] for r in rounds)
        new = statistics.median(r["new"]["rows"][i]["ms"] for r in rounds)
        summary.append({"B": row["B"], "context": row["context"], "W": row["W"], "old_ms": old, "new_ms": new,
                        "new_over_old": new / old})
    print(f"{'B':>3} {'context':>7} {'W':>5} {'old ms':>8} {'new ms':>8} {'new/old':>8}")
    for s in summary:
        print(f"{s['B']:>3} {s['context']:>7} {s['W']:>5} {s['old_ms']:>8.2f} {s['new_ms']:>8.2f} "
              f"{s['new_over_old']:>8.3f}")
    if args.out:
        report = {
            "command": shlex.join([sys.executable, *sys.argv]),
            "date": datetime.datetime.now().isoformat(timespec="seconds"), "machine": machine(),
            "load_before": load_before, "load_after": load_after, "compilation_cache": cache,
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "commits": {side: git_commit(path) for side, path in sides.items()},
            "summary": summary, "goal": "new / old <= 1.05", "rounds": rounds,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
