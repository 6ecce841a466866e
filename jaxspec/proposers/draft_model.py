"""Draft-model proposer: a small Llama with its own KV cache, k draft steps in one call.

Keeping the draft cache in sync (docs/design.md, "The speculative step": lazy draft catch-up): steps with
k = 0 do not touch the draft (they cost exactly plain decoding). A speculating step first feeds
the draft what the target committed since the draft last saw it, through the pending token.
After a k > 0 step at most one committed token is missing (the last accepted proposal when all
k were accepted), so the in-step catch-up is a fixed chunk of width 2 with a per-row count; the
engine brings longer lags (after k = 0 steps) down to that with bucketed catch-up calls first.

    target:  ... t(s-1) | pending(s)                    committed length s
    draft:   ... t(dl-1)                                draft length dl ∈ {s-1, s}
    chunk:   history[dl], history[dl+1]   (count c = s - dl + 1 ∈ {1, 2})
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxspec import sampling
from jaxspec.proposers.base import Proposer, StepContext
from jaxspec.types import Proposals
from models.kv_cache import KVCache, init_cache
from models.llama import Llama, ServingParams, StepInputs, chain_inputs, serving_split
from models.sharding import Placement

CATCH_UP = 2  # tokens fed to the draft at the start of every step


class DraftModelProposer(Proposer):
    """Samples k tokens autoregressively from a draft model (warped like the target)."""

    tracks_context = True
    in_step_catch_up = CATCH_UP

    def __init__(self, draft: Llama, name: str = "draft"):
        self.name = name
        self.config = draft.config
        self.draft = draft
        self.graphdef = nnx.graphdef(draft)

    def params(self, placement: Placement = Placement()) -> ServingParams:
        """Per-layer weights read in place, like the target's (a draft with many layers would otherwise
        copy every stacked slice on every draft forward); replicated over the mesh by the engine."""
        return serving_split(self.draft, placement)[1]

    def init_state(self, num_slots: int, max_len: int) -> KVCache:
        return init_cache(self.config, num_slots, max_len)

    def _model(self, params: ServingParams) -> tuple[Llama, tuple[dict, ...]]:
        return nnx.merge(self.graphdef, params[0]), params[1]

    def prefill(self, params, state: KVCache, inputs: StepInputs, n_valid, window):
        draft, layers = self._model(params)
        _, state = draft.forward_cached(inputs, state, window, logits_at=(n_valid - 1)[:, None], layers=layers)
        return state.with_lengths(inputs.slot_ids, inputs.start + n_valid)

    def _catch_up(self, draft: Llama, layers, state: KVCache, ctx: StepContext, window: int):
        """Feed the missing committed tokens and the pending one. Returns logits [B, V] after
        the pending token and the cache (draft length is then start + 1)."""
        dl = state.lengths[ctx.slot_ids]  # [B]
        m = ctx.history.shape[1]
        # chunk: [B, 2] = history[slot, dl + {0, 1}]
        idx = jnp.clip(dl[:, None] + jnp.arange(CATCH_UP)[None, :], 0, m - 1)
        chunk = ctx.history[ctx.slot_ids[:, None], idx]
        count = ctx.start - dl + 1  # [B] ∈ {1, 2}
        logits, state = draft.forward_cached(chain_inputs(chunk, ctx.slot_ids, dl), state, window,
                                             logits_at=(count - 1)[:, None], layers=layers)
        return logits[:, 0, :], state

    def propose(self, params, state: KVCache, ctx: StepContext, k: int, window: int,
                perturb: Callable[[jax.Array, jax.Array], jax.Array] | None = None):
        """k draft tokens per row. `perturb(token [B], i) -> token [B]`, if given, replaces the
        i-th drawn token before the draft continues from it (and before it is proposed), so the
        draft cache holds exactly the proposed chain; the probabilities are those it was drawn from."""
        draft, layers = self._model(params)
        logits, state = self._catch_up(draft, layers, state, ctx, window)  # logits: [B, V]

        def draw(logits, i):
            # token: [B] drawn from q = warp(logits) [B, V]
            token, q = sampling.draw(logits, ctx.rows, sampling.subkeys(ctx.rows.keys, i))
            return (token if perturb is None else perturb(token, i)), q

        first, q_first = draw(logits, 0)

        def step(carry, i):
            state, token = carry
            # feed d_i at position start + i, draw d_{i+1}
            inputs = chain_inputs(token[:, None], ctx.slot_ids, ctx.start + i)
            logits, state = draft.forward_cached(inputs, state, window, layers=layers)  # [B, 1, V]
            nxt, q = draw(logits[:, 0, :], i)
            return (state, nxt), (nxt, q)

        (state, _), (rest, q_rest) = jax.lax.scan(step, (state, first), jnp.arange(1, k, dtype=jnp.int32))
        # tokens: [B, k]; probs: [B, k, V]
        tokens = jnp.concatenate([first[:, None], jnp.moveaxis(rest, 0, 1)], axis=1)
        probs = jnp.concatenate([q_first[:, None, :], jnp.moveaxis(q_rest, 0, 1)], axis=1)
        lens = jnp.full(ctx.slot_ids.shape, k, jnp.int32)
        return Proposals(token_ids=tokens, lens=lens, draft_probs=probs), state

    def commit(self, params, state: KVCache, ctx: StepContext, k: int, n_accepted: jax.Array, window: int) -> KVCache:
        # The draft holds pending + d_1..d_{k-1}; keep what the target accepted (k > 0 only).
        valid = ctx.start + 1 + jnp.minimum(n_accepted, k - 1)  # [B]
        return state.with_lengths(ctx.slot_ids, valid)
