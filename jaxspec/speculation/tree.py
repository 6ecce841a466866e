"""Token trees inside a static envelope (docs/design.md, "Token trees").

A step over a tree scores T = k + 1 tokens per row in one target pass: the row's pending token (the
root, node 0) and the k proposed nodes of a `TreeProposals` (node i is column i). Node i is written
to cache position start + i and rotated at position start + depth_i; it attends to the committed
history and to its own ancestors (and itself). For the tree

    root ── a(1) ── b(2) ── c(4)
        └── d(3)

    depth  = [0, 1, 2, 1, 3]
    mask   =      r a b d c        (row t may attend column u)
              r   x . . . .
              a   x x . . .
              b   x x x . .
              d   x . . x .
              c   x x x . x

After verification the accepted root path (e.g. root, a, b) is moved to the positions a chain would
have used (start, start + 1, start + 2: `compact`), so the next step finds a plain contiguous cache.
A chain is the tree whose node i has parent i − 1.

Dimension names as everywhere (docs/design.md): B rows, k nodes, T = k + 1 tokens per row, Z the depth.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxspec.models.kv_cache import KVCache, PagedKVCache, page_slots
from jaxspec.models.llama import StepInputs
from jaxspec.types import TreeProposals


def with_root(proposals: TreeProposals, valid: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(tokens, parents, depth), each [B, T]: the root (column 0: token -1, its own parent, depth 0)
    then the k nodes; invalid nodes get token -1, which no drawn token equals."""
    b = proposals.token_ids.shape[0]
    zeros = jnp.zeros((b, 1), jnp.int32)
    tokens = jnp.concatenate([zeros - 1, jnp.where(valid, proposals.token_ids, -1)], axis=1)  # [B, T]
    parents = jnp.concatenate([zeros, proposals.parents], axis=1)  # [B, T]
    depth = jnp.concatenate([zeros, proposals.depth], axis=1)  # [B, T]
    return tokens, parents, depth


def ancestor_mask(parents: jax.Array, max_depth: int) -> jax.Array:
    """mask [B, T, T]: mask[b, t, u] iff u is t or an ancestor of t (parents [B, T], root = its own parent)."""
    b, t = parents.shape
    node = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))  # [B, T] walks up from every node
    mask = jnp.broadcast_to(jnp.eye(t, dtype=bool), (b, t, t))
    for _ in range(max_depth):
        node = jnp.take_along_axis(parents, node, axis=1)  # [B, T] one level up (the root stays)
        mask = mask | jax.nn.one_hot(node, t, dtype=bool)  # [B, T, T]
    return mask


def tree_inputs(pending: jax.Array, rooted: tuple[jax.Array, jax.Array, jax.Array], slot_ids: jax.Array,
                start: jax.Array, max_depth: int, block_table: jax.Array | None = None) -> StepInputs:
    """The target's StepInputs for one tree step from `with_root`'s (tokens, parents, depth): tokens
    [B, T] = pending then the nodes (invalid ones as token 0: scored, never accepted), RoPE offsets =
    depth, the ancestor mask."""
    tokens, parents, depth = rooted
    tokens = jnp.concatenate([pending[:, None], jnp.maximum(tokens[:, 1:], 0)], axis=1)  # [B, T]
    return StepInputs(tokens, slot_ids, start, depth, ancestor_mask(parents, max_depth), block_table)


def root_path(accepted: jax.Array, parents: jax.Array, depth: jax.Array, max_depth: int) -> tuple[jax.Array, jax.Array]:
    """(deepest, path): the deepest accepted node [B] (the lowest index among equals) and the node at
    each depth on its root path, path [B, Z + 1] (column j > depth(deepest) holds j: compaction leaves
    those positions alone). accepted, parents, depth: [B, T]."""
    b, t = accepted.shape
    index = jnp.arange(t, dtype=jnp.int32)[None, :]
    score = jnp.where(accepted, depth * (t + 1) + (t - index), -1)  # [B, T] deepest first, then lowest index
    deepest = jnp.argmax(score, axis=1).astype(jnp.int32)  # [B]
    path = jnp.broadcast_to(jnp.arange(max_depth + 1, dtype=jnp.int32), (b, max_depth + 1))  # [B, Z+1]
    rows = jnp.arange(b)
    node = deepest
    for _ in range(max_depth + 1):
        path = path.at[rows, depth[rows, node]].set(node)  # the root's own parent is itself: rewrites column 0
        node = parents[rows, node]
    return deepest, path


def compact(cache: KVCache | PagedKVCache, slot_ids: jax.Array, start: jax.Array, path: jax.Array,
            block_table: jax.Array | None = None) -> KVCache | PagedKVCache:
    """Move the keys and values of each row's accepted path (nodes path [B, Z+1], written at start + node)
    to start + depth, where the next step expects them, in every layer (lengths are not changed). A paged cache
    needs the rows' `block_table` [B, ceil(W/X)]."""
    src = start[:, None] + path  # [B, Z+1] positions the nodes were written at
    dst = start[:, None] + jnp.arange(path.shape[1], dtype=jnp.int32)[None, :]  # [B, Z+1]
    if isinstance(cache, PagedKVCache):  # (page, offset) [B, Z+1] each, in the pool [I, X, G, H]
        last = block_table.shape[1] * cache.page_size - 1  # the last position the table holds
        src_at = page_slots(block_table, jnp.minimum(src, last), cache.page_size)
        dst_at = page_slots(block_table, dst, cache.page_size)
    else:  # (slot [B, 1], position [B, Z+1]) in [S+1, M, G, H]
        slots = slot_ids[:, None]  # [B, 1]
        src_at = (slots, jnp.minimum(src, cache.max_len - 1))
        dst_at = (slots, dst)

    def move(buffer):
        rows = buffer[src_at]  # [B, Z+1, G, H]
        return buffer.at[dst_at].set(rows, mode="drop")

    return dataclasses.replace(cache, k=tuple(move(x) for x in cache.k), v=tuple(move(x) for x in cache.v))

