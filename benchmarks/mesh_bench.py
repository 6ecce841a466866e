"""The engine over device meshes: correctness against one device, menu compile time, and decode speed
as a fraction of memory bandwidth (docs/design.md, "Sharding").

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m benchmarks.mesh_bench \
        --model tiny --meshes 1x1,1x2,2x2,1x4,8x1 --json docs/results/mesh_tiny.json
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m benchmarks.mesh_bench \
        --meshes 1x1,8x1,1x3 --compile-menu default --json docs/results/mesh_compile.json
    python -m benchmarks.mesh_bench --model qwen2.5-1.5b --dtype bfloat16 --meshes 1x1,1x2 --peak-gbs 4800  # GPUs

Per mesh (DxM = data × model):
- `tokens_equal`: greedy tokens of a mixed batch (4 prompts, prompt lookup, k ∈ {0, 2} steps) equal
  those on one device;
- `compile_s`: wall seconds to compile the whole `--compile-menu` (persistent compilation cache off);
- `decode`: plain decoding (k = 0) at B = 1 and B = `--batch`: ms per step, tokens/s, and the bytes a
  step reads per device (its weight shards + its KV window) over the step time, as a fraction of
  `--peak-gbs`.

Forced host devices (XLA_FLAGS) share the same CPU cores: on CPU only `tokens_equal` and `compile_s`
mean anything; the speed columns are printed for completeness and say so.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np


def _meshes(text: str) -> list[tuple[int, int]]:
    return [tuple(int(x) for x in part.split("x")) for part in text.split(",")]


def _mixed_batch_tokens(engine, vocab: int) -> list[list[int]]:
    """4 rows (a repetitive prompt for prompt lookup, random ones), k alternating 2 and 0."""
    from jaxspec.types import SamplingParams

    rng = np.random.default_rng(0)
    motif = [int(t) for t in rng.integers(2, vocab, 8)]
    prompts = [motif * 3, [int(t) for t in rng.integers(2, vocab, 29)], motif[:4] * 4, [int(t) for t in
               rng.integers(2, vocab, 5)]]
    out = [[engine.prefill(slot, p, SamplingParams())] for slot, p in enumerate(prompts)]
    for i in range(12):
        result = engine.step(list(range(4)), 2 if i % 3 else 0)
        for row in range(4):
            out[row] += result.row_tokens(row)
    for slot in range(4):
        engine.free(slot)
    return out


def _bytes_per_device(engine, window: int, batch: int) -> float:
    """Weight shard bytes + the KV window of `batch` rows, on one device (the most loaded)."""
    globals_, layers = engine.placed_weights()
    arrays = list(globals_.values()) + [a for layer in layers for a in layer.values()]
    weights = sum(np.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize for a in arrays)
    k0 = engine.state.cache.k[0]
    per_slot_position = np.prod(k0.sharding.shard_shape(k0.shape)[2:]) * k0.dtype.itemsize  # G_dev × H
    kv = 2 * len(engine.state.cache.k) * batch * window * per_slot_position
    return float(weights + kv)


def _decode(engine, batch: int, steps: int, peak_gbs: float | None) -> dict:
    from jaxspec.types import SamplingParams

    slots = list(range(batch))
    for slot in slots:
        engine.prefill(slot, [3 + slot] * 16, SamplingParams())
    engine.step(slots, 0)  # first call of this shape: warm caches
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step(slots, 0)
        times.append(time.perf_counter() - t)
    for slot in slots:
        engine.free(slot)
    step_s = float(np.median(times))
    window = engine.menu.window_buckets[0]
    read = _bytes_per_device(engine, window, batch)
    row = {"batch": batch, "step_ms": 1e3 * step_s, "tokens_per_s": batch / step_s,
           "bytes_per_device_per_step": read, "gbs_per_device": read / step_s / 1e9}
    if peak_gbs:
        row["fraction_of_peak"] = read / step_s / 1e9 / peak_gbs
    return row


def run_mesh(args, mesh: tuple[int, int], reference: list[list[int]] | None) -> dict:
    import jax

    from jaxspec.engine.build import build_model, load_menu
    from jaxspec.engine.engine import Engine
    from jaxspec.mesh import MeshSpec
    from jaxspec.speculation.proposers.prompt_lookup import PromptLookupProposer

    spec = MeshSpec(*mesh)
    record: dict = {"mesh": str(spec)}
    target = build_model(args.model, dtype=args.dtype, mesh=spec).model
    small = load_menu("tiny" if args.model == "tiny" else "generate").replace(
        num_slots=max(4, args.batch), batch_buckets=(1, 4, args.batch) if args.batch > 4 else (1, 4), k_menu=(0, 2))
    small = small.replace(max_len=small.window_buckets[0], window_buckets=small.window_buckets[:1])
    engine = Engine(target, PromptLookupProposer(1, 3), small, mesh=spec)
    record["notes"] = list(engine.sharding_notes)
    engine.warmup(progress=False)
    tokens = _mixed_batch_tokens(engine, engine.vocab_size)
    record["tokens"] = tokens
    record["tokens_equal"] = None if reference is None else tokens == reference
    record["decode"] = [_decode(engine, b, args.steps, args.peak_gbs) for b in sorted({1, args.batch})]
    if args.compile_menu:
        menu = load_menu(args.compile_menu)
        jax.config.update("jax_enable_compilation_cache", False)
        full = Engine(target, PromptLookupProposer(1, 3), menu, mesh=spec)
        t = time.perf_counter()
        record["compiled_shapes"] = full.warmup(progress=not args.quiet)
        record["compile_s"] = time.perf_counter() - t
        record["compile_menu"] = args.compile_menu
    return record


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model spec (default: the embedded SmolLM2-135M)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--meshes", type=_meshes, default=[(1, 1), (1, 3)], help="DxM,... (the first is the reference)")
    parser.add_argument("--batch", type=int, default=16, help="the larger decode batch (default 16)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per batch size")
    parser.add_argument("--peak-gbs", type=float, default=None, help="device memory bandwidth, GB/s (H200: 4800)")
    parser.add_argument("--compile-menu", default=None, help="also time compiling this whole menu (e.g. default)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)

    import jax

    from jaxspec.bench.common import machine

    load_before = os.getloadavg()
    records, reference = [], None
    for mesh in args.meshes:
        record = run_mesh(args, mesh, reference)
        reference = reference if reference is not None else record["tokens"]
        records.append(record)
        decode = "  ".join(f"B={d['batch']}: {d['step_ms']:.1f} ms, {d['tokens_per_s']:.0f} tok/s"
                           + (f", {100 * d['fraction_of_peak']:.1f}% of peak" if 'fraction_of_peak' in d else "")
                           for d in record["decode"])
        compile_part = f"  compile {record['compile_s']:.0f} s ({record['compiled_shapes']} shapes)" \
            if "compile_s" in record else ""
        print(f"{record['mesh']}: tokens_equal={record['tokens_equal']}  {decode}{compile_part}", file=sys.stderr)
    backend = jax.default_backend()
    result = {"meta": {"command": " ".join(sys.argv), "machine": machine(), "backend": backend,
                       "devices": len(jax.devices()), "xla_flags": os.environ.get("XLA_FLAGS", ""),
                       "load_before": load_before, "load_after": os.getloadavg(),
                       "speed_meaningful": backend != "cpu"},
              "records": records}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    print(json.dumps({r["mesh"]: {"tokens_equal": r["tokens_equal"], "compile_s": r.get("compile_s")}
                      for r in records}))
    return 0 if all(r["tokens_equal"] in (None, True) for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
