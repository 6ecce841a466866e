"""Attention over a paged KV cache in its three forms, against a float64 reference and each other: the XLA form
(`jaxspec.models.llama.attention` over `gather_window`), the XLA:CPU kernel (`paged_cache_attention`) and the
Pallas kernel (`paged_attention`, in Pallas' interpreter on this CPU).

Each case is a pool [Np, P, G, H] whose page 0 (scratch), unused pages and every position past a row's last
token hold garbage (±1e30, finite: it must add exact zeros), block tables with gaps (shuffled page ids, some
never used), a prefix of pages shared by several rows, table entries past a row's pages naming page 0, and
chain (T = 1, 9), tree (U = T) or level (U > T) masks, GQA (N > G) and G = N, P = 8 and 16, W a multiple of P.
The reference attends each row's logical sequence [W, G, H] (what was written into its pages) in numpy float64,
so a wrong table, a page computed per position wrongly or a leaked garbage position shows against it.

Tolerance: float32 forms vs the float64 reference, atol = rtol = 2e-5 (each form accumulates in f32 over
W ≤ 96 positions: measured ≤ 9e-7 on outputs of magnitude ≤ 2); the negative controls' wrong tables move outputs
by ~1 (another row's history page) to ~1e30 (garbage in a seen position).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.models.cache_attention import cache_attention, paged_cache_attention
from jaxspec.models.kv_cache import SCRATCH_PAGE, gather_window
from jaxspec.models.llama import attention
from jaxspec.models.pallas_attention import WindowMask, as_pages, paged_attention, slot_block_table
from tests.conftest import needs_cpu_kernels

GARBAGE = 1e30
TOLERANCE = 2e-5


def _tree(rng: np.random.Generator, nodes: int) -> np.ndarray:
    """Ancestor-or-self mask [nodes, nodes] of a random tree (node 0 the root, each parent before its child)."""
    anc = np.eye(nodes, dtype=bool)
    for i in range(1, nodes):
        anc[i] |= anc[rng.integers(0, i)]
    return anc


def _block_mask(rng: np.random.Generator, t: int, u: int, kind: str) -> np.ndarray:
    """[T, U]: a chain (lower-triangular, U = T), a tree (ancestor-or-self, U = T) or a draft tree's level call
    (the last T of U nodes against all U)."""
    if kind == "chain":
        return np.tril(np.ones((t, t), bool))
    return _tree(rng, u)[u - t:]


class Case:
    """One paged call: q [B, T, N, H]; pools k, v [Np, P, G, H]; block table [B, W/P] int32; WindowMask;
    `sequences_k`, `sequences_v` [B, W, G, H] the logical window of each row (garbage past its length)."""

    def __init__(self, b, t, u, n, g, h, page, window, kind, seed, shared_pages=0, sharing_rows=0):
        rng = np.random.default_rng(seed)
        window_pages = window // page
        assert window % page == 0 and shared_pages * page + u <= window
        # block starts: rows sharing the prefix start after it; row lengths (block start + U) ≤ W
        low = np.where(np.arange(b) < sharing_rows, shared_pages * page, 0)
        start = np.array([rng.integers(low[row], window - u + 1) for row in range(b)])
        length = start + u
        used = -(-length // page)  # [B] pages each row's tokens occupy
        own = used - np.where(np.arange(b) < sharing_rows, shared_pages, 0)
        spare = 3  # pages no row names: gaps in the page ids
        num_pages = 1 + shared_pages + int(own.sum()) + spare
        ids = rng.permutation(np.arange(1, num_pages))  # shuffled, page 0 (scratch) excluded
        shared, ids = ids[:shared_pages], ids[shared_pages:]
        table = np.full((b, window_pages), SCRATCH_PAGE, np.int32)  # past a row's pages: the scratch page
        for row in range(b):
            prefix = shared if row < sharing_rows else np.array([], np.int64)
            table[row, :used[row]] = np.concatenate([prefix, ids[:own[row]]])
            ids = ids[own[row]:]
        # logical sequences: the shared prefix is one sequence's, each row's own tokens its own; garbage past length
        seq_k = rng.standard_normal((b, window, g, h))
        seq_v = rng.standard_normal((b, window, g, h))
        prefix_len = shared_pages * page
        seq_k[:sharing_rows, :prefix_len] = seq_k[0, :prefix_len]
        seq_v[:sharing_rows, :prefix_len] = seq_v[0, :prefix_len]
        for row in range(b):
            signs = rng.choice([-1.0, 1.0], size=(2, window - length[row], g, h))
            seq_k[row, length[row]:], seq_v[row, length[row]:] = GARBAGE * signs
        # the pools: garbage everywhere, then each row's sequence written through its table (past-length positions
        # of its last page keep the row's garbage; page 0 and spare pages only garbage)
        k_pages = GARBAGE * rng.choice([-1.0, 1.0], size=(num_pages, page, g, h))
        v_pages = GARBAGE * rng.choice([-1.0, 1.0], size=(num_pages, page, g, h))
        for row in range(b):
            for w in range(used[row] * page):
                k_pages[table[row, w // page], w % page] = seq_k[row, w]
                v_pages[table[row, w // page], w % page] = seq_v[row, w]
        block_mask = np.stack([_block_mask(rng, t, u, kind) for _ in range(b)])  # [B, T, U]
        self.q = jnp.asarray(rng.standard_normal((b, t, n, h)), jnp.float32)
        self.k_pages, self.v_pages = jnp.asarray(k_pages, jnp.float32), jnp.asarray(v_pages, jnp.float32)
        self.table = jnp.asarray(table)
        self.mask = WindowMask(jnp.asarray(block_mask), jnp.asarray(start, jnp.int32), window)
        self.sequences = (seq_k.astype(np.float32), seq_v.astype(np.float32))
        self.length, self.used, self.shared = length, used, shared

    def args(self):
        return self.q, self.k_pages, self.v_pages, self.table


def _reference(q, seq_k, seq_v, dense) -> np.ndarray:
    """float64 attention of q [B, T, N, H] over each row's logical sequence [B, W, G, H], mask [B, T, W]."""
    q, seq_k, seq_v = (np.asarray(x, np.float64) for x in (q, seq_k, seq_v))
    b, t, n, h = q.shape
    r = n // seq_k.shape[2]
    k = np.repeat(seq_k, r, axis=2)  # [B, W, N, H]: query head n reads kv head n // R
    v = np.repeat(seq_v, r, axis=2)
    scores = np.einsum("btnh,bwnh->bntw", q, k) / np.sqrt(h)  # [B, N, T, W]
    scores = np.where(np.asarray(dense)[:, None], scores, -np.inf)
    probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    return np.einsum("bntw,bwnh->btnh", probs, v)  # [B, T, N, H]


@jax.jit
def _xla_form(q, k_pages, v_pages, table, mask: WindowMask):
    window = mask.window
    return attention(q, gather_window(k_pages, table, window), gather_window(v_pages, table, window), mask.dense())


@jax.jit
def _cpu_kernel(q, k_pages, v_pages, table, mask: WindowMask):
    return paged_cache_attention(q, k_pages, v_pages, table, mask.dense())


@jax.jit
def _pallas(q, k_pages, v_pages, table, mask: WindowMask):
    return paged_attention(q, k_pages, v_pages, table, mask, interpret=True)


FORMS = [pytest.param(_xla_form, id="xla"), pytest.param(_cpu_kernel, id="cpu-kernel", marks=needs_cpu_kernels),
         pytest.param(_pallas, id="pallas")]

# (B, T, U, N, G, H, P, W, mask kind, shared prefix pages, rows sharing it)
CASES = [
    pytest.param(4, 1, 1, 9, 3, 64, 16, 64, "chain", 1, 3, id="decode-gqa-p16"),
    pytest.param(3, 9, 9, 9, 3, 64, 8, 64, "chain", 2, 2, id="verify-gqa-p8"),
    pytest.param(3, 5, 5, 4, 4, 32, 16, 96, "tree", 2, 3, id="tree-g=n-p16"),
    pytest.param(2, 4, 12, 6, 2, 32, 8, 48, "level", 1, 2, id="level-gqa-p8"),
    pytest.param(2, 9, 9, 4, 4, 64, 8, 32, "chain", 0, 0, id="verify-g=n-p8"),
]


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("b,t,u,n,g,h,page,window,kind,shared_pages,sharing_rows", CASES)
def test_each_form_equals_the_reference(form, b, t, u, n, g, h, page, window, kind, shared_pages, sharing_rows):
    """Each form, over shuffled pages with gaps, a shared prefix and garbage in the scratch page, the spare pages
    and past every row's length, equals float64 attention over the rows' logical sequences."""
    case = Case(b, t, u, n, g, h, page, window, kind, seed=b * 100 + t * 10 + page, shared_pages=shared_pages,
                sharing_rows=sharing_rows)
    assert (np.asarray(case.table) == SCRATCH_PAGE).any()  # some entries past a row's pages name the scratch page
    out = np.asarray(form(*case.args(), case.mask))
    assert out.shape == case.q.shape and np.isfinite(out).all()
    want = _reference(case.q, *case.sequences, case.mask.dense())
    np.testing.assert_allclose(out, want, atol=TOLERANCE, rtol=TOLERANCE)


@needs_cpu_kernels
@pytest.mark.parametrize("b,t,u,n,g,h,page,window,kind,shared_pages,sharing_rows", CASES[:3])
def test_the_three_forms_agree(b, t, u, n, g, h, page, window, kind, shared_pages, sharing_rows):
    """The XLA form, the CPU kernel and the Pallas kernel on one call agree with each other (f32 rounding)."""
    case = Case(b, t, u, n, g, h, page, window, kind, seed=7, shared_pages=shared_pages, sharing_rows=sharing_rows)
    xla, cpu, pallas = (np.asarray(f(*case.args(), case.mask)) for f in (_xla_form, _cpu_kernel, _pallas))
    np.testing.assert_allclose(cpu, xla, atol=TOLERANCE, rtol=TOLERANCE)
    np.testing.assert_allclose(pallas, xla, atol=TOLERANCE, rtol=TOLERANCE)


@pytest.mark.parametrize("form", FORMS)
def test_a_wrong_table_or_a_leaked_position_fails_the_comparison(form):
    """Negative controls: the same call with a row's first page swapped with its last (the one holding its block
    and garbage past it), with two rows' own history pages swapped (no garbage: another row's keys; moves outputs
    by ~1), or with the shared prefix's first page replaced by a spare page, differs from the reference beyond
    the tolerance; a mask that sees one position past a row's length reads garbage and is far off (or not
    finite)."""
    case = Case(3, 9, 9, 9, 3, 64, 8, 64, "chain", seed=5, shared_pages=2, sharing_rows=3)
    want = _reference(case.q, *case.sequences, case.mask.dense())
    np.testing.assert_allclose(np.asarray(form(*case.args(), case.mask)), want, atol=TOLERANCE, rtol=TOLERANCE)
    table = np.asarray(case.table)
    swapped = table.copy()
    last = int(case.used[0]) - 1
    swapped[0, [0, last]] = swapped[0, [last, 0]]
    spare = sorted(set(range(1, case.k_pages.shape[0])) - set(table.ravel().tolist()))[0]
    replaced = table.copy()
    replaced[:, 0] = np.where(replaced[:, 0] == case.shared[0], spare, replaced[:, 0])
    across = table.copy()  # rows 0 and 1: entry 2 holds positions 16..23, history of both (asserted)
    assert min(case.length[:2] - 9) >= 24 and min(case.used[:2]) > 2
    across[[0, 1], 2] = across[[1, 0], 2]
    for wrong in (swapped, across, replaced):
        out = np.asarray(form(case.q, case.k_pages, case.v_pages, jnp.asarray(wrong), case.mask))
        with pytest.raises(AssertionError):
            np.testing.assert_allclose(out, want, atol=TOLERANCE, rtol=TOLERANCE)
    # row 0's block mask sees one more position: its last query sees position `length` (garbage)
    longer = WindowMask(jnp.pad(case.mask.block_mask, ((0, 0), (0, 0), (0, 1)), constant_values=True),
                        case.mask.block_start, case.mask.window)
    assert int(case.length[0]) < case.mask.window
    out = np.asarray(form(*case.args(), longer))
    assert not np.isfinite(out[0]).all() or np.abs(out[0] - want[0]).max() > 1e3


@needs_cpu_kernels
def test_the_per_slot_call_is_the_paged_call_with_one_page_a_slot():
    """`cache_attention` over a per-slot cache [S+1, M, G, H] equals, bit for bit, `paged_cache_attention` over the
    same cache viewed as pages of 16 (`as_pages`) through the identity block table: one kernel, both layouts."""
    rng = np.random.default_rng(2)
    b, t, n, g, h, slots, max_len, window = 3, 9, 9, 3, 64, 5, 160, 144
    q = jnp.asarray(rng.standard_normal((b, t, n, h)), jnp.float32)
    ck = jnp.asarray(rng.standard_normal((slots, max_len, g, h)), jnp.float32)
    cv = jnp.asarray(rng.standard_normal((slots, max_len, g, h)), jnp.float32)
    slot_ids = jnp.asarray([4, 0, 2], jnp.int32)
    mask = jnp.asarray(rng.random((b, t, window)) < 0.7)  # [B, T, W]
    per_slot = np.asarray(jax.jit(cache_attention)(q, ck, cv, slot_ids, mask))
    table = slot_block_table(slot_ids, max_len, window, 16)  # [B, W/16]
    paged = np.asarray(jax.jit(paged_cache_attention)(q, as_pages(ck, 16), as_pages(cv, 16), table, mask))
    np.testing.assert_array_equal(paged, per_slot)
    want = attention(q, ck[slot_ids, :window], cv[slot_ids, :window], mask)
    np.testing.assert_allclose(per_slot, np.asarray(want), atol=TOLERANCE, rtol=TOLERANCE)


@needs_cpu_kernels
def test_the_cpu_kernel_refuses_bad_tables():
    """A table whose shape is not [B, ceil(W/P)] is a ValueError naming the expected shape; a page id outside the
    pool fails the call naming the entry."""
    case = Case(2, 1, 1, 9, 3, 64, 16, 64, "chain", seed=1)
    dense = case.mask.dense()
    for bad in (case.table[:, :3], case.table[:1], jnp.pad(case.table, ((0, 0), (0, 1)))):
        with pytest.raises(ValueError, match=r"block table .* must be \[B, ceil\(W / P\)\] = \[2, ceil\(64 / 16\)\]"):
            paged_cache_attention(case.q, case.k_pages, case.v_pages, bad, dense)
    with pytest.raises(ValueError, match="integer"):
        paged_cache_attention(case.q, case.k_pages, case.v_pages, case.table.astype(jnp.float32), dense)
    num_pages = case.k_pages.shape[0]
    for page in (num_pages, -1):
        bad = case.table.at[1, 2].set(page)
        with pytest.raises(Exception, match=rf"block table entry \[1, 2\] = {page} names no page of the pool"):
            jax.block_until_ready(_cpu_kernel(case.q, case.k_pages, case.v_pages, bad, case.mask))


def test_the_pallas_kernel_refuses_bad_tables():
    """The Pallas form: a table whose shape is not [B, ceil(W/P)], or not of integers, is a ValueError."""
    case = Case(2, 1, 1, 9, 3, 64, 16, 64, "chain", seed=1)
    for bad in (case.table[:, :3], case.table[:1]):
        with pytest.raises(ValueError, match=r"must be \[B, ceil\(W / P\)\] = \(2, 4\)"):
            paged_attention(case.q, case.k_pages, case.v_pages, bad, case.mask, interpret=True)
    with pytest.raises(ValueError, match="integer"):
        paged_attention(case.q, case.k_pages, case.v_pages, case.table.astype(jnp.float32), case.mask, interpret=True)


@pytest.mark.parametrize("plan", [
    pytest.param("xla", id="xla"),
    pytest.param("cpu-cache-kernel", id="cpu-kernel", marks=needs_cpu_kernels),
    pytest.param("pallas", id="pallas"),
])
def test_the_models_cached_forward_over_pages_equals_the_per_slot_cache(plan):
    """The tiny model's cached forward (a prompt chunk, a chain step, a tree step; every layer writes then reads
    its window) through a paged cache with shuffled pages in each form of the kernel plan equals the same calls on
    a per-slot cache in the XLA form."""
    from jaxspec.models.config import TINY
    from jaxspec.models.kernel_plan import XLA_PLAN, KernelPlan
    from jaxspec.models.kv_cache import init_cache, init_paged_cache
    from jaxspec.models.llama import StepInputs, chain_inputs, random_model

    config = TINY.replace(head_dim=16)  # the Pallas kernel's smallest head dim
    model = random_model(config, seed=5)
    window, page = 32, 8
    rng = np.random.default_rng(3)
    slots = jnp.array([0, 2], jnp.int32)
    table = jnp.asarray(rng.permutation(np.arange(1, 13))[:8].reshape(2, 4), jnp.int32)  # [2, W/X], gaps
    prompt = jnp.asarray(rng.integers(2, config.vocab_size, (2, 12)), jnp.int32)
    tree_mask = jnp.asarray(_tree(rng, 4))[None].repeat(2, 0)  # [2, 4, 4]
    depth = jnp.sum(tree_mask, axis=-1).astype(jnp.int32) - 1  # [2, 4]

    def run(cache, kernels, block_table):
        _, cache = model.forward_cached(chain_inputs(prompt, slots, jnp.zeros(2, jnp.int32), block_table), cache,
                                        window, kernels=kernels)
        chain, cache = model.forward_cached(chain_inputs(prompt[:, :3], slots, jnp.full(2, 12), block_table), cache,
                                            window, kernels=kernels)  # [2, 3, V]
        tree = StepInputs(prompt[:, 4:8], slots, jnp.full(2, 15), depth, tree_mask, block_table)
        tree_logits, _ = model.forward_cached(tree, cache, window, kernels=kernels)  # [2, 4, V]
        return np.asarray(chain), np.asarray(tree_logits)

    want = run(init_cache(config, 3, 64), XLA_PLAN, None)
    kernels = XLA_PLAN if plan == "xla" else KernelPlan(attention=plan, attention_max_rows=8, interpret=True)
    pool = init_paged_cache(config, 13, page, 3)
    pool = pool.__class__(k=tuple(x + 1e30 for x in pool.k), v=tuple(x - 1e30 for x in pool.v),
                          lengths=pool.lengths)  # garbage everywhere nothing was written
    got = run(pool, kernels, table)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, atol=1e-4, rtol=1e-4)
