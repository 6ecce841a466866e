"""Cold warm-up of the engine's menus: compiling serially (one worker) against the thread pool, alternated.

    python -m benchmarks.warmup_speed --menus generate,default --rounds 2 \
        --out docs/results/warmup/warmup_speed_cpu.json

Each trial is a fresh process that builds the engine the way the engine commands do
(`jaxspec.serving.runtime.assemble_engine` with the command's default flags: `--menu generate` for `jaxspec
generate`, `--menu default` for `jaxspec serve`; the menu trimmed to the k values the default policy can pick)
and times `Engine.warmup(workers=W)`: lowering, compiling and the first run of every shape. JAX's persistent
compilation cache points at a fresh empty folder per trial, so nothing is answered from an earlier run (a
cold start; the entries are still written, as on a real first start). A fresh process also leaves JAX's
in-memory caches empty. Serial (W = 1) and parallel (W = `--workers`, default
`jaxspec.engine.executables.default_compile_workers()`, one per core) trials alternate, the order flipped every
round, so drift in the machine's load hits both alike. The load average is recorded before and after every
trial: on a shared machine a loaded core slows both modes and shrinks the parallel gain.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

COMMAND_OF_MENU = {"generate": "jaxspec generate", "default": "jaxspec serve"}


def child(menu_name: str, workers: int, model: str | None) -> dict:
    """One cold warm-up in this process (the persistent cache already pointed at an empty folder)."""
    t0 = time.perf_counter()
    from jaxspec.engine import compile_counter
    from jaxspec.engine.args import EngineArgs
    from jaxspec.engine.build import load_menu
    from jaxspec.engine.engine import enable_compilation_cache
    from jaxspec.serving.runtime import assemble_engine

    cache = enable_compilation_cache()  # $JAXSPEC_COMPILATION_CACHE: the parent's fresh folder
    compile_counter.install()
    engine_args = EngineArgs(model=model, menu=menu_name)
    menu = engine_args.engine_menu(load_menu(menu_name))
    engine, _, model_name = assemble_engine(engine_args, menu)
    built_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    shapes = engine.warmup(progress=False, workers=workers)
    warmup_s = time.perf_counter() - t1
    cached = sum(1 for _ in Path(cache).rglob("*") if _.is_file())
    return {"menu": menu_name, "model": model_name, "workers": workers, "shapes": shapes, "warmup_s": warmup_s,
            "build_s": built_s, "cache_entries_written": cached, "kernels": engine.kernels.to_json(),
            "menu_shapes": {"batch": list(menu.batch_buckets), "k": list(menu.k_menu),
                            "windows": list(menu.window_buckets), "prefill": list(menu.prefill_buckets)}}


def run_trial(menu_name: str, workers: int, model: str | None) -> dict:
    """A child process on a fresh cache folder; its record plus the load around it."""
    with tempfile.TemporaryDirectory(prefix="jaxspec-cold-cache-") as cache:
        env = {**os.environ, "JAXSPEC_COMPILATION_CACHE": cache, "PYTHONUNBUFFERED": "1"}
        env.pop("JAX_COMPILATION_CACHE_DIR", None)
        cmd = [sys.executable, "-m", "benchmarks.warmup_speed", "--child", menu_name, "--workers", str(workers)]
        if model is not None:
            cmd += ["--model", model]
        before = os.getloadavg()
        t = time.perf_counter()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        wall = time.perf_counter() - t
        after = os.getloadavg()
    if proc.returncode != 0:
        raise RuntimeError(f"trial {menu_name} workers={workers} failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
    record = json.loads(proc.stdout.strip().splitlines()[-1])
    return record | {"process_wall_s": wall, "load_before": before, "load_after": after}


def summarize(trials: list[dict], parallel_workers: int) -> list[dict]:
    """Per menu: median warm-up seconds serial and parallel, and the speed-up serial / parallel."""
    rows = []
    for menu_name in dict.fromkeys(t["menu"] for t in trials):
        mine = [t for t in trials if t["menu"] == menu_name]
        serial = [t["warmup_s"] for t in mine if t["workers"] == 1]
        parallel = [t["warmup_s"] for t in mine if t["workers"] == parallel_workers]
        s, p = statistics.median(serial), statistics.median(parallel)
        rows.append({"menu": menu_name, "command": COMMAND_OF_MENU.get(menu_name, f"--menu {menu_name}"),
                     "shapes": mine[0]["shapes"], "serial_s": s, "parallel_s": p, "speedup": s / p,
                     "serial_all_s": serial, "parallel_all_s": parallel, "parallel_workers": parallel_workers})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--menus", type=lambda v: v.split(","), default=["generate", "default"],
                        help="menus (jaxspec/configs/engine.yaml names): generate = `jaxspec generate`'s, "
                             "default = `jaxspec serve`'s")
    parser.add_argument("--model", default=None, help="model spec (default: the embedded SmolLM2-135M)")
    parser.add_argument("--workers", type=int, default=None,
                        help="threads of the parallel trials (default: one per core, or $JAXSPEC_COMPILE_WORKERS)")
    parser.add_argument("--rounds", type=int, default=2, help="serial + parallel pairs per menu")
    parser.add_argument("--out", type=Path, default=None, help="JSON file for the results")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)  # one trial, in a fresh process
    args = parser.parse_args(argv)
    if args.child is not None:
        print(json.dumps(child(args.child, args.workers, args.model)), flush=True)
        return 0

    from jaxspec.engine.executables import default_compile_workers

    workers = args.workers or default_compile_workers()
    if workers < 2:
        parser.error(f"the parallel trials need --workers >= 2 (got {workers}): nothing to compare")
    load_before = os.getloadavg()
    trials = []
    for round_index in range(args.rounds):
        for menu_name in args.menus:
            order = (1, workers) if round_index % 2 == 0 else (workers, 1)
            for w in order:
                trials.append(run_trial(menu_name, w, args.model))
                t = trials[-1]
                print(f"round {round_index}: {menu_name:<9} workers={w}: {t['warmup_s']:6.1f} s for {t['shapes']} "
                      f"shapes (load {t['load_before'][0]:.2f} -> {t['load_after'][0]:.2f})", flush=True)
    rows = summarize(trials, workers)
    for r in rows:
        print(f"{r['command']:<17} ({r['menu']}, {r['shapes']} shapes): serial {r['serial_s']:.1f} s, "
              f"{r['parallel_workers']} workers {r['parallel_s']:.1f} s: {r['speedup']:.2f}x")
    import jax

    from jaxspec.bench.common import machine

    result = {"command": "python -m benchmarks.warmup_speed " + " ".join(argv if argv is not None else sys.argv[1:]),
              "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "machine": machine(),
              "devices": [str(d) for d in jax.devices()], "cache": "a fresh empty persistent-cache folder per trial",
              "load_before": load_before, "load_after": os.getloadavg(), "summary": rows, "trials": trials}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
