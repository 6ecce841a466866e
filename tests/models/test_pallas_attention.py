"""The Pallas attention kernel (jaxspec/models/pallas_attention.py), run in Pallas' interpreter on this CPU: the same
result as the XLA form over paged caches with shuffled block tables, chains and trees, GQA and windows that
are not a multiple of the page, with NaN wherever a row may see nothing (unused pages, positions past the end);
an off-by-one mask caught; the kernel lowering to one Triton call for CUDA (Triton's own compile to PTX needs a
GPU, unproven here); its limits.

Tolerances (kernel vs the XLA form, on queries that see at least one position):
  float32: atol = rtol = 1e-5. Both accumulate in f32 and differ only in summation order and in exp2 with a
    folded scale vs exp; measured ≤ 4e-7 on outputs of magnitude ≤ 3.
  bfloat16: atol = rtol = 2^-5. Both round the probabilities to bf16 (relative step 2^-8) before the product
    with v, the XLA form after normalising, the kernel before (relative to its running max), so each term may
    differ by one bf16 step: ≤ 2^-8 · max|v| ≈ 0.017 for |v| ≤ 4.5 (standard normal draws), plus one bf16
    rounding of the output (2^-8 · |out| ≤ 0.012). Measured ≤ 0.0157 (two bf16 steps at |out| in [2, 4)).
An off-by-one in the mask moved outputs by ≥ 2 in the negative control, far above both.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.models.llama import attention, block_window_mask
from jaxspec.models.pallas_attention import (
    KernelBlocks,
    WindowMask,
    as_pages,
    attention_limits,
    paged_attention,
    paged_attention_reference,
    slot_attention,
    slot_block_table,
)

TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 2.0 ** -5}
# jitted once per module: one compile per shape (interpret mode compiles the kernel's grid as an XLA loop),
# shared by tests that use the same shapes
_kernel = jax.jit(paged_attention, static_argnames=("blocks", "interpret"))
_reference = jax.jit(paged_attention_reference)


def _tree_mask(rng: np.random.Generator, nodes: int) -> np.ndarray:
    """Ancestor-or-self mask [nodes, nodes] of a random tree whose node 0 is the root and each parent
    precedes its child."""
    anc = np.eye(nodes, dtype=bool)
    for i in range(1, nodes):
        anc[i] |= anc[rng.integers(0, i)]
    return anc


def _block_masks(rng, b: int, t: int, u: int, kind: str) -> np.ndarray:
    """[B, T, U]: `mixed` (U = T; even rows a chain, lower-triangular, odd rows the ancestor-or-self mask of a
    random tree) or `level` (U > T: a draft tree's level call, the last T of U nodes against all U)."""
    if kind == "mixed":
        return np.stack([np.tril(np.ones((t, t), bool)) if row % 2 == 0 else _tree_mask(rng, t) for row in range(b)])
    return np.stack([_tree_mask(rng, u)[u - t:] for _ in range(b)])


def _dense(mask: WindowMask) -> np.ndarray:
    """[B, T, W] bool, written out in numpy: query t of row b sees position j < start (history) or
    start <= j < start + U with block_mask[b, t, j - start]."""
    block_mask, start = np.asarray(mask.block_mask), np.asarray(mask.block_start)
    b, t, u = block_mask.shape
    dense = np.zeros((b, t, mask.window), bool)
    for row in range(b):
        for j in range(mask.window):
            rel = j - start[row]
            dense[row, :, j] = True if rel < 0 else (block_mask[row, :, rel] if rel < u else False)
    return dense


def _paged_case(b, t, n, g, h, window, page, kind, dtype, seed, u=None):
    """q [B, T, N, H]; clean and poisoned k, v pages [pages, P, G, H] with a shuffled block table
    [B, ceil(W/P)]; a WindowMask with per-row starts far apart. Poisoned: NaN in the pages no row uses and in
    every position at or past the end of what a row may see (block start + U, or W), whatever the kernel reads
    there must add exact zeros."""
    rng = np.random.default_rng(seed)
    u = t if u is None else u
    window_pages = -(-window // page)
    num_pages = b * window_pages + 3
    table = rng.permutation(num_pages)[:b * window_pages].reshape(b, window_pages)
    k = rng.standard_normal((num_pages, page, g, h), np.float32)
    v = rng.standard_normal((num_pages, page, g, h), np.float32)
    # starts: row 0 at the window's start, the others anywhere (some blocks run past the window's end)
    start = rng.integers(0, window, size=b)
    start[0] = 0
    k_poisoned, v_poisoned = np.full_like(k, np.nan), np.full_like(v, np.nan)
    for row in range(b):
        end = min(start[row] + u, window)  # positions [0, end) of the row may be seen
        for position in range(end):
            where = table[row, position // page], position % page
            k_poisoned[where], v_poisoned[where] = k[where], v[where]
    mask = WindowMask(jnp.asarray(_block_masks(rng, b, t, u, kind)), jnp.asarray(start, jnp.int32), window)
    q = rng.standard_normal((b, t, n, h), np.float32)
    arr = lambda x: jnp.asarray(x, dtype)  # noqa: E731
    return arr(q), (arr(k), arr(v)), (arr(k_poisoned), arr(v_poisoned)), jnp.asarray(table, jnp.int32), mask


def _assert_close(out, ref, mask: WindowMask, dtype):
    """Compare queries that see some position; a query that sees none must be exactly zero in the kernel."""
    sees = _dense(mask).any(axis=-1)  # [B, T]
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert np.isfinite(out).all()
    tol = TOLERANCE[dtype]
    np.testing.assert_allclose(out[sees], ref[sees], atol=tol, rtol=tol)
    np.testing.assert_array_equal(out[~sees], 0.0)


# (B, T, N, G, H, W, P, mask kind, dtype, blocks or None for the default tiling)
CASES = [
    (1, 1, 4, 4, 16, 1, 16, "mixed", jnp.float32, None),  # a first decode step: W = 1, R = 1
    (3, 1, 6, 2, 32, 23, 8, "mixed", jnp.bfloat16, None),  # decode, R = 3, W not a multiple of the page
    (3, 2, 9, 3, 16, 40, 16, "mixed", jnp.float32, KernelBlocks(16, 1, 2)),  # T = 2, the window split in 2
    (3, 5, 8, 2, 32, 37, 16, "mixed", jnp.bfloat16, KernelBlocks(16, 2, 1)),  # T = 5, R = 4, 2 row blocks
    (4, 9, 6, 2, 16, 50, 8, "mixed", jnp.float32, KernelBlocks(32, 4, 2)),  # T = 9, R = 3, blocks of 4 pages
    (2, 5, 4, 1, 16, 45, 16, "level", jnp.bfloat16, None),  # a level call: T = 5 queries, U = 40, 1 kv head
]
@pytest.mark.parametrize("b,t,n,g,h,window,page,kind,dtype,blocks", CASES)
def test_kernel_equals_the_xla_form(b, t, n, g, h, window, page, kind, dtype, blocks):
    u = 40 if kind == "level" else None
    q, clean, poisoned, table, mask = _paged_case(b, t, n, g, h, window, page, kind, dtype, seed=window, u=u)
    out = _kernel(q, *poisoned, table, mask, blocks=blocks, interpret=True)  # [B, T, N, H]
    ref = _reference(q, *clean, table, mask)
    assert out.shape == q.shape and out.dtype == q.dtype
    _assert_close(out, ref, mask, dtype)


def test_slot_attention_equals_the_models_xla_form():
    """The per-slot cache through the identity block table equals `jaxspec.models.llama.attention` over
    cache[slot_ids, :W] with `block_window_mask`: the form `forward_cached` uses today (in bf16, the GPU's)."""
    dtype = jnp.bfloat16
    rng = np.random.default_rng(3)
    b, t, n, g, h, slots, max_len, window = 3, 3, 6, 2, 16, 5, 64, 30
    q = jnp.asarray(rng.standard_normal((b, t, n, h)), dtype)
    ck = jnp.asarray(rng.standard_normal((slots, max_len, g, h)), dtype)
    cv = jnp.asarray(rng.standard_normal((slots, max_len, g, h)), dtype)
    slot_ids = jnp.asarray([4, 0, 2], jnp.int32)
    mask = WindowMask(jnp.asarray(_block_masks(rng, b, t, t, "mixed")), jnp.asarray([0, 11, 27], jnp.int32), window)
    dense = block_window_mask(mask.block_mask, mask.block_start, window)  # [B, T, W]
    np.testing.assert_array_equal(np.asarray(mask.dense()), np.asarray(dense))
    np.testing.assert_array_equal(_dense(mask), np.asarray(dense))
    ref = attention(q, ck[slot_ids, :window], cv[slot_ids, :window], dense)
    table = slot_block_table(slot_ids, max_len, window, 16)
    # the reference wrapper is the model's XLA form, operation for operation
    np.testing.assert_array_equal(np.asarray(paged_attention_reference(q, as_pages(ck, 16), as_pages(cv, 16),
                                                                       table, mask)), np.asarray(ref))
    out = jax.jit(lambda *a: slot_attention(*a, interpret=True))(q, ck, cv, slot_ids, mask)
    _assert_close(out, ref, mask, dtype)


@pytest.mark.parametrize("case", [CASES[2], CASES[3]], ids=["float32", "bfloat16"])
def test_an_off_by_one_mask_fails_the_comparison(case):
    """Negative control: the reference with a mask off by one (a query misses its own position: row t sees
    positions < len + t instead of < len + t + 1; or the history is one position longer) differs from the
    kernel beyond the tolerance, while the right mask passes."""
    b, t, n, g, h, window, page, kind, dtype, blocks = case
    q, clean, _, table, mask = _paged_case(b, t, n, g, h, window, page, kind, dtype, seed=11)
    mask = WindowMask(mask.block_mask, jnp.maximum(mask.block_start, 1), window)  # every query sees history
    out = _kernel(q, *clean, table, mask, blocks=blocks, interpret=True)
    _assert_close(out, _reference(q, *clean, table, mask), mask, dtype)
    no_self = WindowMask(mask.block_mask & ~jnp.eye(t, dtype=bool), mask.block_start, window)
    longer_history = WindowMask(mask.block_mask, mask.block_start + 1, window)
    for wrong in (no_self, longer_history):
        with pytest.raises(AssertionError):
            _assert_close(out, _reference(q, *clean, table, wrong), mask, dtype)


def test_a_query_that_sees_nothing_gets_zeros():
    """A query with no visible position (here: block start 0 and an empty mask row) gets exact zeros."""
    b, t, n, g, h, window, page, kind, dtype, blocks = CASES[2]
    q, clean, _, table, mask = _paged_case(b, t, n, g, h, window, page, kind, dtype, seed=5)
    block_mask = np.array(mask.block_mask)
    block_mask[0] = [[False, False], [True, True]]  # row 0 (start 0): query 0 sees nothing, query 1 both
    mask = WindowMask(jnp.asarray(block_mask), mask.block_start, window)
    assert not _dense(mask)[0, 0].any()
    out = _kernel(q, *clean, table, mask, blocks=blocks, interpret=True)
    _assert_close(out, _reference(q, *clean, table, mask), mask, dtype)  # zeros where blind, the rest as usual


@pytest.mark.parametrize("t,u,dtype", [(1, 1, jnp.bfloat16), (9, 9, jnp.bfloat16), (64, 64, jnp.float32)])
def test_lowers_to_one_triton_kernel_for_cuda(t, u, dtype):
    """Lowered for CUDA on this CPU (jax.export): the Pallas -> Triton lowering accepts the kernel (power-of-two
    tensors, the ops it uses), the step's attention is one Triton call, and nothing gathers the window."""
    b, n, g, h, slots, max_len, window = 4, 12, 2, 128, 9, 1024, 512  # Qwen2.5-1.5B's heads

    def step(q, ck, cv, slot_ids, block_mask, block_start):
        return slot_attention(q, ck, cv, slot_ids, WindowMask(block_mask, block_start, window))

    shape = jax.ShapeDtypeStruct
    exported = jax.export.export(
        jax.jit(step), platforms=("cuda",),
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
    )(shape((b, t, n, h), dtype), shape((slots, max_len, g, h), dtype), shape((slots, max_len, g, h), dtype),
      shape((b,), jnp.int32), shape((b, t, u), jnp.bool_), shape((b,), jnp.int32))
    module = exported.mlir_module()
    assert module.count("stablehlo.custom_call") == 1 and module.count("@__gpu$xla.gpu.triton") == 1
    assert "stablehlo.gather" not in module


def test_limits_refuse_with_a_reason():
    ok = dict(platform="gpu", dtype=jnp.bfloat16, head_dim=128, num_heads=12, num_kv_heads=2, block_tokens=9,
              page_size=16, max_len=1024)
    assert attention_limits(**ok) is None
    refusals = {"platform": "tpu", "dtype": jnp.float16, "head_dim": 96, "num_kv_heads": 5, "block_tokens": 129,
                "page_size": 24, "max_len": 1000, "cache_elements": 2 ** 31}
    for key, value in refusals.items():
        reason = attention_limits(**{**ok, key: value})
        assert isinstance(reason, str) and reason, key
    q = jnp.zeros((1, 1, 2, 96), jnp.float32)  # head_dim 96: refused when called, not silently run
    pages = jnp.zeros((4, 16, 1, 96), jnp.float32)
    mask = WindowMask(jnp.ones((1, 1, 1), bool), jnp.zeros((1,), jnp.int32), 16)
    with pytest.raises(ValueError, match="head_dim 96"):
        paged_attention(q, pages, pages, jnp.zeros((1, 1), jnp.int32), mask, interpret=True)


def test_the_plan_takes_the_kernel_on_gpu_only():
    from jaxspec.models.config import QWEN25_15B
    from jaxspec.models.kernel_plan import resolve_kernel_plan

    def plan(backend, **changes):
        args = dict(dtype="bfloat16", mesh_size=1, cache_kv_heads=QWEN25_15B.num_kv_heads, tensor_parallel=False,
                    max_len=2048)
        return resolve_kernel_plan(QWEN25_15B, backend, **{**args, **changes})

    assert plan("gpu").attention == "pallas" and plan("gpu").attention_form(9) == "pallas"
    assert plan("gpu").attention_form(65) == "xla"  # a prefill chunk
    assert plan("gpu", max_len=2040).attention == "xla" and "page size" in plan("gpu", max_len=2040).notes[0]
    assert plan("gpu", choice="xla").attention == "xla"
    assert plan("tpu").attention == "xla" and plan("cpu", dtype="bfloat16").attention == "xla"


def test_forward_cached_with_the_kernel_equals_the_xla_form():
    """The tiny model's cached forward traced with the Pallas plan (interpret mode) against the XLA plan: a
    prompt chunk (XLA form in both: T past the kernel's rows), then a chain step and a tree step, reading
    every layer's cache through the kernel."""
    from jaxspec.models.config import TINY
    from jaxspec.models.kernel_plan import XLA_PLAN, KernelPlan
    from jaxspec.models.kv_cache import init_cache
    from jaxspec.models.llama import StepInputs, chain_inputs, random_model

    config = TINY.replace(head_dim=16)  # the kernel's smallest head dim
    model = random_model(config, seed=5)
    pallas = KernelPlan(attention="pallas", attention_max_rows=8, interpret=True)
    slots = jnp.array([0, 2], jnp.int32)
    prompt = jnp.asarray(np.random.default_rng(1).integers(2, config.vocab_size, (2, 12)), jnp.int32)
    results = {}
    for name, plan in (("xla", XLA_PLAN), ("pallas", pallas)):
        cache = init_cache(config, 3, 64)
        _, cache = model.forward_cached(chain_inputs(prompt, slots, jnp.zeros(2, jnp.int32)), cache, 32, kernels=plan)
        chain, cache = model.forward_cached(chain_inputs(prompt[:, :3], slots, jnp.full(2, 12)), cache, 32,
                                            kernels=plan)  # [2, 3, V]
        tree_mask = jnp.asarray(_tree_mask(np.random.default_rng(2), 4))[None].repeat(2, 0)  # [2, 4, 4]
        depth = jnp.sum(tree_mask, axis=-1).astype(jnp.int32) - 1  # [2, 4]
        tree = StepInputs(prompt[:, 4:8], slots, jnp.full(2, 15), depth, tree_mask)
        tree_logits, _ = model.forward_cached(tree, cache, 32, kernels=plan)  # [2, 4, V]
        results[name] = (np.asarray(chain), np.asarray(tree_logits))
    for got, want in zip(results["pallas"], results["xla"]):
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)  # f32: summation order only (see above)
