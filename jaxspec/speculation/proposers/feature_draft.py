"""Feature-draft proposer (EAGLE-style, docs/design.md "The feature draft"): drafts from the target's own features.

Device state per slot: the draft's KV cache and the target's features of every committed position
(`FeatureDraftState.features`, written by the engine from each call's target pass through `record_features`,
k = 0 steps included). The draft's entry at position p fuses token p with the feature of p-1
(jaxspec/models/feature_draft.py), so the cache never needs the target to run again:

    committed length s, pending token t_s;  draft length dl = s (entries 0..s-1, all on real features)
    propose:  entry s      = (t_s,     f_{s-1})   -> predicted feature g_s     -> d_1
              entry s+i    = (d_i,     g_{s+i-1}) -> g_{s+i}                    -> d_{i+1}   (i = 1..k-1)
    commit:   entries s+1..s+k rewritten from the real features f_s..f_{s+k-1} of this step's target pass
              (tokens d_1..d_k); the first n_accepted are kept: draft length s + 1 + n_accepted = the new s

After k = 0 steps the draft lags; the engine's catch-up calls feed the missed history through `prefill`,
which reads the stored features (lazy catch-up, as for the token draft).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxspec.models.feature_draft import FeatureDraft
from jaxspec.models.kv_cache import KVCache, init_cache
from jaxspec.models.llama import ServingParams, StepInputs, chain_inputs, serving_split
from jaxspec.models.sharding import Placement
from jaxspec.speculation import sampling
from jaxspec.speculation.proposers.base import Proposer, StepContext
from jaxspec.types import Proposals


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FeatureDraftState:
    """cache: the draft's KV cache (lengths = entries on real features).
    features: [S+1, M, n·D] the target's feature (hidden states after the draft's n feature layers) after every
              committed position of every slot."""

    cache: KVCache
    features: jax.Array


class FeatureDraftProposer(Proposer):
    """Samples k tokens from a feature draft (warped like the target), reading the target's features."""

    tracks_context = True
    in_step_catch_up = 1  # propose feeds the pending token itself

    def __init__(self, draft: FeatureDraft, name: str = "feature"):
        self.name = name
        self.feature_layers = draft.feature_layers
        self.config = draft.config
        self.draft = draft
        self.graphdef = nnx.graphdef(draft)

    def params(self, placement: Placement = Placement()) -> ServingParams:
        return serving_split(self.draft, placement)[1]

    def init_state(self, num_slots: int, max_len: int) -> FeatureDraftState:
        c = self.config
        return FeatureDraftState(cache=init_cache(c, num_slots, max_len),
                                 features=jnp.zeros((num_slots + 1, max_len, self.draft.feature_width),
                                                    jnp.dtype(c.dtype)))

    def _model(self, params: ServingParams) -> tuple[FeatureDraft, tuple[dict, ...]]:
        return nnx.merge(self.graphdef, params[0]), params[1]

    @staticmethod
    def _previous_features(state: FeatureDraftState, slot_ids: jax.Array, positions: jax.Array) -> jax.Array:
        """features of positions - 1 (zeros before position 0): positions [B, T] -> [B, T, n·D]."""
        m = state.features.shape[1]
        prev = positions - 1  # [B, T]
        feats = state.features[slot_ids[:, None], jnp.clip(prev, 0, m - 1)]  # [B, T, n·D]
        return jnp.where((prev >= 0)[..., None], feats, jnp.zeros_like(feats))

    def record_features(self, state: FeatureDraftState, slot_ids, start, features) -> FeatureDraftState:
        # features: [B, T, n·D] of the target's tokens at start .. start+T-1 -> buffer [S+1, M, n·D]
        positions = start[:, None] + jnp.arange(features.shape[1], dtype=jnp.int32)[None, :]  # [B, T]
        buffer = state.features.at[slot_ids[:, None], positions].set(features.astype(state.features.dtype),
                                                                      mode="drop")
        return dataclasses.replace(state, features=buffer)

    def context_lengths(self, state: FeatureDraftState, slot_ids: jax.Array) -> jax.Array:
        return state.cache.lengths[slot_ids]  # [B]

    def forget(self, state: FeatureDraftState, slot_ids: jax.Array) -> FeatureDraftState:
        empty = jnp.zeros(slot_ids.shape, jnp.int32)  # [B]
        return dataclasses.replace(state, cache=state.cache.with_lengths(slot_ids, empty))

    def prefill(self, params, state: FeatureDraftState, inputs: StepInputs, n_valid, window):
        """Entries start..start+T-1 from committed tokens and the stored features (no target pass)."""
        draft, layers = self._model(params)
        positions = inputs.start[:, None] + inputs.depth  # [B, T]
        _, cache = draft.forward_features(inputs, self._previous_features(state, inputs.slot_ids, positions),
                                          state.cache, window, layers=layers, kernels=self.kernels)
        return dataclasses.replace(state, cache=cache.with_lengths(inputs.slot_ids, inputs.start + n_valid))

    def propose(self, params, state: FeatureDraftState, ctx: StepContext, k: int, window: int,
                perturb: Callable[[jax.Array, jax.Array], jax.Array] | None = None):
        """k draft tokens per row (`perturb` as in `DraftModelProposer.propose`)."""
        draft, layers = self._model(params)
        pending = ctx.history[ctx.slot_ids, ctx.start]  # [B]
        # entry s: the pending token with the target's feature of s-1
        prev = self._previous_features(state, ctx.slot_ids, ctx.start[:, None])  # [B, 1, n·D]
        feature, cache = draft.forward_features(chain_inputs(pending[:, None], ctx.slot_ids, ctx.start), prev,
                                                state.cache, window, layers=layers, kernels=self.kernels)  # [B, 1, D]

        def draw(feature, i):
            # token: [B] drawn from q = warp(unembed(feature)) [B, V]
            token, q = sampling.draw(draft.unembed(feature)[:, 0, :], ctx.rows, sampling.subkeys(ctx.rows.keys, i))
            return (token if perturb is None else perturb(token, i)), q

        first, q_first = draw(feature, 0)

        def step(carry, i):
            cache, token, feature = carry
            # entry s+i: d_i with the draft's own predicted feature of s+i-1; draw d_{i+1}
            inputs = chain_inputs(token[:, None], ctx.slot_ids, ctx.start + i)
            feature, cache = draft.forward_features(inputs, feature, cache, window, layers=layers,
                                                    kernels=self.kernels)  # [B, 1, D]
            nxt, q = draw(feature, i)
            return (cache, nxt, feature), (nxt, q)

        (cache, _, _), (rest, q_rest) = jax.lax.scan(step, (cache, first, feature), jnp.arange(1, k, dtype=jnp.int32))
        # tokens: [B, k]; probs: [B, k, V]
        tokens = jnp.concatenate([first[:, None], jnp.moveaxis(rest, 0, 1)], axis=1)
        probs = jnp.concatenate([q_first[:, None, :], jnp.moveaxis(q_rest, 0, 1)], axis=1)
        lens = jnp.full(ctx.slot_ids.shape, k, jnp.int32)
        return Proposals(token_ids=tokens, lens=lens, draft_probs=probs), dataclasses.replace(state, cache=cache)

    def commit(self, params, state: FeatureDraftState, ctx: StepContext, k: int, n_accepted: jax.Array,
               window: int) -> FeatureDraftState:
        """Rewrite entries s+1..s+k from this step's real features (ctx.history holds the step's tokens);
        keep the accepted ones."""
        draft, layers = self._model(params)
        hist_pos = ctx.start[:, None] + 1 + jnp.arange(k, dtype=jnp.int32)[None, :]  # [B, k]
        m = ctx.history.shape[1]
        tokens = ctx.history[ctx.slot_ids[:, None], jnp.clip(hist_pos, 0, m - 1)]  # [B, k]
        inputs = chain_inputs(tokens, ctx.slot_ids, ctx.start + 1)
        _, cache = draft.forward_features(inputs, self._previous_features(state, ctx.slot_ids, hist_pos),
                                          state.cache, window, layers=layers, kernels=self.kernels)
        return dataclasses.replace(state, cache=cache.with_lengths(ctx.slot_ids, ctx.start + 1 + n_accepted))
