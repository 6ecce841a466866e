"""The reference a compiled step is measured against: the bare matmul chain of the model's own weights.

`bare_chain(engine, t)` is a jitted function over the engine's placed serving weights
(`Engine.placed_weights()`) that does only the matmuls of one forward pass of t tokens per row at
B = 1, with the serving shapes: per layer x @ wqkv [D, E], (first N·H columns) @ wo [N·H, D],
@ w_gate_up [D, 2F], (first F columns) @ w_down [F, D], plus the residual adds, then the LM head
(embed [V, D] when tied, else lm_head [D, V]). No norms, RoPE, attention, cache, sampling or state:
it reads every serving weight once, which is what a decode step cannot avoid. Its matmuls are the
engine's own (column panels and the table head on XLA:CPU, `jaxspec.models.panel_matmul`); where they are panels
the table also times the chain with XLA's dot over plain copies of the weights.

`step_vs_bare(engine, ...)` times, in one process and one run, the engine's compiled step executable
alone (called the way `Engine.step` calls it, block_until_ready, no host bookkeeping) at every
(k, W) of its menu at B = 1 against the bare chain at T = k + 1, the two called alternately, and
returns rows with the ratio engine / bare. `window_growth(engine, rows)` sets what a larger window
adds against the time its extra K/V bytes take to read at the bandwidth the bare chain reaches.
It prefills slot 0 with a dummy prompt and resets the engine at the end: run it on a fresh engine
(`jaxspec profile --floor`, `benchmarks/decode_speed.py`), never a serving one.
"""

from __future__ import annotations

import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.menu import StepKey
from jaxspec.models.kv_cache import cache_bytes
from jaxspec.models.panel_matmul import PanelWeight, panel_matmul, table_matmul, unpack_panels
from jaxspec.types import SamplingParams


def load() -> str:
    """The 1-minute load average and core count, for recording next to every timing."""
    one, five, _ = os.getloadavg()
    return f"load {one:.2f} (5 min {five:.2f}) on {os.cpu_count()} cores"


def bare_chain(engine, t: int, xla_dot: bool = False):
    """(fn, args): fn(args) runs the bare matmul chain of t tokens at B = 1 over the engine's weights.

    The matmuls take the engine's own form: column panels and the table head (`jaxspec.models.panel_matmul`) where its
    weights are stored so, XLA's dot otherwise. `xla_dot`: XLA's dot over plain [K, N] copies of panel weights
    and the embedding instead (what the same chain costs without the kernels; a copy of every layer's weights)."""
    top, layers = engine.placed_weights()
    c = engine.model_config
    nh, f = c.num_heads * c.head_dim, c.intermediate_size

    def matrix(w, k: int):  # a serving weight as a [K, N] operand: panels as they are (or unpacked), else a bitcast
        if isinstance(w, PanelWeight):
            return unpack_panels(w).reshape(w.k_len, -1) if xla_dot else w
        return w.reshape(k, -1)

    def times(x, w):  # x [T, K] @ w -> [T, N]
        return panel_matmul(x, w).reshape(x.shape[0], -1) if isinstance(w, PanelWeight) else x @ w

    mats = tuple((matrix(p["wqkv"], c.hidden_size), matrix(p["wo"], nh), matrix(p["w_gate_up"], c.hidden_size),
                  matrix(p["w_down"], f)) for p in layers)
    head = top["embed"] if c.tie_embeddings else top["lm_head"]
    table_head = engine.kernels.table_head and not xla_dot

    def chain(x, mats, head):
        for wqkv, wo, w_gate_up, w_down in mats:  # x: [T, D]
            a = times(x, wqkv)[:, :nh]  # [T, N·H]
            x = x + times(a, wo)  # [T, D]
            g = times(x, w_gate_up)[:, :f]  # [T, F]
            x = x + times(g, w_down)  # [T, D]
        if table_head:
            return table_matmul(x, head)  # [T, V]
        return x @ head.T if c.tie_embeddings else x @ head  # [T, V]

    x = jnp.ones((t, c.hidden_size), jnp.dtype(c.dtype)) * 0.01
    return jax.jit(chain), (x, mats, head)


def uses_panels(engine) -> bool:
    """Whether the engine's layer weights are column panels (then `step_vs_bare` also times XLA's dot chain)."""
    return isinstance(engine.placed_weights()[1][0]["wqkv"], PanelWeight)


def interleaved_medians(calls, repeats: int, prepares=None) -> list[float]:
    """Median seconds of each call, the calls alternated repeat by repeat (drift hits them alike).
    `prepares`, one callable or None per call, runs untimed before every run of its call."""
    prepares = prepares or [None] * len(calls)
    for call, prepare in zip(calls, prepares, strict=True):
        if prepare:
            prepare()
        call()  # untimed first run
    times = [[] for _ in calls]
    for _ in range(repeats):
        for call, prepare, record in zip(calls, prepares, times, strict=True):
            if prepare:
                prepare()
            t0 = time.perf_counter()
            call()
            record.append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


def bare_call(engine, t: int, xla_dot: bool = False):
    """A no-argument call of the compiled bare chain at T = t (blocks until done)."""
    fn, args = bare_chain(engine, t, xla_dot)
    compiled = fn.lower(*args).compile()
    return lambda: compiled(*args).block_until_ready()


def step_call(engine, k: int, window: int):
    """A no-argument call of the engine's compiled (B=1, k, W) step executable alone (slot 0), as
    `Engine.step` calls it, without host bookkeeping (blocks until done)."""
    key, slots, caps = StepKey(1, k, window), np.zeros((1,), np.int32), np.full((1,), k, np.int32)
    return lambda: engine.run_step_executable(key, slots, caps).block_until_ready()


def hold_context(engine, length: int):
    """A no-argument call that sets slot 0's committed length back to `length` (untimed, before each step):
    with length = W - (k + 1) every step at window W attends its whole window. The cached-attention kernel
    (jaxspec/models/cache_attention.py) reads only the positions a row holds, so its cost follows the context;
    a full window is the most a step in that bucket can cost."""
    return lambda: engine.set_length(0, length)


def step_vs_bare(engine, repeats: int = 20, prompt_len: int = 8, reference=None) -> list[dict]:
    """Rows {k, W, T, engine_ms, bare_ms, ratio, load_before, load_after} for every (k, W) of the menu at B = 1.

    The engine's step and the bare chain at T = k + 1 are called alternately, `repeats` times each.
    Slot 0 is prefilled with `prompt_len` tokens, then held at W - (k + 1) committed tokens before every
    step, so each step attends its whole window (the XLA form costs the same at any length; the
    cached-attention kernel reads what the row holds). `reference`, an
    engine with the same menu (one built with `kernels='xla'`), is called in
    the same alternation and adds {reference_ms, reference_ratio} to each row.
    """
    engines = [engine] if reference is None else [engine, reference]
    for e in engines:
        e.warmup(progress=False)
        e.reset()
        e.prefill(0, [2 + i % 7 for i in range(prompt_len)], SamplingParams(temperature=0.0))
    bare = {k: bare_call(engine, k + 1) for k in engine.menu.k_menu}
    xla_bare = {k: bare_call(engine, k + 1, xla_dot=True) for k in engine.menu.k_menu} if uses_panels(engine) else {}
    rows = []
    for k in engine.menu.k_menu:
        for window in engine.menu.window_buckets:
            before = load()
            context = max(0, window - (k + 1))  # the step's queries see the whole window
            extra = [xla_bare[k]] if xla_bare else []
            times = interleaved_medians([bare[k]] + [step_call(e, k, window) for e in engines] + extra, repeats,
                                        prepares=[None] + [hold_context(e, context) for e in engines]
                                        + [None] * len(extra))
            bare_s, step_s = times[0], times[1]
            row = {"k": k, "W": window, "T": k + 1, "engine_ms": step_s * 1e3, "bare_ms": bare_s * 1e3,
                   "ratio": step_s / bare_s}
            if reference is not None:
                row.update(reference_ms=times[2] * 1e3, reference_ratio=times[2] / bare_s)
            if xla_bare:  # the same chain with XLA's dot
                row.update(xla_bare_ms=times[-1] * 1e3)
            rows.append(row | {"load_before": before, "load_after": load()})
    for e in engines:
        e.reset()
    return rows


def kv_window_mb(engine, window: int) -> float:
    """MB of keys and values a step at window W reads for one row (every layer): one slot's cache of W
    positions."""
    return cache_bytes(engine.model_config, num_slots=0, max_len=window) / 1e6


def window_growth(engine, rows: list[dict]) -> list[dict]:
    """Per k: the ms the step adds from the smallest to the largest window, against the time reading
    the added K/V bytes takes at the bandwidth the bare chain reaches at T = 1 (weight bytes / bare ms).
    `ratio` is added ms / bytes-time (1 = attention grows at the rate its bytes are read). Empty when the
    rows hold one window only."""
    if len({r["W"] for r in rows}) < 2:
        return []
    t1 = [r for r in rows if r["k"] == min(r["k"] for r in rows)]
    gb_per_s = weight_mb(engine) / 1e3 / (statistics.median(r["bare_ms"] for r in t1) / 1e3)
    out = []
    for k in sorted({r["k"] for r in rows}):
        by_w = sorted((r for r in rows if r["k"] == k), key=lambda r: r["W"])
        lo, hi = by_w[0], by_w[-1]
        added_mb = kv_window_mb(engine, hi["W"]) - kv_window_mb(engine, lo["W"])
        read_ms = added_mb / gb_per_s  # MB / (GB/s) = ms
        added_ms = hi["engine_ms"] - lo["engine_ms"]
        out.append({"k": k, "W_from": lo["W"], "W_to": hi["W"], "added_ms": added_ms, "added_kv_mb": added_mb,
                    "bandwidth_gb_s": gb_per_s, "read_ms": read_ms, "ratio": added_ms / read_ms})
    return out


def format_growth(growth: list[dict]) -> str:
    lines = [f"{'k':>3} {'W':>11} {'added ms':>9} {'added KV MB':>12} {'read ms':>8} {'ratio':>6}"]
    lines += [f"{g['k']:>3} {g['W_from']:>5}-{g['W_to']:<5} {g['added_ms']:>9.2f} {g['added_kv_mb']:>12.1f} "
              f"{g['read_ms']:>8.2f} {g['ratio']:>6.2f}" for g in growth]
    return "\n".join(lines)


def weight_mb(engine) -> float:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(engine.placed_weights())) / 1e6


def format_rows(rows: list[dict]) -> str:
    ref, xla = "reference_ms" in rows[0], "xla_bare_ms" in rows[0]
    lines = [f"{'k':>3} {'W':>5} {'T':>3} {'engine ms':>10} {'bare ms':>9} {'ratio':>6}"
             + (f" {'XLA-form ms':>12} {'ratio':>6}" if ref else "")
             + (f" {'bare XLA-dot ms':>16}" if xla else "") + "  load"]
    lines += [f"{r['k']:>3} {r['W']:>5} {r['T']:>3} {r['engine_ms']:>10.2f} {r['bare_ms']:>9.2f} {r['ratio']:>6.2f}"
              + (f" {r['reference_ms']:>12.2f} {r['reference_ratio']:>6.2f}" if ref else "")
              + (f" {r['xla_bare_ms']:>16.2f}" if xla else "")
              + f"  {r['load_before']} -> {r['load_after'].split(' (')[0]}" for r in rows]
    return "\n".join(lines)
