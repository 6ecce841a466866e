"""Attention that reads the KV cache in place on XLA:CPU: an XLA FFI custom call
(jaxspec/models/csrc/cache_attention.cc).

On XLA:CPU the XLA form of cached attention (`jaxspec.models.llama.attention` over the gathered window) copies
each row's window out of the cache every layer and step: its dots take whole buffers. This kernel takes the
cache buffer and where each row's window lies, and reads the window in place (docs/design.md, "Attention on
XLA:CPU"). One kernel serves both cache layouts:

- `paged_cache_attention`: the target's paged cache, a pool [Np, P, G, H] and a block table [B, ceil(W/P)]
  (jaxspec.models.kv_cache.PagedKVCache);
- `cache_attention`: a per-slot cache [S+1, M, G, H] and slot ids [B] (a draft's `KVCache`), the case P = M
  with the table `slot_ids[:, None]`.

`forward_cached` uses it where the kernel plan says so (jaxspec.models.kernel_plan). The kernel is optional
(built by setup.py where a C++17 compiler works): `kernel_available()` says whether this install has it and
`kernel_unavailable_reason()` why not; without it every step attends in the XLA form.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxspec.models import cpu_kernels

try:
    from jaxspec.models import _cache_attention  # built by setup.py from jaxspec/models/csrc/cache_attention.cc
except ImportError as error:
    _cache_attention = None
    cpu_kernels.record_missing("_cache_attention", error)

TARGET = "jaxspec_cache_attention"
if _cache_attention is not None:
    jax.ffi.register_ffi_target(TARGET, _cache_attention.handler(), platform="cpu")
MAX_HEAD_DIM = 256  # the kernel's head dims: multiples of 8 up to this (kMaxHeadDim in the source)

# the kernel serves decode, verify and tree steps and small prefill chunks (T ≤ this many tokens per row);
# it was measured faster than the XLA form up to T = 128 (docs/results/cache_attention.json), larger
# prefill chunks were not measured and keep the XLA form
MAX_STEP_TOKENS = 64


def kernel_available() -> bool:
    """Whether this install has the compiled kernel (setup.py builds it where a C++17 compiler works)."""
    return _cache_attention is not None


def kernel_unavailable_reason() -> str | None:
    """Why the compiled kernel is not available, or None if it is."""
    return cpu_kernels.unavailable_reason("_cache_attention")


def head_dim_supported(head_dim: int) -> bool:
    """Whether the kernel takes heads of `head_dim` (a multiple of 8 up to MAX_HEAD_DIM)."""
    return 0 < head_dim <= MAX_HEAD_DIM and head_dim % 8 == 0


def paged_cache_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, block_table: jax.Array,
                          mask: jax.Array) -> jax.Array:
    """Grouped-query attention of q [B, T, N, H] over window positions [0, W) of each row, read in place from
    k_pages, v_pages [Np, P, G, H] through block_table [B, ceil(W/P)] int32 (position w of row b: page
    block_table[b, w // P], offset w % P); mask [B, T, W] bool -> [B, T, N, H]. Same result as
    `jaxspec.models.llama.attention(q, gather_window(k_pages, block_table, W), gather_window(v_pages, ...), mask)`
    up to float rounding. Shapes are checked here (ValueError); a page id outside [0, Np) fails the call."""
    if not kernel_available():
        raise RuntimeError(f"paged_cache_attention: {kernel_unavailable_reason()}; {cpu_kernels.HOW_TO_GET_THEM}")
    _check_shapes(q, k_pages, v_pages, block_table, mask)
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, q.dtype))
    return call(q, k_pages, v_pages, block_table.astype(jnp.int32), mask.astype(jnp.bool_))


def cache_attention(q: jax.Array, cache_k: jax.Array, cache_v: jax.Array, slot_ids: jax.Array,
                    mask: jax.Array) -> jax.Array:
    """Grouped-query attention of q [B, T, N, H] over positions [0, W) of each row's slot in cache_k,
    cache_v [S+1, M, G, H] (slot_ids [B]; mask [B, T, W] bool, W ≤ M) -> [B, T, N, H]. Same result as
    `jaxspec.models.llama.attention(q, cache_k[slot_ids, :W], cache_v[slot_ids, :W], mask)`, up to float rounding:
    `paged_cache_attention` with one page of M positions per slot."""
    if not kernel_available():
        raise RuntimeError(f"cache_attention: {kernel_unavailable_reason()}; {cpu_kernels.HOW_TO_GET_THEM}")
    max_len, window = cache_k.shape[1], mask.shape[-1]
    if window > max_len:
        raise ValueError(f"cache_attention: a window of {window} positions is longer than the cache's {max_len}")
    # block_table: [B, ceil(W/M)] = [B, 1] (or [B, 0] for an empty window): each row's slot is its one page
    block_table = slot_ids.astype(jnp.int32)[:, None][:, :-(-window // max_len)]
    return paged_cache_attention(q, cache_k, cache_v, block_table, mask)


def _check_shapes(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, block_table: jax.Array,
                  mask: jax.Array) -> None:
    """ValueError unless q [B, T, N, H], k_pages = v_pages [Np, P, G, H] (N a multiple of G), block_table
    [B, ceil(W/P)] of integers and mask [B, T, W] agree, all float32 but the table and the mask."""
    if q.ndim != 4 or k_pages.ndim != 4 or block_table.ndim != 2 or mask.ndim != 3:
        raise ValueError(f"paged_cache_attention: expected q [B, T, N, H], pages [Np, P, G, H], block table "
                         f"[B, ceil(W/P)], mask [B, T, W]; got {q.shape}, {k_pages.shape}, {block_table.shape}, "
                         f"{mask.shape}")
    b, t, n, h = q.shape
    _, page_size, g, _ = k_pages.shape
    window = mask.shape[2]
    if v_pages.shape != k_pages.shape or k_pages.shape[3] != h or g < 1 or n % g:
        raise ValueError(f"paged_cache_attention: k_pages {k_pages.shape} and v_pages {v_pages.shape} must both be "
                         f"[Np, P, G, {h}] with G dividing the {n} query heads")
    if mask.shape[:2] != (b, t):
        raise ValueError(f"paged_cache_attention: mask {mask.shape} must be [{b}, {t}, W]")
    if page_size < 1 or block_table.shape != (b, -(-window // page_size)):
        raise ValueError(f"paged_cache_attention: block table {block_table.shape} must be [B, ceil(W / P)] = "
                         f"[{b}, ceil({window} / {page_size})]")
    if not jnp.issubdtype(block_table.dtype, jnp.integer):
        raise ValueError(f"paged_cache_attention: block table dtype {block_table.dtype} is not an integer type")
    if {q.dtype, k_pages.dtype, v_pages.dtype} != {jnp.dtype(jnp.float32)}:
        raise ValueError(f"paged_cache_attention: q, k_pages, v_pages must be float32, not {q.dtype}, "
                         f"{k_pages.dtype}, {v_pages.dtype}")
