"""Attention that reads the KV cache in place on XLA:CPU: an XLA FFI custom call
(jaxspec/models/csrc/cache_attention.cc).

On XLA:CPU the XLA form of cached attention (`jaxspec.models.llama.attention` over `cache[slot_ids, :W]`) copies
each row's window out of the [S+1, M, G, H] cache every layer and step: its dots take whole buffers. This
kernel takes the cache buffer and the slot ids and reads the window where it lies (docs/design.md,
"Attention on XLA:CPU"). `forward_cached` uses it where the kernel plan says so (jaxspec.models.kernel_plan).

The kernel is optional (built by setup.py where a C++17 compiler works): `kernel_available()` says whether this
install has it and `kernel_unavailable_reason()` why not; without it every step attends in the XLA form.
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


def cache_attention(q: jax.Array, cache_k: jax.Array, cache_v: jax.Array, slot_ids: jax.Array,
                    mask: jax.Array) -> jax.Array:
    """Grouped-query attention of q [B, T, N, H] over positions [0, W) of each row's slot in cache_k,
    cache_v [S+1, M, G, H] (slot_ids [B]; mask [B, T, W] bool) -> [B, T, N, H]. Same result as
    `jaxspec.models.llama.attention(q, cache_k[slot_ids, :W], cache_v[slot_ids, :W], mask)`, up to float rounding."""
    if not kernel_available():
        raise RuntimeError(f"cache_attention: {kernel_unavailable_reason()}; {cpu_kernels.HOW_TO_GET_THEM}")
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, q.dtype))
    return call(q, cache_k, cache_v, slot_ids.astype(jnp.int32), mask.astype(jnp.bool_))


def paged_cache_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, block_table: jax.Array,
                          mask: jax.Array) -> jax.Array:
    """Placeholder until the paged kernel lands (TEMPORARY: the XLA form)."""
    from jaxspec.models.kv_cache import gather_window
    from jaxspec.models.llama import attention
    w = mask.shape[2]
    return attention(q, gather_window(k_pages, block_table, w), gather_window(v_pages, block_table, w), mask)
