"""Attention that reads the KV cache in place on GPUs: a Pallas kernel (Triton lowering) over pages of the cache.

The step's T query rows per batch row (a decode row, a verify chain of k + 1, a token tree's nodes) attend
over positions [0, W) of their sequence with grouped-query heads, reading keys and values where they lie in
the cache: a paged cache `[num_pages, P, G, H]` and a block table `[B, pages_per_window]` that names the page
holding each run of P window positions. Today's per-slot cache `[S+1, M, G, H]` is such a cache viewed as
`[(S+1)·M/P, P, G, H]` (a free reshape) with the identity block table (`slot_block_table`); `slot_attention`
takes it with the interface of `jaxspec.models.cache_attention.cache_attention`.

The mask is the model's only mask shape (`jaxspec.models.llama.block_window_mask`): every position before a row's
block start (its history) plus a block mask over the U positions from there (`WindowMask`). The kernel gets
it as the block start and one bit per (query row, block position), so it reads no [T, W] mask and skips the
pages past the last position a row's queries can see. Docs: docs/design.md, "Attention on GPUs (Pallas)".
TPU has no kernel here: it keeps the XLA form (`attention_limits` says so).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

# bits of the block mask per int32 word, and the most words per query row: U ≤ 128 block positions
_WORD_BITS = 32
MAX_BLOCK_WORDS = 4
MAX_BLOCK_TOKENS = _WORD_BITS * MAX_BLOCK_WORDS
# Triton's tensor dimensions are powers of two and its dot needs ≥ 16 on each side
HEAD_DIMS = (16, 32, 64, 128, 256)
DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
MIN_DOT = 16
# element offsets into a cache buffer must fit in int32 (the Triton lowering's index type; unverified on a GPU)
MAX_CACHE_ELEMENTS = 2 ** 31 - 1
SLOT_PAGE_SIZE = 16  # a per-slot cache read as pages of this many positions (`slot_attention`)
# the kernel plan takes the kernel for calls of at most this many new tokens a row (decode, verify, tree steps;
# larger prefill chunks keep the XLA form, whose dots a long chunk keeps busy)
MAX_STEP_TOKENS = 64
# a masked score: finite, so a block a query sees nothing of keeps its running max and adds exact zeros
_MASKED = -0.7 * float(np.finfo(np.float32).max)
_LOG2E = math.log2(math.e)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["block_mask", "block_start"],
                   meta_fields=["window"])
@dataclasses.dataclass(frozen=True)
class WindowMask:
    """Which of positions [0, window) each query row sees: all before `block_start[b]` (history), then
    `block_mask[b, t, u]` for position block_start[b] + u (u < U), nothing after (nor at or past `window`).

    block_mask: [B, T, U] bool (a chain: lower-triangular over the step's own tokens; a tree: ancestor-or-self;
    a draft tree's level call: U > T). block_start: [B] int32. window: W, static.
    """

    block_mask: jax.Array
    block_start: jax.Array
    window: int

    def dense(self) -> jax.Array:
        """The same mask as [B, T, W] bool (the form `jaxspec.models.llama.attention` and `cache_attention` take)."""
        b, t, u = self.block_mask.shape
        rel = jnp.arange(self.window, dtype=jnp.int32)[None, :] - self.block_start[:, None]  # [B, W]
        idx = jnp.broadcast_to(jnp.clip(rel, 0, u - 1)[:, None, :], (b, t, self.window))  # [B, T, W]
        in_block = ((rel >= 0) & (rel < u))[:, None, :] & jnp.take_along_axis(self.block_mask, idx, axis=2)
        return (rel < 0)[:, None, :] | in_block  # [B, T, W]


@dataclasses.dataclass(frozen=True)
class KernelBlocks:
    """How the kernel tiles a call. rows: query rows (T·R of one kv head) per program; pages: pages per
    compute block (keys per block = pages · P); splits: programs that share one row's window (flash-decoding:
    their partial results are merged after the kernel). All powers of two except splits."""

    rows: int
    pages: int
    splits: int


def attention_limits(*, platform: str, dtype, head_dim: int, num_heads: int, num_kv_heads: int,
                     block_tokens: int, page_size: int, max_len: int | None = None,
                     cache_elements: int = 0) -> str | None:
    """Why the kernel cannot take this shape, or None when it can. `platform`: 'gpu' (CUDA, ROCm), 'tpu' or
    'cpu' (a GPU kernel runs there only in interpret mode, for tests); `block_tokens`: U, the block mask's
    width (T, or a draft tree level's block); `max_len`: M of a per-slot cache (`slot_attention`), if any;
    `cache_elements`: the size of one layer's key (or value) buffer."""
    if platform != "gpu":
        return f"the Pallas attention kernel is written for GPUs (Triton); on {platform} attention keeps the XLA form"
    if jnp.dtype(dtype) not in DTYPES:
        return f"dtype {jnp.dtype(dtype).name} is not one of {[d.name for d in DTYPES]}"
    if head_dim not in HEAD_DIMS:
        return f"head_dim {head_dim} is not one of {HEAD_DIMS} (Triton tensors have power-of-two sides ≥ {MIN_DOT})"
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        return f"{num_heads} query heads are not a multiple of {num_kv_heads} kv heads"
    if not 1 <= block_tokens <= MAX_BLOCK_TOKENS:
        return f"a block of {block_tokens} tokens per row is outside 1..{MAX_BLOCK_TOKENS} (the mask's bits per row)"
    if not _is_pow2(page_size):
        return f"page size {page_size} is not a power of two"
    if max_len is not None and max_len % page_size:
        return f"cache max_len {max_len} is not a multiple of the page size {page_size}"
    if cache_elements > MAX_CACHE_ELEMENTS:
        return f"a cache buffer of {cache_elements} elements is past int32 offsets ({MAX_CACHE_ELEMENTS})"
    return None


def default_blocks(batch: int, kv_heads: int, query_rows: int, window_pages: int, page_size: int) -> KernelBlocks:
    """A tiling for `batch` rows of `query_rows` (= T·R) queries per kv head over `window_pages` pages: compute
    blocks of ≥ 64 keys, ≤ 64 query rows per program, and enough splits of the window for ~128 programs.
    Not tuned on a GPU yet."""
    rows = min(64, max(MIN_DOT, _next_pow2(query_rows)))
    pages = max(1, 64 // page_size)
    programs = batch * kv_heads * _cdiv(query_rows, rows)
    splits = max(1, min(_cdiv(window_pages, pages), 128 // programs))
    return KernelBlocks(rows, pages, splits)


def paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, block_table: jax.Array,
                    mask: WindowMask, *, blocks: KernelBlocks | None = None, interpret: bool = False) -> jax.Array:
    """Grouped-query attention of q [B, T, N, H] over window positions [0, mask.window) of each row, read from
    k_pages, v_pages [num_pages, P, G, H] through block_table [B, ceil(W / P)] (int32: entry i names the page
    holding positions [i·P, (i+1)·P) of row b) -> [B, T, N, H] in q's dtype, f32 accumulation. Rows may name
    pages in any order and share pages; entries past what a row's queries may see (the scratch page of a paged
    cache) are read only as masked, and whatever they hold adds exact zeros. Page ids are not checked on the
    device: each must be in [0, num_pages).

    Same result as `paged_attention_reference` up to float rounding, except that a query that sees no position
    gets zeros (the XLA form averages its window; the model never asks for such a query). `interpret`: run the
    kernel in Pallas' interpreter (any backend; the tests)."""
    b, t, n, h = q.shape
    num_pages, page_size, g, _ = k_pages.shape
    u, window = mask.block_mask.shape[2], mask.window
    window_pages = _cdiv(window, page_size)
    _check(q, k_pages, v_pages, block_table, mask, window_pages)
    reason = attention_limits(platform="gpu", dtype=q.dtype, head_dim=h, num_heads=n, num_kv_heads=g,
                              block_tokens=u, page_size=page_size, cache_elements=k_pages.size)
    if reason:
        raise ValueError(reason)
    r = n // g
    blocks = blocks or default_blocks(b, g, t * r, window_pages, page_size)
    if blocks.rows < MIN_DOT or not _is_pow2(blocks.rows) or not _is_pow2(blocks.pages) or blocks.splits < 1:
        raise ValueError(f"{blocks}: rows must be a power of two ≥ {MIN_DOT}, pages a power of two, splits ≥ 1")
    if blocks.pages * page_size < MIN_DOT:
        raise ValueError(f"{blocks.pages} pages of {page_size} positions is a compute block under {MIN_DOT} keys")

    rows = t * r  # query rows per kv head: row t·R + i is query token t, head g·R + i
    rows_padded = _cdiv(rows, blocks.rows) * blocks.rows
    # q_rows: [B, T, N, H] -> [B, T, G, R, H] -> [B, G, T·R, H] -> pad to [B, G, rows_padded, H]
    q_rows = q.reshape(b, t, g, r, h).transpose(0, 2, 1, 3, 4).reshape(b, g, rows, h)
    q_rows = jnp.pad(q_rows, ((0, 0), (0, 0), (0, rows_padded - rows), (0, 0)))
    words = _row_words(mask.block_mask, r, rows_padded)  # [B, words, rows_padded] int32
    # span: [B, 2] = (block start, end of what any query of the row may see)
    end = jnp.minimum(mask.block_start + u, window).astype(jnp.int32)
    span = jnp.stack([mask.block_start.astype(jnp.int32), end], axis=1)
    pages_per_split = _cdiv(_cdiv(window_pages, blocks.splits), blocks.pages) * blocks.pages
    # table: [B, ceil(W/P)] -> [B, splits · pages_per_split], padded with page 0 (read past `end` only, masked)
    table = jnp.pad(block_table.astype(jnp.int32), ((0, 0), (0, blocks.splits * pages_per_split - window_pages)))

    kernel = functools.partial(_attention_kernel, pages_per_split=pages_per_split, pages_per_block=blocks.pages,
                               scale=_LOG2E / math.sqrt(h), exact_f32=q.dtype == jnp.float32)
    grid = (b, g, rows_padded // blocks.rows, blocks.splits)
    partial_shape = (b, g, blocks.splits, rows_padded)
    o, l, m = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[
            pl.BlockSpec((None, None, blocks.rows, h), lambda i, j, k, s: (i, j, k, 0)),  # q_rows
            pl.BlockSpec((num_pages, page_size, None, h), lambda i, j, k, s: (0, 0, j, 0)),  # k_pages, kv head j
            pl.BlockSpec((num_pages, page_size, None, h), lambda i, j, k, s: (0, 0, j, 0)),  # v_pages, kv head j
            pl.BlockSpec((None, table.shape[1]), lambda i, j, k, s: (i, 0)),  # table
            pl.BlockSpec((None, 2), lambda i, j, k, s: (i, 0)),  # span
            pl.BlockSpec((None, words.shape[1], blocks.rows), lambda i, j, k, s: (i, 0, k)),  # words
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, blocks.rows, h), lambda i, j, k, s: (i, j, s, k, 0)),  # o
            pl.BlockSpec((None, None, None, blocks.rows), lambda i, j, k, s: (i, j, s, k)),  # l
            pl.BlockSpec((None, None, None, blocks.rows), lambda i, j, k, s: (i, j, s, k)),  # m
        ],
        out_shape=[jax.ShapeDtypeStruct(partial_shape + (h,), jnp.float32),
                   jax.ShapeDtypeStruct(partial_shape, jnp.float32),
                   jax.ShapeDtypeStruct(partial_shape, jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name=f"jaxspec_paged_attention_r{blocks.rows}_p{blocks.pages}",
    )(q_rows, k_pages, v_pages, table, span, words)

    # merge the splits: o, l, m [B, G, splits, rows_padded(, H)] -> [B, G, rows_padded, H]
    top = m.max(axis=2)  # [B, G, rows_padded]
    weight = jnp.exp2(m - top[:, :, None])  # [B, G, splits, rows_padded]
    total = (weight * l).sum(axis=2)  # [B, G, rows_padded]
    out = (weight[..., None] * o).sum(axis=2) / jnp.where(total > 0, total, 1.0)[..., None]
    # out: [B, G, rows_padded, H] -> [B, G, T, R, H] -> [B, T, G, R, H] -> [B, T, N, H]
    out = out[:, :, :rows].reshape(b, g, t, r, h).transpose(0, 2, 1, 3, 4).reshape(b, t, n, h)
    return out.astype(q.dtype)


def paged_attention_reference(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, block_table: jax.Array,
                              mask: WindowMask) -> jax.Array:
    """The XLA form of `paged_attention`: gather each row's window through the block table, then the grouped
    einsums of `jaxspec.models.llama.attention` (same operations, same rounding) -> [B, T, N, H]."""
    b, t, n, h = q.shape
    _, page_size, g, _ = k_pages.shape
    window_pages = _cdiv(mask.window, page_size)
    _check(q, k_pages, v_pages, block_table, mask, window_pages)
    # kw, vw: [B, ceil(W/P), P, G, H] -> [B, W, G, H]
    kw = k_pages[block_table].reshape(b, window_pages * page_size, g, h)[:, :mask.window]
    vw = v_pages[block_table].reshape(b, window_pages * page_size, g, h)[:, :mask.window]
    # scores: [B, G, R, T, W]
    scores = jnp.einsum("BTGRH,BWGH->BGRTW", q.reshape(b, t, g, n // g, h), kw, preferred_element_type=jnp.float32)
    scores = scores * (1.0 / np.sqrt(h))
    scores = jnp.where(mask.dense()[:, None, None, :, :], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(vw.dtype)  # [B, G, R, T, W]
    # out: [B, T, G, R, H] -> [B, T, N, H]
    return jnp.einsum("BGRTW,BWGH->BTGRH", probs, vw).reshape(b, t, n, h)


def as_pages(cache: jax.Array, page_size: int) -> jax.Array:
    """A per-slot cache buffer [S+1, M, G, H] viewed as pages [(S+1)·M/P, P, G, H] (a reshape, no copy)."""
    slots, max_len, g, h = cache.shape
    if max_len % page_size:
        raise ValueError(f"cache max_len {max_len} is not a multiple of the page size {page_size}")
    return cache.reshape(slots * (max_len // page_size), page_size, g, h)


def slot_block_table(slot_ids: jax.Array, max_len: int, window: int, page_size: int) -> jax.Array:
    """The identity block table of a per-slot cache: [B, ceil(W/P)], entry i of row b is page
    slot_ids[b]·M/P + i of `as_pages(cache, P)`."""
    # slot_ids: [B] -> [B, ceil(W/P)]
    first = slot_ids.astype(jnp.int32)[:, None] * (max_len // page_size)
    return first + jnp.arange(_cdiv(window, page_size), dtype=jnp.int32)[None, :]


def slot_attention(q: jax.Array, cache_k: jax.Array, cache_v: jax.Array, slot_ids: jax.Array, mask: WindowMask,
                   *, page_size: int = SLOT_PAGE_SIZE, blocks: KernelBlocks | None = None,
                   interpret: bool = False) -> jax.Array:
    """`cache_attention`'s interface for the kernel: q [B, T, N, H] over positions [0, W) of each row's slot in
    cache_k, cache_v [S+1, M, G, H] (slot_ids [B]) -> [B, T, N, H], read in place as pages of `page_size`."""
    max_len = cache_k.shape[1]
    table = slot_block_table(slot_ids, max_len, mask.window, page_size)  # [B, ceil(W/P)]
    return paged_attention(q, as_pages(cache_k, page_size), as_pages(cache_v, page_size), table, mask,
                           blocks=blocks, interpret=interpret)


def _attention_kernel(q_ref, k_ref, v_ref, table_ref, span_ref, words_ref, o_ref, l_ref, m_ref, *,
                      pages_per_split: int, pages_per_block: int, scale: float, exact_f32: bool):
    """One program: `rows` query rows of one batch row and kv head over one split of its window.

    q_ref [rows, H]; k_ref, v_ref [num_pages, P, H] (this kv head); table_ref [pages]; span_ref [2] (block
    start, end); words_ref [words, rows] (bit u of word u // 32: the query sees block position u);
    o_ref [rows, H], l_ref, m_ref [rows]: the unnormalised output, the sum of exponentials and the running
    max (base 2) over this split."""
    page_size, head_dim = k_ref.shape[1], k_ref.shape[2]
    block_keys = pages_per_block * page_size
    precision = jax.lax.Precision.HIGHEST if exact_f32 else None  # f32: no TF32 in the dots
    block_start, end = span_ref[0], span_ref[1]
    first_page = pl.program_id(3) * pages_per_split
    last_page = jnp.minimum(first_page + pages_per_split, pl.cdiv(end, page_size))
    q = q_ref[...]  # [rows, H]
    words = [words_ref[w, :] for w in range(words_ref.shape[0])]  # words x [rows] int32

    def block(i, carry):
        o, l, m = carry  # [rows, H], [rows], [rows] f32
        page = first_page + i * pages_per_block
        pages = table_ref[pl.ds(page, pages_per_block)]  # [pages_per_block] int32
        k = k_ref[pages].reshape(block_keys, head_dim)  # [pages_per_block, P, H] -> [keys, H]
        v = v_ref[pages].reshape(block_keys, head_dim)  # [keys, H]
        scores = plgpu.dot(q, k, trans_b=True, precision=precision) * scale  # [rows, keys] f32, base-2 logits
        position = page * page_size + jnp.arange(block_keys, dtype=jnp.int32)  # [keys]
        rel = position - block_start  # [keys] position within the block (< 0: history)
        bits = jnp.zeros(scores.shape, jnp.int32)  # [rows, keys]: the mask bit of (query, position) in bit 0
        for w, word in enumerate(words):
            shifted = jax.lax.shift_right_logical(word[:, None], jnp.bitwise_and(rel, _WORD_BITS - 1)[None, :])
            bits = bits | jnp.where((jax.lax.shift_right_arithmetic(rel, 5) == w)[None, :], shifted, 0)
        seen = (((bits & 1) == 1) | (rel < 0)[None, :]) & (position < end)[None, :]  # [rows, keys]
        # positions past `end` (stale, or table padding) add exact zeros whatever they hold, NaN included
        v = jnp.where((position < end)[:, None], v, jnp.zeros((), v.dtype))  # [keys, H]
        scores = jnp.where(seen, scores, _MASKED)
        m_next = jnp.maximum(m, scores.max(axis=1))  # [rows]
        correction = jnp.exp2(m - m_next)  # [rows]
        p = jnp.where(seen, jnp.exp2(scores - m_next[:, None]), 0.0)  # [rows, keys]
        l = correction * l + p.sum(axis=1)
        o = correction[:, None] * o + plgpu.dot(p.astype(v.dtype), v, precision=precision)  # [rows, H]
        return o, l, m_next

    rows = q.shape[0]
    init = (jnp.zeros((rows, head_dim), jnp.float32), jnp.zeros((rows,), jnp.float32),
            jnp.full((rows,), _MASKED, jnp.float32))
    count = pl.cdiv(jnp.maximum(last_page - first_page, 0), pages_per_block)
    o, l, m = jax.lax.fori_loop(0, count, block, init)
    o_ref[...] = o
    l_ref[...] = l
    m_ref[...] = m


def _row_words(block_mask: jax.Array, r: int, rows_padded: int) -> jax.Array:
    """block_mask [B, T, U] bool -> [B, words, rows_padded] int32: bit u % 32 of word u // 32 of query row
    t·R + i (every i < R) is block_mask[b, t, u]; padding rows see no block position."""
    b, t, u = block_mask.shape
    words = _cdiv(u, _WORD_BITS)
    words = 1 << (words - 1).bit_length()  # a power of two (Triton)
    # bits: [B, T, U] -> [B, T, words, 32] uint32, summed over the 32 (disjoint bits: the sum is the or)
    bits = jnp.pad(block_mask, ((0, 0), (0, 0), (0, words * _WORD_BITS - u))).reshape(b, t, words, _WORD_BITS)
    packed = (bits.astype(jnp.uint32) << jnp.arange(_WORD_BITS, dtype=jnp.uint32)).sum(axis=3, dtype=jnp.uint32)
    packed = jax.lax.bitcast_convert_type(packed, jnp.int32)  # [B, T, words]
    rows = jnp.repeat(packed, r, axis=1)  # [B, T·R, words]
    rows = jnp.pad(rows, ((0, 0), (0, rows_padded - t * r), (0, 0)))  # [B, rows_padded, words]
    return rows.transpose(0, 2, 1)  # [B, words, rows_padded]


def _check(q, k_pages, v_pages, block_table, mask: WindowMask, window_pages: int) -> None:
    b, t, n, h = q.shape
    if k_pages.shape != v_pages.shape or k_pages.ndim != 4 or k_pages.shape[3] != h:
        raise ValueError(f"k_pages {k_pages.shape} and v_pages {v_pages.shape} must both be [pages, P, G, {h}]")
    if q.dtype != k_pages.dtype or q.dtype != v_pages.dtype:
        raise ValueError(f"q, k_pages, v_pages dtypes differ: {q.dtype}, {k_pages.dtype}, {v_pages.dtype}")
    if block_table.shape != (b, window_pages):
        raise ValueError(f"block_table {block_table.shape} must be [B, ceil(W / P)] = {(b, window_pages)}")
    if not jnp.issubdtype(block_table.dtype, jnp.integer):
        raise ValueError(f"block_table dtype {block_table.dtype} is not an integer type")
    if mask.block_mask.shape[:2] != (b, t) or mask.block_start.shape != (b,):
        raise ValueError(f"mask block_mask {mask.block_mask.shape} / block_start {mask.block_start.shape} "
                         f"must be [{b}, {t}, U] / [{b}]")


def _next_pow2(x: int) -> int:
    return 1 << max(0, x - 1).bit_length()


def _is_pow2(x: int) -> bool:
    return x >= 1 and not x & (x - 1)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)
