"""Verification of proposals against the target's scores (docs/design.md, "The speculative step").

Greedy rows: accept the longest prefix equal to the target's argmax, then the target's next
token. Sampled rows: standard speculative rejection sampling — accept proposal i with
probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection sample from
norm(max(0, p_i − q_i)); if every real proposal is accepted, the bonus token comes from p.
Point-mass proposals (prompt lookup) use q_i(d_i) = 1 without materialising q.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxspec import sampling
from jaxspec.types import Proposals, RowParams

# fold_in purposes for the per-row keys (distinct from the proposer's draft-sampling ones).
ACCEPT_KEY, RESIDUAL_KEY = 1_000_001, 1_000_002


def _accepted_prefix(ok: jax.Array) -> jax.Array:
    """ok [B, k] -> length of the all-True prefix per row [B]."""
    return jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)


def _rejection_sample(target_logits: jax.Array, proposals: Proposals, params: RowParams, real: jax.Array):
    """Rejection sampling for every row -> (n_accepted [B], next_token [B])."""
    b, k1, v = target_logits.shape
    k = k1 - 1
    drafts = proposals.token_ids  # [B, k]
    p = sampling.warp(target_logits, params)  # [B, k+1, V]
    # p_draft: [B, k] = p_i(d_i) for the draft at position i (scored by logits i)
    p_draft = jnp.take_along_axis(p[:, :k, :], drafts[:, :, None], axis=-1)[..., 0]
    if proposals.draft_probs is None:
        q_draft = jnp.ones_like(p_draft)
    else:
        q_draft = jnp.take_along_axis(proposals.draft_probs, drafts[:, :, None], axis=-1)[..., 0]
    u = jax.vmap(lambda key: jax.random.uniform(key, (k,)))(sampling.subkeys(params.keys, ACCEPT_KEY))
    n_accepted = _accepted_prefix((u * q_draft < p_draft) & real)  # u < p/q without dividing by q

    # The token after the accepted prefix: residual norm(max(0, p - q)) on a real rejection,
    # else the bonus from p.
    p_next = jnp.take_along_axis(p, n_accepted[:, None, None], axis=1)[:, 0, :]  # [B, V]
    if k > 0:
        idx = jnp.minimum(n_accepted, k - 1)
        if proposals.draft_probs is None:
            rejected_token = jnp.take_along_axis(drafts, idx[:, None], axis=1)[:, 0]  # [B]
            q_next = jax.nn.one_hot(rejected_token, v, dtype=p.dtype)  # [B, V] point mass
        else:
            q_next = jnp.take_along_axis(proposals.draft_probs, idx[:, None, None], axis=1)[:, 0, :]
        residual = jnp.maximum(p_next - q_next, 0.0)  # [B, V]
        mass = jnp.sum(residual, axis=-1, keepdims=True)
        residual = jnp.where(mass > 0, residual / jnp.maximum(mass, 1e-30), p_next)
        p_next = jnp.where((n_accepted < proposals.lens)[:, None], residual, p_next)
    return n_accepted, sampling.sample(p_next, sampling.subkeys(params.keys, RESIDUAL_KEY))


def check_float32(target_logits: jax.Array, proposals: Proposals) -> None:
    """Raise TypeError unless the target logits (and the draft's q, if any) are float32: the accept
    test and the residual are computed in float32 under every weight dtype."""
    for name, value in (("target logits", target_logits), ("draft probabilities", proposals.draft_probs)):
        if value is not None and value.dtype != jnp.float32:
            raise TypeError(f"verify needs float32 {name}, got {value.dtype} (the model must unembed in float32)")


def verify(target_logits: jax.Array, proposals: Proposals, params: RowParams) -> tuple[jax.Array, jax.Array]:
    """Decide what each row emits this step.

    target_logits: [B, k+1, V] scores for positions after [pending, d_1 .. d_k].
    Returns (tokens [B, k+1] int32, counts [B] int32): row b emits tokens[b, :counts[b]].
    The V-sized sampling work runs only when some row samples (lax.cond). Logits and draft
    probabilities must be float32 whatever the model's dtype (docs/design.md, "Dtypes"): TypeError else.
    """
    check_float32(target_logits, proposals)
    b, k1, _ = target_logits.shape
    k = k1 - 1
    drafts = proposals.token_ids  # [B, k]
    real = jnp.arange(k, dtype=jnp.int32)[None, :] < proposals.lens[:, None]  # [B, k]

    target_argmax = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)  # [B, k+1]
    greedy_accepted = _accepted_prefix((drafts == target_argmax[:, :k]) & real)  # [B]
    greedy_next = jnp.take_along_axis(target_argmax, greedy_accepted[:, None], axis=1)[:, 0]  # [B]

    greedy_row = params.temperature <= 0.0  # [B]
    sampled_accepted, sampled_next = jax.lax.cond(
        jnp.any(~greedy_row),
        lambda: _rejection_sample(target_logits, proposals, params, real),
        lambda: (greedy_accepted, greedy_next))
    n_accepted = jnp.where(greedy_row, greedy_accepted, sampled_accepted)
    next_token = jnp.where(greedy_row, greedy_next, sampled_next)

    # tokens: [B, k+1] = accepted drafts, then next_token at index n_accepted, then -1
    slots = jnp.arange(k + 1, dtype=jnp.int32)[None, :]
    padded_drafts = jnp.concatenate([drafts, jnp.zeros((b, 1), jnp.int32)], axis=1)
    tokens = jnp.where(slots < n_accepted[:, None], padded_drafts, -1)
    tokens = jnp.where(slots == n_accepted[:, None], next_token[:, None], tokens)
    return tokens.astype(jnp.int32), (n_accepted + 1).astype(jnp.int32)
