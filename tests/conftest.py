"""Shared fixtures: tiny models, reference greedy decoding, a persistent compile cache."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# 8 host devices for the mesh tests (tests/test_mesh.py); an engine uses only the devices its mesh names
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()


def private_cache_dir() -> str:
    """The suite's XLA compilation cache: ~/.cache/jaxspec/test-xla, created private (0700). Not a shared /tmp
    path: another user could create that name first and plant executables the tests would load."""
    path = os.path.join(os.path.expanduser("~"), ".cache", "jaxspec", "test-xla")
    os.makedirs(path, mode=0o700, exist_ok=True)
    return path


os.environ.setdefault("JAXSPEC_COMPILATION_CACHE", private_cache_dir())

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from jaxspec.engine.engine import Engine, enable_compilation_cache  # noqa: E402
from jaxspec.models import cache_attention, panel_matmul  # noqa: E402
from jaxspec.models.config import TINY  # noqa: E402
from jaxspec.models.llama import random_model  # noqa: E402
from jaxspec.types import SamplingParams  # noqa: E402

enable_compilation_cache()

# tests of the compiled XLA:CPU kernels and of what only they do: skipped (with the reason) in an install without
# them (no C++ compiler at install; .ci/check_no_compiler.sh); .ci/run checks its own install has them
needs_cpu_kernels = pytest.mark.skipif(
    not (cache_attention.kernel_available() and panel_matmul.kernel_available()),
    reason=f"the XLA:CPU kernels are not built: {cache_attention.kernel_unavailable_reason()}; "
           f"{panel_matmul.kernel_unavailable_reason()}")


def wait_until(predicate: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    """Poll `predicate` until it holds; AssertionError naming `what` after `timeout` seconds. Tests wait for
    a condition this way, never with a fixed sleep (a loaded machine makes any fixed sleep too short)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.01)


@pytest.fixture(scope="session")
def tiny_model():
    return random_model(TINY, seed=0)


def reference_greedy(model, prompt: list[int], n: int, width: int = 128) -> list[int]:
    """Plain greedy decoding with the cache-free causal forward (independent of the engine).

    Tokens are right-padded to a fixed `width` so one compiled forward serves every length.
    """
    forward = _jitted_forward(model)
    tokens = list(prompt)
    for _ in range(n):
        padded = np.zeros((1, width), np.int32)
        padded[0, : len(tokens)] = tokens
        logits = forward(padded)  # [1, width, V]
        tokens.append(int(np.argmax(np.asarray(logits[0, len(tokens) - 1]))))
    return tokens[len(prompt):]


_FORWARDS: dict[int, object] = {}


def _jitted_forward(model):
    if id(model) not in _FORWARDS:
        from flax import nnx
        graphdef, params = nnx.split(model)
        jitted = jax.jit(lambda p, t: nnx.merge(graphdef, p)(t))
        _FORWARDS[id(model)] = lambda tokens: jitted(params, tokens)
    return _FORWARDS[id(model)]


def random_prompts(lengths, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(2, vocab, size=n)] for n in lengths]


def decode(engine: Engine, prompts, k: int, n_new: int, params=None, slots=None) -> tuple[list[list[int]], float]:
    """Prefill each prompt into its slot and step with a fixed k until every row has n_new tokens
    (finished rows leave the batch). Returns the outputs and accepted / proposed."""
    slots = list(range(len(prompts))) if slots is None else list(slots)
    params = params or [SamplingParams()] * len(prompts)
    outputs = [[engine.prefill(s, p, q)] for s, p, q in zip(slots, prompts, params)]
    accepted, proposed = 0, 0
    while rows := [row for row, out in enumerate(outputs) if len(out) < n_new]:
        result = engine.step([slots[row] for row in rows], k)
        for i, row in enumerate(rows):
            outputs[row] += result.row_tokens(i)
        accepted += int(result.accepted.sum())
        proposed += int(result.proposed.sum())
    return [o[:n_new] for o in outputs], accepted / max(proposed, 1)


def assert_draft_caches_equal(lazy, eager, lengths) -> None:
    """Two draft KV caches hold the same entries, bit for bit, in slots 0.. (each up to its length in `lengths`)."""
    for s, n in enumerate(lengths):
        assert lazy.lengths[s] == eager.lengths[s] == n
        for a, b in zip(lazy.k + lazy.v, eager.k + eager.v):
            np.testing.assert_array_equal(a[s, :n], b[s, :n])
