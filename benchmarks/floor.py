"""The reference a compiled step is measured against: the bare matmul chain of the model's own weights.

`bare_chain(engine, t)` is a jitted function over the engine's placed serving weights
(`Engine.placed_weights()`) that does only the matmuls of one forward pass of t tokens per row at
B = 1, with the serving shapes: per layer x @ wqkv [D, E], (first N·H columns) @ wo [N·H, D],
@ w_gate_up [D, 2F], (first F columns) @ w_down [F, D], plus the residual adds, then the LM head
(embed [V, D] when tied, else lm_head [D, V]). No norms, RoPE, attention, cache, sampling or state:
it reads every serving weight once, which is what a decode step cannot avoid.

`step_vs_bare(engine, ...)` times, in one process and one run, the engine's compiled step executable
alone (called the way `Engine.step` calls it, block_until_ready, no host bookkeeping) at every
(k, W) of its menu at B = 1 against the bare chain at T = k + 1, and returns rows with the ratio
engine / bare. It prefills slot 0 with a dummy prompt and resets the engine at the end: run it on a
fresh engine, never a serving one.
"""

from __future__ import annotations

import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.menu import StepKey
from jaxspec.types import SamplingParams


def load() -> str:
    """The 1-minute load average and core count, for recording next to every timing."""
    one, five, _ = os.getloadavg()
    return f"load {one:.2f} (5 min {five:.2f}) on {os.cpu_count()} cores"


def bare_chain(engine, t: int):
    """(fn, args): fn(args) runs the bare matmul chain of t tokens at B = 1 over the engine's weights."""
    top, layers = engine.placed_weights()
    c = engine.model_config
    nh, f = c.num_heads * c.head_dim, c.intermediate_size
    # the serving arrays reshaped to 2-D matrices (row-major bitcasts, no copies)
    mats = tuple((p["wqkv"].reshape(c.hidden_size, -1), p["wo"].reshape(nh, c.hidden_size),
                  p["w_gate_up"].reshape(c.hidden_size, -1), p["w_down"]) for p in layers)
    head = top["embed"] if c.tie_embeddings else top["lm_head"]

    def chain(x, mats, head):
        for wqkv, wo, w_gate_up, w_down in mats:  # x: [T, D]
            a = (x @ wqkv)[:, :nh]  # [T, N·H]
            x = x + a @ wo  # [T, D]
            g = (x @ w_gate_up)[:, :f]  # [T, F]
            x = x + g @ w_down  # [T, D]
        return x @ head.T if c.tie_embeddings else x @ head  # [T, V]

    x = jnp.ones((t, c.hidden_size), jnp.dtype(c.dtype)) * 0.01
    return jax.jit(chain), (x, mats, head)


def _median_s(call, repeats: int) -> float:
    call()  # untimed first run
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def time_bare(engine, t: int, repeats: int = 20) -> float:
    fn, args = bare_chain(engine, t)
    fn(*args).block_until_ready()  # compile
    return _median_s(lambda: fn(*args).block_until_ready(), repeats)


def time_step(engine, k: int, window: int, repeats: int = 20) -> float:
    """Median seconds of the engine's compiled (B=1, k, W) step executable alone (slot 0)."""
    fn = engine._executable(StepKey(1, k, window))
    slots = np.zeros((1,), np.int32)
    caps = np.full((1,), k, np.int32)

    def call():
        engine.state, packed = fn(engine._params, engine._proposer_params, engine.state, slots, caps)
        packed.block_until_ready()

    return _median_s(call, repeats)


def step_vs_bare(engine, repeats: int = 20, prompt_len: int = 8) -> list[dict]:
    """Rows {k, W, T, engine_ms, bare_ms, ratio, load_before, load_after} for every (k, W) of the menu at B = 1.

    The slot is prefilled with `prompt_len` tokens; cost depends only on the static shape, and
    writes past max_len are dropped, so the length the steps reach does not matter.
    """
    engine.warmup(progress=False)
    engine.reset()
    engine.prefill(0, [2 + i % 7 for i in range(prompt_len)], SamplingParams(temperature=0.0))
    rows = []
    for k in engine.menu.k_menu:
        for window in engine.menu.window_buckets:
            before = load()
            step_s = time_step(engine, k, window, repeats)
            bare_s = time_bare(engine, k + 1, repeats)  # right after the step: drift hits both alike
            rows.append({"k": k, "W": window, "T": k + 1, "engine_ms": step_s * 1e3, "bare_ms": bare_s * 1e3,
                         "ratio": step_s / bare_s, "load_before": before, "load_after": load()})
    engine.reset()
    return rows


def weight_mb(engine) -> float:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(engine.placed_weights())) / 1e6


def format_rows(rows: list[dict]) -> str:
    lines = [f"{'k':>3} {'W':>5} {'T':>3} {'engine ms':>10} {'bare ms':>9} {'ratio':>6}  load"]
    lines += [f"{r['k']:>3} {r['W']:>5} {r['T']:>3} {r['engine_ms']:>10.2f} {r['bare_ms']:>9.2f} {r['ratio']:>6.2f}  "
              f"{r['load_before']} -> {r['load_after'].split(' (')[0]}" for r in rows]
    return "\n".join(lines)
