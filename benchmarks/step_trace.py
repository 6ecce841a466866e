"""Where a compiled step's time goes, kernel by kernel, next to the bare chain of its own matmuls.

    PYTHONPATH=. python -m benchmarks.step_trace --k 0,4 --window 512 --out docs/results/step_trace.json
    python -m benchmarks.step_trace --model qwen2.5-1.5b --dtype bfloat16 --k 0,4 --calls 10   (on a GPU)

For each k: the default model's engine at B = 1 (prompt lookup for k > 0, one window bucket W = max_len),
its compiled (1, k, W) step executable (the slot held at W − (k + 1) tokens, so every step attends its
whole window) and the bare chain at T = k + 1 (`jaxspec/bench/floor.py`) are each run
`--calls` times under `jax.profiler` (a perfetto trace). Every traced kernel is matched by name to an
instruction of its program's optimised HLO and summed per (category, kernel kind, output shape):

    weight matmul  the panel and table matmul kernels (jaxspec/models/panel_matmul.py),
                   or a dot or dot fusion whose output is
                   [T, X] (or [X, T]) with X a serving weight's output width (fused qkv, D, fused gate/up, V):
                   what the bare chain also does
    attention      the cache-attention kernel (jaxspec/models/cache_attention.py), or in the XLA form the other dot
                   fusions and the window copies (dynamic slices of the cache)
    other          everything else (norms, RoPE, cache writes, residual adds, verify and state updates)

Device kernels that match no instruction by name or by their `hlo_op` argument (library kernels on a
GPU) are summed as `unmatched`. Every device kernel is also listed by its own name (`top_kernels`: the trace's
kernel names, cuBLAS and Pallas/Triton kernels included, with the HLO op each ran for, slowest first; on a
backend whose trace has no device timeline, the matched kernels). Each program's untraced wall time per call is
measured too: on a GPU,
kernel time well below the wall time means launches and the gaps between kernels are the cost.
The trace adds a little time to every kernel: compare the two programs' totals in the same run, not
their milliseconds with `decode_speed`. Record the load with the result (it is printed and saved).
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
import re
import sys
import tempfile
from pathlib import Path

import jax

from jaxspec.bench.common import machine
from jaxspec.bench.floor import bare_chain, hold_context, interleaved_medians, load, step_call
from jaxspec.engine.build import build_model, build_proposer
from jaxspec.engine.engine import Engine, enable_compilation_cache
from jaxspec.menu import Menu, StepKey
from jaxspec.models.cache_attention import TARGET as CACHE_ATTENTION
from jaxspec.models.panel_matmul import TABLE_TARGET as TABLE_MATMUL
from jaxspec.models.panel_matmul import TARGET as PANEL_MATMUL
from jaxspec.models.panel_matmul import PanelWeight
from jaxspec.types import SamplingParams

_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%(\S+) = (\S+) (\S+?)\(", re.M)
_FREE = {"parameter", "constant", "bitcast", "get-tuple-element", "tuple"}


def entry_kernels(hlo: str) -> dict[str, tuple[str, str]]:
    """name -> (opcode, output shape) of every instruction of the ENTRY computation that runs a kernel."""
    entry = hlo[hlo.index("\nENTRY"):]
    entry = entry[:entry.index("\n}")]
    return {name: (opcode, shape) for name, shape, opcode in _INSTRUCTION.findall(entry) if opcode not in _FREE}


def category(opcode: str, name: str, shape: str, t: int, weight_widths: set[int]) -> str:
    """weight matmul / attention / other (module docstring) for one kernel."""
    dims = [int(d) for d in re.findall(r"\d+", shape.split("{")[0].split("[", 1)[-1])]
    is_dot = opcode == "dot" or name.startswith(("ynn_fusion", "xnn_fusion", "dot", "copy_dot"))
    if is_dot and sorted(d for d in dims if d != 1) in (sorted(d for d in (t, x) if d != 1) for x in weight_widths):
        # [T, X], [X, T] (XLA transposed it) or [X] (T = 1 squeezed)
        return "weight matmul"
    if is_dot or "dynamic-slice" in name:
        return "attention"
    return "other"


def kernel_times(call, hlo: str, calls: int) -> tuple[dict[str, float], float, list[dict]]:
    """Milliseconds per call of every ENTRY kernel of `hlo`, from a profiler trace of `calls` calls, the
    milliseconds per call of device kernels the trace did not name after an instruction (on a GPU: library
    kernels such as cuBLAS gemms, matched through their `hlo_op` argument when the trace gives one), and every
    device kernel by its trace name (`top_kernels`)."""
    kernels = entry_kernels(hlo)
    totals: collections.Counter = collections.Counter()
    unmatched = 0.0
    by_name: dict[tuple[str, str], list[float]] = {}  # (trace name, hlo op) -> [ms, launches]
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            for _ in range(calls):
                call()
        trace_file = next(Path(trace_dir).rglob("*.trace.json.gz"))
        events = json.loads(gzip.open(trace_file).read())
    events = events["traceEvents"] if isinstance(events, dict) else events
    devices = {e.get("pid") for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
               and "/device:" in str((e.get("args") or {}).get("name", ""))}  # GPU/TPU timelines, not host threads
    for event in events:
        if event.get("ph") != "X":
            continue
        trace_name = name = event.get("name")
        if name not in kernels:
            name = (event.get("args") or {}).get("hlo_op", name)
        ms = event.get("dur", 0) / 1e3  # µs -> ms
        if name in kernels:
            totals[name] += ms
        elif event.get("pid") in devices:
            unmatched += ms
        listed = event.get("pid") in devices if devices else name in kernels  # a device timeline's, else HLO's
        if listed:
            entry = by_name.setdefault((trace_name, name if name in kernels else ""), [0.0, 0])
            entry[0] += ms
            entry[1] += 1
    top = [{"name": trace_name, "hlo_op": op, "ms": ms / calls, "launches": n / calls}
           for (trace_name, op), (ms, n) in sorted(by_name.items(), key=lambda item: -item[1][0])]
    return {name: ms / calls for name, ms in totals.items()}, unmatched / calls, top


def breakdown(per_kernel: dict[str, float], hlo: str, t: int, weight_widths: set[int]) -> list[dict]:
    """Rows {category, kind, shape, ms, count} per (category, kernel kind, output shape), slowest first."""
    kernels = entry_kernels(hlo)
    in_place = set(re.findall(r'%(\S+) = [^\n]*custom_call_target="' + CACHE_ATTENTION + '"', hlo))
    panels = set(re.findall(r'%(\S+) = [^\n]*custom_call_target="' + PANEL_MATMUL + '"', hlo))
    tables = set(re.findall(r'%(\S+) = [^\n]*custom_call_target="' + TABLE_MATMUL + '"', hlo))
    rows: dict[tuple, dict] = {}
    for name, ms in per_kernel.items():
        opcode, shape = kernels[name]
        if name in in_place:
            kind, group = "cache attention kernel", "attention"
        elif name in panels:
            kind, group = "panel matmul kernel", "weight matmul"
        elif name in tables:
            kind, group = "table matmul kernel (LM head)", "weight matmul"
        else:
            kind, group = re.sub(r"\.\d+$", "", name), category(opcode, name, shape, t, weight_widths)
        key = (group, kind, shape)
        row = rows.setdefault(key, {"category": key[0], "kind": kind, "shape": shape, "ms": 0.0, "count": 0})
        row["ms"] += ms
        row["count"] += 1
    return sorted(rows.values(), key=lambda r: -r["ms"])


def summary(rows: list[dict], unmatched_ms: float = 0.0) -> dict[str, float]:
    out = collections.Counter()
    for r in rows:
        out[r["category"]] += r["ms"]
    parts = {c: round(out[c], 3) for c in ("weight matmul", "attention", "other")}
    return {**parts, "unmatched": round(unmatched_ms, 3), "total": round(sum(out.values()) + unmatched_ms, 3)}


def trace_step(model, k: int, window: int, calls: int, kernels: str = "auto", top_kernels: int = 40) -> dict:
    """The step of `model` at (1, k, W) and the bare chain at T = k + 1, each traced and broken down
    (`kernels`: the engine's kernel choice, 'auto' or 'xla'; `top_kernels`: device kernels kept by name)."""
    proposer = build_proposer("ngram", model, kernels=kernels) if k > 0 else None
    engine = Engine(model, proposer, Menu(num_slots=1, max_len=window, batch_buckets=(1,), k_menu=(k,),
                                          window_buckets=(window,), prefill_buckets=(min(64, window),)),
                    kernels=kernels)
    engine.warmup(progress=False)
    engine.prefill(0, [2 + i % 7 for i in range(8)], SamplingParams(temperature=0.0))
    c = engine.model_config
    wqkv = engine.placed_weights()[1][0]["wqkv"]
    widths = {wqkv.n_len if isinstance(wqkv, PanelWeight) else wqkv.size // c.hidden_size, c.hidden_size,
              2 * c.intermediate_size, c.vocab_size}
    run_step, hold = step_call(engine, k, window), hold_context(engine, window - (k + 1))

    def step():  # every step attends its whole window
        hold()
        run_step()

    fn, args = bare_chain(engine, k + 1)
    bare_compiled = fn.lower(*args).compile()

    def bare():
        bare_compiled(*args).block_until_ready()

    for _ in range(3):  # past first runs
        step()
        bare()
    out = {"k": k, "W": window, "T": k + 1, "kernel_plan": engine.kernels.to_json(), "load_before": load()}
    for label, call, hlo in (("engine", step, engine.compiled_text(StepKey(1, k, window))),
                             ("bare", bare, bare_compiled.as_text())):
        per_kernel, unmatched, top = kernel_times(call, hlo, calls)
        rows = breakdown(per_kernel, hlo, k + 1, widths)
        out[label] = {"summary": summary(rows, unmatched), "kernels": rows, "top_kernels": top[:top_kernels],
                      "device_kernels_per_call": sum(t["launches"] for t in top)}
    # the calls' wall time, untraced, alternated: kernel time far below it means launches and gaps dominate
    out["engine_wall_ms"], out["bare_wall_ms"] = (1e3 * s for s in interleaved_medians([run_step, bare], calls,
                                                                                      prepares=[hold, None]))
    out["load_after"] = load()
    return out


def format_result(r: dict, top: int = 12) -> str:
    lines = [f"k = {r['k']}, W = {r['W']} (T = {r['T']}); {r['load_before']} -> {r['load_after'].split(' (')[0]}",
             f"{'':8} {'weight matmul':>14} {'attention':>10} {'other':>8} {'unmatched':>10} {'total':>8} "
             f"{'wall':>8}  (ms per call; wall untraced)"]
    for label in ("engine", "bare"):
        s = r[label]["summary"]
        lines.append(f"{label:8} {s['weight matmul']:>14.2f} {s['attention']:>10.2f} {s['other']:>8.2f} "
                     f"{s['unmatched']:>10.2f} {s['total']:>8.2f} {r[label + '_wall_ms']:>8.2f}")
    lines.append(f"engine kernels, slowest {top}:")
    lines += [f"  {x['ms']:7.3f} ms  {x['count']:4d}x  {x['category']:<14} {x['kind']:<32} {x['shape']}"
              for x in r["engine"]["kernels"][:top]]
    lines.append(f"engine device kernels by name ({r['engine']['device_kernels_per_call']:.0f} launches per call), "
                 f"slowest {top}:")
    lines += [f"  {x['ms']:7.3f} ms  {x['launches']:6.1f}x  {x['name'][:70]}  {x['hlo_op']}"
              for x in r["engine"]["top_kernels"][:top]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=lambda s: [int(x) for x in s.split(",")], default=[0, 4],
                        help="speculation lengths, comma-separated (k > 0 uses prompt lookup)")
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--calls", type=int, default=20, help="traced calls of each program")
    parser.add_argument("--model", default=None,
                        help="model spec or random-weights preset (default: the embedded SmolLM2-135M)")
    parser.add_argument("--dtype", default="float32", help="weight dtype (float32 on CPU; bfloat16 on GPU/TPU)")
    parser.add_argument("--kernels", default="auto", choices=("auto", "xla"),
                        help="the engine's kernel plan choice (docs/design.md, 'The kernel plan')")
    parser.add_argument("--top-kernels", type=int, default=40, help="device kernels kept by name per program")
    parser.add_argument("--out", type=Path, default=None, help="JSON file for the results")
    args = parser.parse_args(argv)
    enable_compilation_cache()
    built = build_model(args.model, dtype=args.dtype, kernels=args.kernels)
    results = []
    for k in args.k:
        results.append(trace_step(built.model, k, args.window, args.calls, args.kernels, args.top_kernels))
        print(format_result(results[-1]), flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"command": "python -m benchmarks.step_trace " + " ".join(
                                            argv if argv is not None else sys.argv[1:]),
                                        "machine": machine(), "model": built.name, "dtype": args.dtype,
                                        "kernels": args.kernels, "xla_flags": os.environ.get("XLA_FLAGS", ""),
                                        "devices": [str(d) for d in jax.devices()], "calls": args.calls,
                                        "results": results}, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
