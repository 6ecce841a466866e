"""Verification of proposals against the target's scores (docs/design.md, "The speculative step").

Greedy rows: accept the longest prefix equal to the target's argmax, then the target's next
token. Sampled rows: standard speculative rejection sampling — accept proposal i with
probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection sample from
norm(max(0, p_i − q_i)); if every real proposal is accepted, the bonus token comes from p.
Point-mass proposals (prompt lookup) use q_i(d_i) = 1 without materialising q.
Token trees: `verify_tree` (the walk down the tree by the target's own draws; exact, see there).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxspec.speculation import sampling
from jaxspec.speculation.tree import root_path
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


def check_float32(target_logits: jax.Array, draft_probs: jax.Array | None = None) -> None:
    """Raise TypeError unless the target logits (and the draft's q, if any) are float32: the accept
    test and the residual are computed in float32 under every weight dtype."""
    for name, value in (("target logits", target_logits), ("draft probabilities", draft_probs)):
        if value is not None and value.dtype != jnp.float32:
            raise TypeError(f"verify needs float32 {name}, got {value.dtype} (the model must unembed in float32)")


def verify(target_logits: jax.Array, proposals: Proposals, params: RowParams) -> tuple[jax.Array, jax.Array]:
    """Decide what each row emits this step.

    target_logits: [B, k+1, V] scores for positions after [pending, d_1 .. d_k].
    Returns (tokens [B, k+1] int32, counts [B] int32): row b emits tokens[b, :counts[b]].
    The V-sized sampling work runs only when some row samples (lax.cond). Logits and draft
    probabilities must be float32 whatever the model's dtype (docs/design.md, "Dtypes"): TypeError else.
    """
    check_float32(target_logits, proposals.draft_probs)
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


TREE_KEY = 1_000_003  # fold_in purpose of a tree step's per-depth draws


def _draw_tree(target_logits: jax.Array, depth: jax.Array, params: RowParams) -> jax.Array:
    """x [B, T]: one token per node from warp(p(node)), with the row's key for that node's depth."""
    b, t, v = target_logits.shape
    p = sampling.warp(target_logits, params)  # [B, T, V]
    base = sampling.subkeys(params.keys, TREE_KEY)  # [B]
    keys = jax.vmap(lambda key, d: jax.vmap(lambda e: jax.random.fold_in(key, e))(d))(base, depth)  # [B, T]
    return sampling.sample(p.reshape(b * t, v), keys.reshape(b * t)).reshape(b, t)


def verify_tree(target_logits: jax.Array, tokens: jax.Array, parents: jax.Array, depth: jax.Array,
                params: RowParams, max_depth: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Decide what each row emits from a scored token tree (jaxspec/speculation/tree.py: column 0 is the root).

    target_logits [B, T, V] (node t's next-token scores); tokens, parents, depth [B, T] from
    `tree.with_root` (invalid nodes carry token -1). Returns (out [B, T] emitted tokens then -1,
    counts [B], path [B, Z+1] the accepted root path for `tree.compact`).

    At every node the target draws x_t: its argmax for greedy rows, else a sample of warp(p_t) with
    a key for the node's depth. Starting at the root, the walk moves to the child whose token equals
    the current node's x (siblings are distinct) and stops where no child does; the row emits the
    tokens of the path's nodes, then x of the last one.

    Exactness. The proposals are a deterministic function of the context, so the emitted y_1 = x_root
    is a draw from p(. | context); y_{j+1} = x at the node reached through y_1 .. y_j, a draw from
    p(. | context, y_1 .. y_j) with a key not used by any earlier draw (one key per depth per step,
    fresh per step since n_generated advances); whether the walk goes on is decided by the draws
    already made. Every emitted token is therefore a fresh draw from the target's conditional given
    everything before it, which is plain sampling; at temperature 0 it is plain greedy decoding.
    """
    check_float32(target_logits)
    b, t, _ = target_logits.shape
    greedy_x = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)  # [B, T]
    greedy_row = params.temperature <= 0.0  # [B]
    x = jax.lax.cond(jnp.any(~greedy_row),
                     lambda: jnp.where(greedy_row[:, None], greedy_x, _draw_tree(target_logits, depth, params)),
                     lambda: greedy_x)  # [B, T]
    # accepted[b, t]: every node on t's root path carries the token its parent drew
    x_parent = jnp.take_along_axis(x, parents, axis=1)  # [B, T]
    matches = tokens == x_parent  # [B, T] (the root's -1 never matches)
    is_root = jnp.arange(t)[None, :] == 0
    accepted = is_root
    for _ in range(max_depth):
        accepted = is_root | (jnp.take_along_axis(accepted, parents, axis=1) & matches)  # [B, T]
    deepest, path = root_path(accepted, parents, depth, max_depth)
    n_accepted = jnp.take_along_axis(depth, deepest[:, None], axis=1)[:, 0]  # [B]
    # out: [B, T] = path tokens 1..n_accepted, x of the deepest node, then -1
    column = jnp.arange(t, dtype=jnp.int32)[None, :]
    path_tokens = jnp.take_along_axis(tokens, jnp.minimum(path[:, 1:], t - 1), axis=1)  # [B, Z]
    path_tokens = jnp.pad(path_tokens, ((0, 0), (0, t - max_depth)), constant_values=-1)  # [B, T]
    out = jnp.where(column < n_accepted[:, None], path_tokens, -1)
    out = jnp.where(column == n_accepted[:, None], jnp.take_along_axis(x, deepest[:, None], axis=1), out)
    return out.astype(jnp.int32), (n_accepted + 1).astype(jnp.int32), path
