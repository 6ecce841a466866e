"""Shared benchmark helpers: machine description, bandwidth probe, engine decode timing."""

from __future__ import annotations

import datetime
import json
import os
import platform
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.engine.engine import Engine
from jaxspec.types import SamplingParams


def machine() -> str:
    """One line: date, CPU count, device, jax version."""
    cpu = platform.processor() or platform.machine()
    return (f"{datetime.date.today().isoformat()}, {os.cpu_count()} CPU cores ({cpu}), "
            f"device {jax.devices()[0].device_kind}, jax {jax.__version__}")


def write_json(path, data: dict) -> None:
    """Write a benchmark's result as indented JSON (its folder made), and say where."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1), encoding="utf-8")
    print(f"wrote {path}")


def measured_bandwidth_gbs(arrays, repeats: int = 10) -> float:
    """Read bandwidth (GB/s) of summing `arrays` once — the bytes a decode step must stream."""
    total = sum(a.size * a.dtype.itemsize for a in arrays)
    reduce_all = jax.jit(lambda xs: sum(jnp.sum(x) for x in xs))
    reduce_all(arrays).block_until_ready()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        reduce_all(arrays).block_until_ready()
        times.append(time.perf_counter() - t)
    return total / float(np.median(times)) / 1e9


def decode_tokens(engine: Engine, prompt: list[int], n_tokens: int, k: int, slot: int = 0,
                  params: SamplingParams = SamplingParams()) -> tuple[list[int], float, int]:
    """Prefill then step with fixed k until n_tokens; returns (tokens, decode seconds, steps).
    The decode time excludes prefill and the first token."""
    out = [engine.prefill(slot, prompt, params)]
    steps = 0
    t = time.perf_counter()
    while len(out) < n_tokens:
        room = n_tokens - len(out) - 1
        result = engine.step([slot], k, row_k=[min(k, max(room, 0))])
        out += result.row_tokens(0)
        steps += 1
    elapsed = time.perf_counter() - t
    engine.free(slot)
    return out[:n_tokens], elapsed, steps


def heldout_chat_setup(n_prompts: int, max_prompt_tokens: int = 112):
    """The held-out chat studies' start (feature_draft_study, feature_draft_agreement, tree_study): the compile
    cache on, the load average before, the default target, and n held-out ShareGPT prompts (never trained on).
    Returns (target, loaded, prompts, load_before)."""
    from jaxspec.engine.engine import enable_compilation_cache
    from jaxspec.training import distill_data as dd
    from jaxspec.training.trainer import load_target

    enable_compilation_cache()
    load_before = os.getloadavg()
    target, loaded = load_target(None)
    prompts = dd.chat_prompts(loaded.tokenizer, "heldout", n_prompts, max_prompt_tokens)
    return target, loaded, prompts, load_before
