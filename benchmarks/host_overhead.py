"""Host work per decode step: the step executable alone, `Engine.step`, and the scheduler loop per policy.

    python -m benchmarks.host_overhead --model tiny --batch 1,8 --policies none,fixed:3,goodput \
        --out docs/results/host_overhead.json

On a GPU a 1.5B model's step runs in 3–4 ms (docs/benchmarks.md, "GPU"), so what the host does around it
is a visible share of every token, where on this CPU a 20–40 ms step hides it. This benchmark measures that
host work where it can be seen: on a model whose step costs little (the `tiny` preset by default), at each
batch size, for the same B rows decoding greedily with prompt lookup on a repetitive prompt:

    executable  the compiled (B, k, W) step alone, called as `Engine.step` calls it (`jaxspec.bench.floor`)
    engine      `Engine.step`: the shape choice, the call, the one host copy of the result, the bookkeeping
    scheduler   the scheduler's loop, per decode step, with each policy (its choose/observe included), the
                requests' prefill excluded (the same B requests, max_tokens each, admitted at once), overlapped
                (step n+1 dispatched before step n is read) and synchronous (`--no-overlap`), alternated
                `--rounds` times; the host time left exposed per step is the loop's time per step minus the
                executable's (k = 0 for `none`)

The executable and `Engine.step` are timed alternately (`interleaved_medians`); the scheduler rows are the
wall time of the decode phase over its steps. The differences are the host's share per step.
Record the load with the result (it is printed and saved).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import numpy as np

from jaxspec.bench.common import machine
from jaxspec.bench.floor import interleaved_medians, load
from jaxspec.engine.build import build_model, build_proposer
from jaxspec.engine.engine import Engine, enable_compilation_cache
from jaxspec.menu import Menu, StepKey
from jaxspec.scheduling.requests import Request
from jaxspec.scheduling.scheduler import Scheduler, SchedulerConfig
from jaxspec.serving.runtime import build_policy
from jaxspec.types import SamplingParams

PROMPT_LEN = 48


def prompt(vocab: int, row: int) -> list[int]:
    """A repetitive prompt (period 6), so prompt lookup proposes and the tiny model mostly continues it."""
    return [2 + (row + i % 6) % (vocab - 2) for i in range(PROMPT_LEN)]


def executable_call(engine: Engine, batch: int, k: int, window: int):
    """A no-argument call of the compiled (B, k, W) step on slots 0..B-1 alone (blocks until done)."""
    key, slots, caps = StepKey(batch, k, window), np.arange(batch, dtype=np.int32), np.full((batch,), k, np.int32)
    return lambda: engine.run_step_executable(key, slots, caps).block_until_ready()


def engine_call(engine: Engine, batch: int, k: int):
    """A no-argument `Engine.step` on slots 0..B-1 (lengths reset after each call, so the window stays)."""
    slots = list(range(batch))

    def call():
        before = engine.lengths[:batch].copy()
        engine.step(slots, k)
        engine.lengths[:batch] = before

    return call


def dispatch_split(engine: Engine, batch: int, repeats: int) -> dict:
    """Median ms of `dispatch_step` and of its `result()` (k = 0 on slots 0..B-1): a dispatch that takes the
    whole step and a read that takes none is a backend running the step inline, where no overlap is possible."""
    slots, dispatch, read = list(range(batch)), [], []
    before = engine.lengths[:batch].copy()
    for _ in range(repeats):
        t0 = time.perf_counter()
        pending = engine.dispatch_step(slots, 0)
        t1 = time.perf_counter()
        pending.result()
        dispatch.append(t1 - t0)
        read.append(time.perf_counter() - t1)
        for slot, length in zip(slots, before):
            engine.set_length(slot, int(length))
    return {"dispatch_ms": float(np.median(dispatch)) * 1e3, "read_ms": float(np.median(read)) * 1e3}


def scheduler_run(engine: Engine, policy_spec: str, batch: int, max_tokens: int, overlap: bool = True) -> dict:
    """B requests decoded together under a policy: seconds per decode step, steps, tokens per step."""
    policy = build_policy(policy_spec, engine, progress=False)
    scheduler = Scheduler(engine, policy, config=SchedulerConfig(overlap=overlap))
    vocab = engine.vocab_size
    requests = [Request(f"r{i}", prompt(vocab, i), SamplingParams(max_tokens=max_tokens, ignore_eos=True))
                for i in range(batch)]
    scheduler.generate_all(requests[:1])  # warm the loop (and the policy's first decisions)
    steps = []
    scheduler.add_step_listener(lambda stats: steps.append(time.perf_counter()))
    t0 = time.perf_counter()
    results = scheduler.generate_all([Request(f"{r.request_id}-timed", r.prompt_token_ids, r.params)
                                      for r in requests])
    wall = time.perf_counter() - t0
    tokens = sum(len(r.token_ids) for r in results)
    # the decode phase: from the first step's read to the last's, over the steps between them
    per_step = (steps[-1] - steps[0]) / max(1, len(steps) - 1) if len(steps) > 1 else float("nan")
    return {"policy": policy_spec, "B": batch, "overlap": overlap, "steps": len(steps), "tokens": tokens,
            "tokens_per_step": tokens / max(1, len(steps)), "scheduler_ms_per_step": per_step * 1e3,
            "decode_tokens_per_s": tokens / max(1, len(steps)) / per_step, "wall_s": wall,
            "tokens_per_s": tokens / wall}


def overlap_summary(spec: str, runs: dict[bool, list[dict]], row: dict) -> dict:
    """Medians over the rounds: ms per step and decode tokens/s of each loop, the speed-up, and the host time
    left exposed per step (the loop's ms per step minus the executable's: k = 0 for `none`, else k)."""
    med = lambda mode, key: float(np.median([r[key] for r in runs[mode]]))  # noqa: E731
    exe = row["executable_k0_ms"] if spec == "none" else row["executable_ms"]
    sync_exposed, overlap_exposed = med(False, "scheduler_ms_per_step") - exe, med(True, "scheduler_ms_per_step") - exe
    return {"policy": spec, "executable_ms": exe,
            "sync_ms_per_step": med(False, "scheduler_ms_per_step"),
            "overlap_ms_per_step": med(True, "scheduler_ms_per_step"),
            "sync_tokens_per_s": med(False, "decode_tokens_per_s"),
            "overlap_tokens_per_s": med(True, "decode_tokens_per_s"),
            "speedup": med(True, "decode_tokens_per_s") / med(False, "decode_tokens_per_s"),
            "sync_exposed_ms": sync_exposed, "overlap_exposed_ms": overlap_exposed,
            "exposed_ratio": max(0.0, overlap_exposed) / sync_exposed if sync_exposed > 0 else float("nan")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="model spec or random-weights preset (default: tiny)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch", type=lambda v: tuple(int(x) for x in v.split(",")), default=(1, 8))
    parser.add_argument("--k", type=int, default=3, help="k of the executable and Engine.step rows")
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--policies", type=lambda v: tuple(v.split(",")), default=("none", "fixed:3", "goodput"))
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=200, help="timed calls of the executable and Engine.step")
    parser.add_argument("--rounds", type=int, default=3, help="overlapped / synchronous scheduler runs, alternated")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if PROMPT_LEN + args.max_tokens + args.k + 2 > args.window:
        parser.error(f"--window {args.window} is too small for a {PROMPT_LEN}-token prompt and --max-tokens "
                     f"{args.max_tokens}")
    enable_compilation_cache()
    built = build_model(args.model, dtype=args.dtype)
    proposer = build_proposer("ngram", built.model)
    b_max = max(args.batch)
    menu = Menu(num_slots=b_max, max_len=args.window, batch_buckets=tuple(sorted(set(args.batch))),
                k_menu=tuple(sorted({0, args.k, *(int(p.split(":")[1]) for p in args.policies if ":" in p)})),
                window_buckets=(args.window,), prefill_buckets=(64,))
    engine = Engine(built.model, proposer, menu)
    engine.warmup(progress=False)
    load_before = load()
    rows = []
    for batch in args.batch:
        engine.reset()
        for slot in range(batch):
            engine.prefill(slot, prompt(engine.vocab_size, slot), SamplingParams(temperature=0.0))
        exe_s, eng_s, exe0_s = interleaved_medians([executable_call(engine, batch, args.k, args.window),
                                                    engine_call(engine, batch, args.k),
                                                    executable_call(engine, batch, 0, args.window)], args.repeats)
        row = {"B": batch, "k": args.k, "executable_ms": exe_s * 1e3, "engine_step_ms": eng_s * 1e3,
               "engine_host_ms": (eng_s - exe_s) * 1e3, "executable_k0_ms": exe0_s * 1e3, "policies": [],
               "overlap": [], "k0_dispatch_split": dispatch_split(engine, batch, args.repeats)}
        engine.reset()
        for spec in args.policies:
            runs = {True: [], False: []}
            for _ in range(args.rounds):  # alternated, so the machine's load drifts over both alike
                for overlap in (False, True):
                    runs[overlap].append(scheduler_run(engine, spec, batch, args.max_tokens, overlap))
                    engine.reset()
            row["policies"] += runs[False] + runs[True]
            row["overlap"].append(overlap_summary(spec, runs, row))
        rows.append(row)
        print(f"B={batch} k={args.k}: executable {row['executable_ms']:.3f} ms (k=0: {row['executable_k0_ms']:.3f} ms),"
              f" Engine.step {row['engine_step_ms']:.3f} ms (host {row['engine_host_ms']:.3f} ms); k=0 dispatch_step "
              f"{row['k0_dispatch_split']['dispatch_ms']:.3f} ms, read {row['k0_dispatch_split']['read_ms']:.3f} ms")
        for o in row["overlap"]:
            print(f"  {o['policy']:<10} synchronous {o['sync_ms_per_step']:7.3f} ms/step {o['sync_tokens_per_s']:8.1f} "
                  f"tok/s | overlapped {o['overlap_ms_per_step']:7.3f} ms/step {o['overlap_tokens_per_s']:8.1f} "
                  f"tok/s | speed-up {o['speedup']:.2f}x, host exposed {o['sync_exposed_ms']:.3f} -> "
                  f"{o['overlap_exposed_ms']:.3f} ms/step ({o['exposed_ratio']:.0%})")
    result = {"command": "python -m benchmarks.host_overhead " + " ".join(argv if argv is not None else sys.argv[1:]),
              "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": machine(),
              "devices": [str(d) for d in jax.devices()], "model": built.name,
              "dtype": args.dtype, "load_before": load_before, "rows": rows, "load_after": load()}
    print(f"{load_before} -> {result['load_after']}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
