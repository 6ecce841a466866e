"""KV caches (docs/design.md, "The KV cache"): the target's paged cache and a draft's per-slot cache.

The target's cache is paged (`PagedKVCache`): per layer a pool of pages [I, X, G, H] and, per step, a block
table [B, ceil(W/X)] naming the page that holds each run of X window positions of a row::

    block_table[b]:  [ 7 | 2 | 9 | 0 ... ]        pool k[l]: [I, X, G, H]
    positions:        0..X-1, X..2X-1, ...      page 0 is scratch: padded rows write there, and
                                                   table entries past a row's pages name it (never attended)

Position w of row b is page block_table[b, w // X], offset w % X (`page_slots`). Pages are handed out by the
host (jaxspec.engine.pages); a page of a cached prompt prefix is named by the tables of every request that shares
it. Attention reads the pages in place (the XLA:CPU kernel, the Pallas kernel) or gathers the window
(`gather_window`, the XLA form).

A draft model's cache stays per slot (`KVCache`): it is small, and it catches up from the history
(docs/design.md, "Prefix caching"). Its layout (one array per layer for keys, one for values)::

    k[l]: [S+1, M, G, H]    for each of the L layers: S serving slots + 1 scratch slot, M = max_len
                                 ┌──────────── M positions ────────────┐
    slot 0   │ t0 t1 t2 t3 ... t(len0-1) │ stale / empty ............ │
    slot 1   │ t0 t1 ... t(len1-1)      │ stale ..................... │
    ...
    slot S   │ scratch: padded batch rows write here, never read as history │

    lengths[S+1]  committed tokens per slot; positions ≥ length are garbage.

On a mesh the engine pads the slot rows (and the target's pages) to a multiple of the `data` axis (the extra
rows are never used) and splits them over `data` (docs/design.md, "Sharding").

A forward of T tokens for row b writes positions [start_b, start_b + T) of its slot (its pages); accepting
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
import numpy as np

from jaxspec.models.config import ModelConfig

SCRATCH_PAGE = 0  # the page padded rows write and unused table entries name


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedKVCache:
    """The target's keys/values in pages, plus each slot's committed length (the block tables live on the host
    and come with every call: `StepInputs.block_table`)."""

    k: tuple[jax.Array, ...]  # L x [I, X, G, H]
    v: tuple[jax.Array, ...]  # L x [I, X, G, H]
    lengths: jax.Array  # [S+1] int32

    @property
    def page_size(self) -> int:
        return self.k[0].shape[1]

    @property
    def num_pages(self) -> int:
        return self.k[0].shape[0]

    def with_lengths(self, slot_ids: jax.Array, new_lengths: jax.Array) -> PagedKVCache:
        """Set `lengths[slot_ids] = new_lengths` (commit or roll back; no KV copy)."""
        # lengths: [S+1]; slot_ids, new_lengths: [B]
        return dataclasses.replace(self, lengths=self.lengths.at[slot_ids].set(new_lengths))


# the page of a position past a row's block table: out of every pool's range, so a write there (mode="drop") is
# dropped, as a per-slot cache drops writes past max_len (a capped row of a step writes up to k_run + 1 positions)
PAST_TABLE_PAGE = int(np.iinfo(np.int32).max)


def page_slots(block_table: jax.Array, positions: jax.Array, page_size: int) -> tuple[jax.Array, jax.Array]:
    """Where positions [B, Y] of each row lie in the pool: (page [B, Y], offset [B, Y]) by its block table
    [B, ceil(W/X)]; a position past the table gets `PAST_TABLE_PAGE` (write with mode="drop")."""
    column = positions // page_size  # [B, Y]
    inside = column < block_table.shape[1]  # [B, Y]
    page = jnp.take_along_axis(block_table, jnp.clip(column, 0, block_table.shape[1] - 1), axis=1)  # [B, Y]
    return jnp.where(inside, page, PAST_TABLE_PAGE), positions % page_size


def gather_window(pages: jax.Array, block_table: jax.Array, window: int) -> jax.Array:
    """Positions [0, W) of each row, gathered from the pool: pages [I, X, G, H], block_table [B, ceil(W/X)]
    -> [B, W, G, H] (the XLA attention form; the kernels read the pages in place)."""
    b = block_table.shape[0]
    positions = jnp.broadcast_to(jnp.arange(window, dtype=jnp.int32), (b, window))  # [B, W]
    page, offset = page_slots(block_table, positions, pages.shape[1])  # [B, W], [B, W]
    return pages[page, offset]  # [B, W, G, H]


def init_paged_cache(config: ModelConfig, num_pages: int, page_size: int, num_slots: int,
                     dtype=None) -> PagedKVCache:
    """An empty paged cache: `num_pages` pages (page 0 is scratch) of `page_size` positions, lengths for
    `num_slots` slots (+1 scratch)."""
    dtype = jnp.dtype(dtype or config.dtype)
    shape = (num_pages, page_size, config.num_kv_heads, config.head_dim)
    return PagedKVCache(
        k=tuple(jnp.zeros(shape, dtype) for _ in range(config.num_layers)),
        v=tuple(jnp.zeros(shape, dtype) for _ in range(config.num_layers)),
        lengths=jnp.zeros((num_slots + 1,), jnp.int32),
    )


def paged_cache_bytes(config: ModelConfig, num_pages: int, page_size: int) -> int:
    """Device bytes a paged cache of this size needs (keys + values)."""
    itemsize = jnp.dtype(config.dtype).itemsize
    return 2 * config.num_layers * num_pages * page_size * config.num_kv_heads * config.head_dim * itemsize


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """A draft's per-slot cache: keys/values for every slot, plus each slot's committed length."""

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
