"""What reading a slot's K/V window costs on this device: attention over a window that is a whole array,
against the same window sliced out of a per-slot cache buffer (the engine's layout).

    PYTHONPATH=. python -m benchmarks.window_copy

30 layers of one decode step's attention arithmetic at SmolLM2-135M's shapes (X = 9 query rows, E = G·H =
192), softmax(q·kᵀ)·v, for W in 512 and 2048, jitted, medians of `--repeats` calls:

    whole        k and v of exactly [W, E] per layer (jit arguments): the read the step cannot avoid
    prefix       the first W rows of a [M, E] buffer (a static slice)
    slot         slot 0's first W rows of a [2, M, E] buffer (a static slice: the engine's layout)
    dynamic      the same with the slot a traced index (what the engine runs)

On XLA:CPU every operand of a dot is a materialised buffer, so a slice of a larger buffer is copied first;
the table shows what that copy costs next to the read itself. Record the load with the result.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.bench.floor import load

L, M, E, X = 30, 2048, 192, 9


def _attend(k: jax.Array, v: jax.Array, q: jax.Array) -> jax.Array:
    """q [X, E], k and v [W, E] -> [X, E]."""
    return jax.nn.softmax(q @ k.T, axis=-1) @ v  # [X, W] @ [W, E]


def _median_ms(fn, args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((X, E), np.float32))
    slot = jnp.asarray(0, jnp.int32)
    print(f"{load()}")
    print(f"{'W':>5} {'whole':>8} {'prefix':>8} {'slot':>8} {'dynamic':>8}  (ms, {L} layers)")
    for w in (512, 2048):
        whole = tuple(jnp.asarray(rng.standard_normal((w, E), np.float32)) for _ in range(2 * L))
        flat = tuple(jnp.asarray(rng.standard_normal((M, E), np.float32)) for _ in range(2 * L))
        slots = tuple(jnp.asarray(rng.standard_normal((2, M, E), np.float32)) for _ in range(2 * L))
        cases = {
            "whole": (lambda cs, q, s: sum(_attend(cs[2 * i], cs[2 * i + 1], q) for i in range(L)), whole),
            "prefix": (lambda cs, q, s: sum(_attend(cs[2 * i][:w], cs[2 * i + 1][:w], q) for i in range(L)), flat),
            "slot": (lambda cs, q, s: sum(_attend(cs[2 * i][0, :w], cs[2 * i + 1][0, :w], q) for i in range(L)),
                     slots),
            "dynamic": (lambda cs, q, s: sum(_attend(jax.lax.dynamic_index_in_dim(cs[2 * i], s, 0, False)[:w],
                                                     jax.lax.dynamic_index_in_dim(cs[2 * i + 1], s, 0, False)[:w], q)
                                             for i in range(L)), slots),
        }
        row = {name: _median_ms(jax.jit(fn), (cs, q, slot), args.repeats) for name, (fn, cs) in cases.items()}
        print(f"{w:>5} " + " ".join(f"{row[name]:>8.2f}" for name in cases))
    print(f"{load()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
