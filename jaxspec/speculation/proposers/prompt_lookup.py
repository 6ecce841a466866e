"""Prompt lookup (n-gram) proposer: copy what followed the latest earlier occurrence of the
context's last n tokens. Batched on device; proposals are point masses (no [B, k, V] one-hots).

As a token tree (`propose_tree`): the continuations of several earlier occurrences (longest n
first, most recent first, one per distinct continuation start) merged into a trie of at most k
nodes, each continuation at most Z tokens long (Y continuations, Q match candidates: docs/design.md,
"Dimension names").
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from jaxspec.menu import TreeEnvelope
from jaxspec.speculation.proposers.base import Proposer, StepContext
from jaxspec.types import Proposals, TreeProposals


@dataclasses.dataclass(frozen=True, eq=True)
class PromptLookupProposer(Proposer):
    """Longest n first (max_ngram down to min_ngram), most recent match first."""

    min_ngram: int = 1
    max_ngram: int = 3
    name: str = "ngram"
    builds_trees: ClassVar[bool] = True

    def __post_init__(self):
        if not (1 <= self.min_ngram <= self.max_ngram):
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {self.min_ngram}, {self.max_ngram}")

    def _matches(self, hist: jax.Array, cur: jax.Array):
        """For n = max_ngram down to min_ngram: (n, valid [B, M - n + 1]) where valid[b, j] says that
        hist[b, j : j + n] equals the row's last n tokens and ends before that suffix's last token."""
        b, m = hist.shape
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            # suffix: [B, n] = the last n tokens of each row
            suffix_idx = jnp.clip(cur[:, None] - n + jnp.arange(n)[None, :], 0, m - 1)
            suffix = jnp.take_along_axis(hist, suffix_idx, axis=1)
            # match[b, j]: hist[b, j:j+n] == suffix[b]   for window starts j in [0, M-n]
            match = jnp.ones((b, m - n + 1), bool)
            for i in range(n):
                match &= hist[:, i: m - n + 1 + i] == suffix[:, i: i + 1]
            j = jnp.arange(m - n + 1, dtype=jnp.int32)[None, :]
            # the occurrence must end before the suffix starts its own last token: j + n < cur
            yield n, match & (j + n < cur[:, None]) & (cur[:, None] >= n + 1)

    def propose(self, params, state, ctx: StepContext, k: int, window: int):
        hist = ctx.history[ctx.slot_ids]  # [B, M]
        b, m = hist.shape
        cur = ctx.start + 1  # [B] valid tokens: history[0 .. start] (pending included)
        best_pos = jnp.full((b,), -1, jnp.int32)  # continuation start of the chosen match
        for n, valid in self._matches(hist, cur):
            j = jnp.arange(valid.shape[1], dtype=jnp.int32)[None, :]
            latest = jnp.max(jnp.where(valid, j, -1), axis=1)  # [B] most recent window start
            found = (latest >= 0) & (best_pos < 0)
            best_pos = jnp.where(found, latest + n, best_pos)
        # proposals: [B, k] = hist[b, best_pos + i]
        idx = jnp.clip(best_pos[:, None] + jnp.arange(k)[None, :], 0, m - 1)
        tokens = jnp.take_along_axis(hist, idx, axis=1)
        lens = jnp.where(best_pos >= 0, jnp.minimum(k, cur - best_pos), 0).astype(jnp.int32)
        return Proposals(token_ids=tokens.astype(jnp.int32), lens=lens, draft_probs=None), state

    def propose_tree(self, params, state, ctx: StepContext, tree: TreeEnvelope, window: int):
        """The trie of up to Y = ceil(k / Z) + 2 continuations (see the module doc), nodes numbered
        continuation by continuation (the preferred one first, so its path is the chain `propose`
        would give), each continuation's new nodes by depth; a node's parent always comes first."""
        hist = ctx.history[ctx.slot_ids]  # [B, M]
        b, m = hist.shape
        n_nodes, d = tree.nodes, tree.depth
        c = -(-n_nodes // d) + 2
        cur = ctx.start + 1  # [B] valid tokens: history[0 .. start] (pending included)
        starts = []  # continuation starts in preference order: [B, Y] per n
        for n, valid in self._matches(hist, cur):
            j = jnp.arange(valid.shape[1], dtype=jnp.int32)[None, :]
            latest = jax.lax.top_k(jnp.where(valid, j, -1), min(c, valid.shape[1]))[0]  # [B, Y] most recent first
            starts.append(jnp.where(latest >= 0, latest + n, -1))
        starts = jnp.concatenate(starts, axis=1)  # [B, Q]
        n_starts = starts.shape[1]
        # a match of n tokens at j is one of n - 1 at j + 1 too: keep each continuation start once
        earlier = jnp.tril(jnp.ones((n_starts, n_starts), bool), -1)  # [Q, Q] earlier[i, i'] iff i' < i
        repeated = jnp.any((starts[:, :, None] == starts[:, None, :]) & earlier[None], axis=2)  # [B, Q]
        keep = (starts >= 0) & ~repeated
        rank = jnp.where(keep, 0, n_starts) + jnp.arange(n_starts)[None, :]  # kept ones first, in order
        order = jnp.argsort(rank, axis=1)[:, :c]  # [B, Y]
        cand = jnp.take_along_axis(starts, order, axis=1)  # [B, Y]
        cand_ok = jnp.take_along_axis(keep, order, axis=1)  # [B, Y]
        # continuations: cont [B, Y, Z] = hist[b, cand + e], real while committed (pending included)
        pos = cand[:, :, None] + jnp.arange(d)[None, None, :]  # [B, Y, Z]
        ok = cand_ok[:, :, None] & (pos < cur[:, None, None])  # [B, Y, Z], a prefix per continuation
        cont = jnp.take_along_axis(hist, jnp.clip(pos, 0, m - 1).reshape(b, c * d), axis=1).reshape(b, c, d)
        # owner[b, c, e]: the first continuation sharing c's first e + 1 tokens (c itself where ok)
        same = (cont[:, :, None, :] == cont[:, None, :, :]) & ok[:, :, None, :] & ok[:, None, :, :]  # [B, Y, Y', Z]
        same_prefix = jnp.cumprod(same.astype(jnp.int32), axis=3) > 0  # [B, Y, Y', Z]
        owner = jnp.argmax(same_prefix, axis=2).astype(jnp.int32)  # [B, Y, Z]
        new_node = ok & (owner == jnp.arange(c)[None, :, None])  # [B, Y, Z] a trie node first seen here
        index = jnp.cumsum(new_node.reshape(b, c * d), axis=1).reshape(b, c, d) - 1  # [B, Y, Z] node number
        kept = new_node & (index < n_nodes)
        node_id = jnp.where(kept, index + 1, 0)  # [B, Y, Z] 1-based id in the step's numbering
        # parent of (c, e >= 1): the node of (owner(c, e - 1), e - 1); of (c, 0): the root
        parent = jnp.take_along_axis(node_id[:, :, :-1], owner[:, :, :-1], axis=1)  # [B, Y, Z-1]
        parent = jnp.concatenate([jnp.zeros((b, c, 1), jnp.int32), parent], axis=2)  # [B, Y, Z]
        depth = jnp.broadcast_to(jnp.arange(1, d + 1, dtype=jnp.int32), (b, c, d))
        target = jnp.where(kept, index, n_nodes).reshape(b, c * d)  # [B, Y·Z]; n_nodes = dropped
        rows = jnp.arange(b)[:, None]

        def scatter(values):  # [B, Y, Z] -> [B, k]
            return jnp.zeros((b, n_nodes), jnp.int32).at[rows, target].set(values.reshape(b, c * d), mode="drop")

        lens = jnp.minimum(jnp.sum(new_node, axis=(1, 2)), n_nodes).astype(jnp.int32)
        return TreeProposals(token_ids=scatter(cont), parents=scatter(parent), depth=scatter(depth),
                             lens=lens), state
