"""Prompt lookup (n-gram) proposer: copy what followed the latest earlier occurrence of the
context's last n tokens. Batched on device; proposals are point masses (no [B, k, V] one-hots).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jaxspec.proposers.base import Proposer, StepContext
from jaxspec.types import Proposals


@dataclasses.dataclass(frozen=True, eq=True)
class PromptLookupProposer(Proposer):
    """Longest n first (max_ngram down to min_ngram), most recent match first."""

    min_ngram: int = 1
    max_ngram: int = 3
    name: str = "ngram"

    def __post_init__(self):
        if not (1 <= self.min_ngram <= self.max_ngram):
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {self.min_ngram}, {self.max_ngram}")

    def propose(self, params, state, ctx: StepContext, k: int, window: int):
        hist = ctx.history[ctx.slot_ids]  # [B, M]
        b, m = hist.shape
        cur = ctx.start + 1  # [B] valid tokens: history[0 .. start] (pending included)
        best_pos = jnp.full((b,), -1, jnp.int32)  # continuation start of the chosen match
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
            valid = match & (j + n < cur[:, None]) & (cur[:, None] >= n + 1)
            latest = jnp.max(jnp.where(valid, j, -1), axis=1)  # [B] most recent window start
            found = (latest >= 0) & (best_pos < 0)
            best_pos = jnp.where(found, latest + n, best_pos)
        # proposals: [B, k] = hist[b, best_pos + i]
        idx = jnp.clip(best_pos[:, None] + jnp.arange(k)[None, :], 0, m - 1)
        tokens = jnp.take_along_axis(hist, idx, axis=1)
        lens = jnp.where(best_pos >= 0, jnp.minimum(k, cur - best_pos), 0).astype(jnp.int32)
        return Proposals(token_ids=tokens.astype(jnp.int32), lens=lens, draft_probs=None), state
