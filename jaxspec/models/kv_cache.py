"""Per-slot KV cache (docs/design.md, "The KV cache").

Layout (one array per layer for keys, one for values)::

    k[l]: [S+1, M, G, H]    for each of the L layers: S serving slots + 1 scratch slot, M = max_len
                                 ┌──────────── M positions ────────────┐
    slot 0   │ t0 t1 t2 t3 ... t(len0-1) │ stale / empty ............ │
    slot 1   │ t0 t1 ... t(len1-1)      │ stale ..................... │
    ...
    slot S   │ scratch: padded batch rows write here, never read as history │

    lengths[S+1]  committed tokens per slot; positions ≥ length are garbage.

On a mesh the engine pads the slot rows to S' (a multiple of the `data` axis; the extra rows are never
used) and splits them over `data` (docs/design.md, "Sharding").

A forward of T tokens for row b writes positions [start_b, start_b + T) of its slot; accepting
only some of them is just setting `lengths[slot]` (no copy). Attention reads a static window
`[0, W)` of each row's slot and masks by length and the intra-step mask, never by "non-zero".

Why one buffer per layer: each layer writes its new k/v and then reads its window from the
same buffer, so XLA updates every buffer in place. With one stacked [L, ...] buffer XLA had to
copy the whole cache (every layer's reads and writes alias one array): measured 15x slower.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxspec.models.config import ModelConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Keys/values for every slot, plus each slot's committed length."""

    k: tuple[jax.Array, ...]  # L x [S+1, M, G, H]
    v: tuple[jax.Array, ...]  # L x [S+1, M, G, H]
    lengths: jax.Array  # [S+1] int32

    @property
    def max_len(self) -> int:
        return self.k[0].shape[1]

    def with_lengths(self, slot_ids: jax.Array, new_lengths: jax.Array) -> KVCache:
        """Set `lengths[slot_ids] = new_lengths` (commit or roll back; no KV copy)."""
        # lengths: [S+1]; slot_ids, new_lengths: [B]
        return dataclasses.replace(self, lengths=self.lengths.at[slot_ids].set(new_lengths))


def init_cache(config: ModelConfig, num_slots: int, max_len: int, dtype=None) -> KVCache:
    """An empty cache with `num_slots` slots (+1 scratch) of `max_len` positions each."""
    dtype = jnp.dtype(dtype or config.dtype)
    shape = (num_slots + 1, max_len, config.num_kv_heads, config.head_dim)
    return KVCache(
        k=tuple(jnp.zeros(shape, dtype) for _ in range(config.num_layers)),
        v=tuple(jnp.zeros(shape, dtype) for _ in range(config.num_layers)),
        lengths=jnp.zeros((num_slots + 1,), jnp.int32),
    )


def cache_bytes(config: ModelConfig, num_slots: int, max_len: int) -> int:
    """Device bytes a cache of this size needs (keys + values)."""
    itemsize = jnp.dtype(config.dtype).itemsize
    return 2 * config.num_layers * (num_slots + 1) * max_len * config.num_kv_heads * config.head_dim * itemsize
