"""Attention that reads the KV cache in place on XLA:CPU: an XLA FFI custom call
(jaxspec/models/csrc/cache_attention.cc).

On XLA:CPU the XLA form of cached attention (`jaxspec.models.llama.attention` over `cache[slot_ids, :W]`) copies
each row's window out of the [S+1, M, G, H] cache every layer and step: its dots take whole buffers. This
kernel takes the cache buffer and the slot ids and reads the window where it lies (docs/design.md,
"Attention on XLA:CPU"). `forward_cached` uses it where the kernel plan says so (jaxspec.models.kernel_plan).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxspec.models import _cache_attention  # built by setup.py from jaxspec/models/csrc/cache_attention.cc

TARGET = "jaxspec_cache_attention"
jax.ffi.register_ffi_target(TARGET, _cache_attention.handler(), platform="cpu")

# the kernel serves decode, verify and tree steps and small prefill chunks (T ≤ this many tokens per row);
# it was measured faster than the XLA form up to T = 128 (docs/results/cache_attention.json), larger
# prefill chunks were not measured and keep the XLA form
MAX_STEP_TOKENS = 64


def kernel_available() -> tuple[bool, str]:
    """(whether the compiled kernel is importable here, why not)."""
    return True, ""


def cache_attention(q: jax.Array, cache_k: jax.Array, cache_v: jax.Array, slot_ids: jax.Array,
                    mask: jax.Array) -> jax.Array:
    """Grouped-query attention of q [B, T, N, H] over positions [0, W) of each row's slot in cache_k,
    cache_v [S+1, M, G, H] (slot_ids [B]; mask [B, T, W] bool) -> [B, T, N, H]. Same result as
    `jaxspec.models.llama.attention(q, cache_k[slot_ids, :W], cache_v[slot_ids, :W], mask)`, up to float rounding."""
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, q.dtype))
    return call(q, cache_k, cache_v, slot_ids.astype(jnp.int32), mask.astype(jnp.bool_))
