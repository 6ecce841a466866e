"""A proposer of controlled acceptance for tests and benchmarks.

Wraps another proposer (typically the target as its own draft, acceptance 1 at temperature 0)
and replaces each proposal, independently with probability 1 − α, by a different token. At
temperature 0 with a perfect inner proposer, each proposal is then accepted with probability α.
Replaced proposals become point masses (draft_probs = None), which keeps verification exact.

A draft model is perturbed inside its own autoregressive loop: it continues from the replaced
token, so its cache holds the chain that was proposed, and after the commit (which keeps the
accepted prefix) exactly the committed history, as an unperturbed draft's would. Replacing the
tokens afterwards would leave the draft's own tokens in its cache wherever a replacement was
accepted (under sampling a replacement is accepted with probability p(token)), and the draft
would go on proposing from a history that never happened.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxspec.speculation.proposers.base import Proposer, StepContext
from jaxspec.speculation.proposers.draft_model import DraftModelProposer
from jaxspec.speculation.proposers.feature_draft import FeatureDraftProposer
from jaxspec.types import Proposals

_NOISE_KEY = 2_000_003


class NoisyProposer(Proposer):
    """`inner`'s proposals, each kept with probability `alpha`, else shifted to another token."""

    def __init__(self, inner: Proposer, alpha: float, vocab_size: int):
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {alpha}")
        if inner.tracks_context and not isinstance(inner, DraftModelProposer | FeatureDraftProposer):
            raise TypeError(f"NoisyProposer cannot keep the state of {type(inner).__name__} equal to the history: "
                            f"only a draft-model or feature-draft proposer (or a stateless one) can be wrapped")
        self.inner, self.alpha, self.vocab_size = inner, float(alpha), vocab_size
        self.name = f"noisy({inner.name},{alpha:g})"
        self.config = getattr(inner, "config", None)
        self.tracks_context, self.in_step_catch_up = inner.tracks_context, inner.in_step_catch_up
        self.feature_layers = inner.feature_layers

    def with_kernels(self, plan):
        clone = super().with_kernels(plan)
        object.__setattr__(clone, "inner", self.inner.with_kernels(plan))
        return clone

    def init_state(self, num_slots, max_len):
        return self.inner.init_state(num_slots, max_len)

    def params(self, placement=None):
        return self.inner.params() if placement is None else self.inner.params(placement)

    def prefill(self, params, state, inputs, n_valid, window):
        return self.inner.prefill(params, state, inputs, n_valid, window)

    def record_features(self, state, slot_ids, start, features):
        return self.inner.record_features(state, slot_ids, start, features)

    def context_lengths(self, state, slot_ids):
        return self.inner.context_lengths(state, slot_ids)

    def forget(self, state, slot_ids):
        return self.inner.forget(state, slot_ids)

    def commit(self, params, state, ctx, k, n_accepted, window):
        return self.inner.commit(params, state, ctx, k, n_accepted, window)

    def propose(self, params, state, ctx: StepContext, k: int, window: int):
        keys = jax.vmap(lambda key: jax.random.fold_in(key, _NOISE_KEY))(ctx.rows.keys)
        # keep: [B, k] Bernoulli(alpha); shift: [B, k] in [1, V) so a replaced token always differs
        keep = jax.vmap(lambda key: jax.random.bernoulli(key, self.alpha, (k,)))(keys)
        shift = jax.vmap(lambda key: jax.random.randint(jax.random.fold_in(key, 1), (k,), 1, self.vocab_size))(keys)

        def replace(tokens, kept, shifted):
            # tokens, kept, shifted: the same shape ([B] or [B, k]); a replaced token always differs
            return jnp.where(kept, tokens, (tokens + shifted) % self.vocab_size).astype(jnp.int32)

        if self.inner.tracks_context:  # the draft continues from the perturbed tokens (module doc)
            perturb = lambda token, i: replace(token, keep[:, i], shift[:, i])  # noqa: E731 - token: [B]
            proposals, state = self.inner.propose(params, state, ctx, k, window, perturb=perturb)
            noisy = proposals.token_ids
        else:  # no state to keep in sync: perturb the finished proposals, [B, k]
            proposals, state = self.inner.propose(params, state, ctx, k, window)
            noisy = replace(proposals.token_ids, keep, shift)
        return Proposals(token_ids=noisy, lens=proposals.lens, draft_probs=None), state
