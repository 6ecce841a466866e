"""Attention that reads the KV cache in place on XLA:CPU: an XLA FFI custom call (models/csrc/cache_attention.cc).

On XLA:CPU the XLA form of cached attention (`models.llama.attention` over `cache[slot_ids, :W]`) copies
each row's window out of the [S+1, M, G, H] cache every layer and step: its dots take whole buffers. This
kernel takes the cache buffer and the slot ids and reads the window where it lies (docs/design.md,
"Attention on XLA:CPU"). `forward_cached` uses it where `reads_cache_in_place` says so.

The kernel is optional (built by setup.py where a C++17 compiler works): `kernel_available()` says whether this
install has it and `kernel_unavailable_reason()` why not; without it every step attends in the XLA form.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import jax
import jax.numpy as jnp

from models import cpu_kernels

_cache_attention = cpu_kernels.load("_cache_attention")  # built by setup.py from models/csrc/cache_attention.cc

TARGET = "jaxspec_cache_attention"
if _cache_attention is not None:
    jax.ffi.register_ffi_target(TARGET, _cache_attention.handler(), platform="cpu")
MAX_HEAD_DIM = 256  # the kernel's head dims: multiples of 8 up to this (kMaxHeadDim in the source)

# the kernel serves decode, verify and tree steps and small prefill chunks (T ≤ this many tokens per row);
# it was measured faster than the XLA form up to T = 128 (docs/results/cache_attention.json), larger
# prefill chunks were not measured and keep the XLA form
MAX_STEP_TOKENS = 64
_KERNEL_ALLOWED = contextvars.ContextVar("jaxspec_cache_kernel_allowed", default=True)


@contextlib.contextmanager
def kernel_allowed(allowed: bool) -> Iterator[None]:
    """Within this block, models traced attend with the kernel where it applies (True) or in the XLA form
    everywhere (False). `Engine` compiles every executable inside `kernel_allowed(engine.attention ==
    'cache-kernel')`, so the form it chose at construction holds whatever block it is compiled in."""
    token = _KERNEL_ALLOWED.set(allowed)
    try:
        yield
    finally:
        _KERNEL_ALLOWED.reset(token)


def kernels_enabled() -> bool:
    """False inside `kernel_allowed(False)` (`xla_form_only`): models traced there attend in the XLA form,
    and placements made there keep XLA's weight layout (`models.panel_matmul.uses_panel_weights`)."""
    return _KERNEL_ALLOWED.get()


def xla_form_only() -> contextlib.AbstractContextManager[None]:
    """`kernel_allowed(False)`: engines built and models traced in this block attend in the XLA form (the
    side-by-side reference in benchmarks/decode_speed.py and the kernel's tests)."""
    return kernel_allowed(False)


def kernel_available() -> bool:
    """Whether this install has the compiled kernel (setup.py builds it where a C++17 compiler works)."""
    return _cache_attention is not None


def kernel_unavailable_reason() -> str | None:
    """Why the compiled kernel is not available, or None if it is."""
    return cpu_kernels.unavailable_reason("_cache_attention")


def head_dim_supported(head_dim: int) -> bool:
    """Whether the kernel takes heads of `head_dim` (a multiple of 8 up to MAX_HEAD_DIM)."""
    return 0 < head_dim <= MAX_HEAD_DIM and head_dim % 8 == 0


def reads_cache_in_place(cache_k: jax.Array, t: int) -> bool:
    """Whether `forward_cached` attends with `cache_attention` for T = `t` new tokens per row over a
    cache buffer like `cache_k` (a tracer is fine): float32 on an XLA:CPU backend, on one device (a
    cache split over a mesh keeps the XLA form, which the partitioner splits), a decode-sized T, a head dim
    the kernel takes, not inside `kernel_allowed(False)` (`xla_form_only`), and the kernel built (where it
    would apply but is not, the XLA form runs and stderr says so once: `models.cpu_kernels.note_xla_form`)."""
    if not kernels_enabled():
        return False
    mesh = jax.typeof(cache_k).sharding.mesh
    applies = (jax.default_backend() == "cpu" and cache_k.dtype == jnp.float32
               and (mesh.empty or mesh.size == 1) and t <= MAX_STEP_TOKENS and head_dim_supported(cache_k.shape[-1]))
    if applies and not kernel_available():
        cpu_kernels.note_xla_form()
        return False
    return applies


def cache_attention(q: jax.Array, cache_k: jax.Array, cache_v: jax.Array, slot_ids: jax.Array,
                    mask: jax.Array) -> jax.Array:
    """Grouped-query attention of q [B, T, N, H] over positions [0, W) of each row's slot in cache_k,
    cache_v [S+1, M, G, H] (slot_ids [B]; mask [B, T, W] bool) -> [B, T, N, H]. Same result as
    `models.llama.attention(q, cache_k[slot_ids, :W], cache_v[slot_ids, :W], mask)`, up to float rounding.
    Head dims: multiples of 8 up to MAX_HEAD_DIM (others are an error when the call runs)."""
    if not kernel_available():
        raise RuntimeError(f"cache_attention: {kernel_unavailable_reason()}; {cpu_kernels.HOW_TO_GET_THEM}")
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, q.dtype))
    return call(q, cache_k, cache_v, slot_ids.astype(jnp.int32), mask.astype(jnp.bool_))
