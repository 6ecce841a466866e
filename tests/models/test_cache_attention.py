"""The XLA:CPU cache-attention kernel (jaxspec/models/cache_attention.py): same result as the XLA form, each query
row independent of the rest of the call, bad slot ids refused, and used exactly where it applies."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.engine.engine import Engine
from jaxspec.menu import Menu, StepKey
from jaxspec.models.cache_attention import MAX_HEAD_DIM, MAX_STEP_TOKENS, TARGET, cache_attention, head_dim_supported
from jaxspec.models.config import TINY
from jaxspec.models.kernel_plan import resolve_kernel_plan
from jaxspec.models.llama import attention
from tests.conftest import decode, needs_cpu_kernels, random_prompts

pytestmark = needs_cpu_kernels  # every test here runs the compiled kernels

S1, M = 5, 640  # cache slots (+ scratch) and positions


def _case(b: int, t: int, w: int, n: int, g: int, h: int, mask_kind: str, seed: int = 0):
    """q [B, T, N, H], caches [S+1, M, G, H], slot ids [B], mask [B, T, W] of the named kind."""
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((b, t, n, h), np.float32))
    k = jnp.asarray(rng.standard_normal((S1, M, g, h), np.float32))
    v = jnp.asarray(rng.standard_normal((S1, M, g, h), np.float32))
    slots = jnp.asarray(rng.permutation(S1)[:b], jnp.int32)
    if mask_kind == "causal":  # history up to a per-row start, then causal over the T new tokens
        start = rng.integers(0, w - t + 1, size=b)
        mask = np.arange(w)[None, None, :] <= start[:, None, None] + np.arange(t)[None, :, None]
    elif mask_kind == "arbitrary":  # a token tree's, with one query that sees nothing
        mask = rng.random((b, t, w)) < 0.5
        mask[0, 0] = False
    else:  # "gaps": arbitrary, with whole runs of 128 positions (the kernel's chunks) seen by no query of a row
        mask = rng.random((b, t, w)) < 0.5
        for row in range(b):
            for first in range(0, w, 128):
                if rng.random() < 0.5:
                    mask[row, :, first:first + 128] = False
        mask[0, 0] = False
    return q, k, v, slots, jnp.asarray(mask)


def _xla_form(q, k, v, slots, mask):
    w = mask.shape[2]
    return attention(q, k[slots, :w], v[slots, :w], mask)  # [B, T, N, H]


@pytest.mark.parametrize("b,t,w,n,g,h", [
    (1, 1, 64, 9, 3, 64),     # decode, SmolLM2's heads
    (3, 9, 96, 9, 3, 64),     # a verify of 8 proposals, three rows
    (2, 5, 48, 4, 4, 128),    # R = 1, Qwen-sized head dim
    (2, 3, 40, 6, 2, 24),     # a head dim the kernel takes at run time (16 + 8)
    (2, 4, 520, 9, 3, 64),    # a window of several chunks (128 positions) and a partial one
])
@pytest.mark.parametrize("mask_kind", ["causal", "arbitrary", "gaps"])
def test_kernel_equals_the_xla_form(b, t, w, n, g, h, mask_kind):
    args = _case(b, t, w, n, g, h, mask_kind)
    got = np.asarray(jax.jit(cache_attention)(*args))
    want = np.asarray(jax.jit(_xla_form)(*args))
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("w", [640, 200])
def test_each_query_row_is_independent_of_the_rest_of_the_call(w):
    """A row's output is bit for bit the same computed alone or in a batch of rows and tokens (what a
    query sees, not how the call is split, decides it). The W = 640 batch (~41k query-position pairs) is
    split over XLA's threads by chunks of positions, the W = 200 batch (~13k) and its first row alone
    into pieces of queries; single tokens stay on one thread, over up to three chunks."""
    q, k, v, slots, mask = _case(3, 9, w, 9, 3, 64, "causal", seed=3)
    together = np.asarray(jax.jit(cache_attention)(q, k, v, slots, mask))
    for row in range(3):
        one_row = jax.jit(cache_attention)(q[row:row + 1], k, v, slots[row:row + 1], mask[row:row + 1])
        np.testing.assert_array_equal(np.asarray(one_row)[0], together[row])
        for t in (0, 8):
            alone = jax.jit(cache_attention)(q[row:row + 1, t:t + 1], k, v, slots[row:row + 1],
                                             mask[row:row + 1, t:t + 1])
            np.testing.assert_array_equal(np.asarray(alone)[0, 0], together[row, t])


def _random_case(rng: np.random.Generator):
    """A random call: B rows of T ≤ MAX_STEP_TOKENS tokens over a window W of 1 to 3 chunks and a bit (mostly not
    a multiple of 8), G kv heads of R query heads each, a head dim the kernel takes, and one of the mask kinds."""
    b = int(rng.integers(1, 4))
    t = int(rng.choice([1, 2, int(rng.integers(3, MAX_STEP_TOKENS)), MAX_STEP_TOKENS]))
    w = int(rng.choice([1, t, int(rng.integers(1, 400))]))
    g, r = int(rng.integers(1, 5)), int(rng.integers(1, 4))
    h = int(rng.choice([8, 24, 64, 128]))
    mask_kind = "causal" if w >= t and rng.random() < 0.4 else str(rng.choice(["arbitrary", "gaps"]))
    return (b, t, w, g * r, g, h, mask_kind), _case(b, t, w, g * r, g, h, mask_kind, seed=int(rng.integers(1 << 30)))


def test_a_random_sweep_of_shapes_equals_the_xla_form():
    """Random shapes and masks (seeded): T up to the largest step the kernel serves, windows of 1 and of no
    multiple of 8, gaps of whole chunks, one to four kv heads; each call against the XLA form."""
    rng = np.random.default_rng(42)
    for _ in range(16):
        shape, args = _random_case(rng)
        got = np.asarray(jax.jit(cache_attention)(*args))
        want = np.asarray(jax.jit(_xla_form)(*args))
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6, err_msg=f"(B, T, W, N, G, H, mask) = {shape}")


def test_an_empty_window_gives_zeros():
    """W = 0: no position to attend, zeros as in the XLA form (a softmax over nothing, times no values)."""
    q, k, v, slots, _ = _case(2, 3, 8, 6, 2, 64, "arbitrary")
    mask = jnp.zeros((2, 3, 0), jnp.bool_)
    got = np.asarray(jax.jit(cache_attention)(q, k, v, slots, mask))
    np.testing.assert_array_equal(got, np.zeros((2, 3, 6, 64), np.float32))
    np.testing.assert_array_equal(np.asarray(_xla_form(q, k, v, slots, mask)), got)


@pytest.mark.parametrize("h", [12, 264])
def test_head_dims_the_kernel_does_not_take_are_refused(h):
    """Head dims that are not a multiple of 8, or above MAX_HEAD_DIM: an error naming the head dim, and the
    kernel plan keeps the XLA form for such a model."""
    q, k, v, slots, mask = _case(1, 1, 16, 2, 1, h, "causal")
    plan = resolve_kernel_plan(TINY.replace(head_dim=h), "cpu", "float32", 1, TINY.num_kv_heads, False)
    assert not head_dim_supported(h) and plan.attention == "xla" and f"not {h}" in plan.notes[0]
    with pytest.raises(Exception, match=f"head dim {h} is not a multiple of 8 in \\[8, {MAX_HEAD_DIM}\\]"):
        jax.block_until_ready(jax.jit(cache_attention)(q, k, v, slots, mask))
    assert head_dim_supported(MAX_HEAD_DIM) and head_dim_supported(8)


def test_a_slot_id_outside_the_cache_is_an_error():
    q, k, v, slots, mask = _case(1, 1, 32, 9, 3, 64, "causal")
    with pytest.raises(Exception, match=r"block table entry \[0, 0\] = 7 names no page of the pool \(pages 0..4"):
        jax.block_until_ready(jax.jit(cache_attention)(q, k, v, jnp.array([7], jnp.int32), mask))


def test_the_plan_takes_the_kernel_exactly_where_it_applies():
    def plan(**changes):
        args = dict(backend="cpu", dtype="float32", mesh_size=1, cache_kv_heads=3, tensor_parallel=False)
        return resolve_kernel_plan(TINY, **{**args, **changes})

    assert plan().attention == "cpu-cache-kernel"
    assert plan().attention_form(1) == plan().attention_form(MAX_STEP_TOKENS) == "cpu-cache-kernel"
    assert plan().attention_form(MAX_STEP_TOKENS + 1) == "xla"  # a prefill chunk: XLA's dot
    assert plan(dtype="bfloat16").attention == "xla" and "float32" in plan(dtype="bfloat16").notes[0]
    assert plan(mesh_size=2).attention == "xla"  # a cache split over devices keeps the XLA form
    assert plan(choice="xla").attention == "xla"
    assert plan(backend="tpu").attention == "xla"


def test_an_engine_with_the_kernel_decodes_as_one_with_the_xla_form(tiny_model):
    menu = Menu(num_slots=4, max_len=96, batch_buckets=(4,), k_menu=(0,), window_buckets=(96,), prefill_buckets=(32,))
    prompts = random_prompts((5, 30, 12, 21), TINY.vocab_size, seed=4)
    engine = Engine(tiny_model, None, menu)
    reference = Engine(tiny_model, None, menu, kernels="xla")
    engine.warmup(progress=False)
    reference.warmup(progress=False)
    attention = (engine.kernels.attention, reference.kernels.attention)
    assert attention == ("cpu-cache-kernel", "xla")  # their cost profiles differ
    step = StepKey(4, 0, 96)
    assert engine.compiled_text(step).count(TARGET) == TINY.num_layers  # one call per layer
    assert reference.compiled_text(step).count(TARGET) == 0
    with_kernel, _ = decode(engine, prompts, 0, 24)
    with_xla_form, _ = decode(reference, prompts, 0, 24)
    assert with_kernel == with_xla_form
