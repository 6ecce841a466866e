"""Temperature / top-k / top-p warping with per-row traced parameters.

`warp` turns logits into the distribution a request actually samples from: temperature, then
top-k, renormalise, then top-p (the order of Hugging Face transformers' warpers and vLLM). The
same function is applied to the target (p) and the draft (q) so rejection sampling stays exact.
Greedy rows (temperature == 0) get a point mass on the argmax.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxspec.types import RowParams

_MIN_TEMPERATURE = 1e-5


def _expand(x: jax.Array, ndim: int) -> jax.Array:
    """[B] -> [B, 1, ..., 1] with `ndim` total dims."""
    return x.reshape(x.shape + (1,) * (ndim - x.ndim))


def _truncate(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """The temperature-scaled logits, masked outside each row's top-k, then outside the top-p nucleus
    of what is left.

    top-k keeps the top_k largest logits (0: all); their probabilities at `temperature` are
    renormalised, and top-p keeps the shortest descending prefix of them whose mass reaches top_p
    (>= 1: all). The cut is ranked and thresholded on the unscaled logits, so a huge temperature,
    which makes the scaled logits equal in float32, cannot widen it: `top_k = 1` stays greedy. The
    top token is always kept, so a top_p the device sees as 0 (a tiny value rounded or flushed to
    zero in float32) samples the top token, as any top_p below its probability does, never the whole
    vocabulary. Logits tied with the last kept one are kept.
    logits [B, ..., V], temperature [B, ..., 1] (> 0) -> scaled and masked logits [B, ..., V].
    """
    v = logits.shape[-1]
    sorted_logits = -jnp.sort(-logits, axis=-1)  # [B, ..., V] descending
    sorted_scaled = sorted_logits / temperature  # [B, ..., V] non-increasing: dividing by T > 0 keeps the order
    rank = jnp.arange(v, dtype=jnp.int32)  # [V], position in sorted order
    k = jnp.where(top_k > 0, jnp.minimum(top_k, v), v)  # [B]
    in_top_k = rank < _expand(k, logits.ndim)  # [B, ..., V]
    # probabilities at the temperature, renormalised over the top-k: [B, ..., V], 0 past rank k
    sorted_probs = jax.nn.softmax(jnp.where(in_top_k, sorted_scaled, -jnp.inf), axis=-1)
    cumulative = jnp.cumsum(sorted_probs, axis=-1)  # [B, ..., V], non-decreasing
    mass_before = jnp.concatenate([jnp.zeros_like(cumulative[..., :1]), cumulative[..., :-1]], axis=-1)
    p = _expand(top_p, logits.ndim)
    # a descending prefix: rank 0 always, then while the mass before it is < top_p
    keep = in_top_k & ((rank == 0) | (mass_before < p) | (p >= 1.0))  # [B, ..., V]
    n_keep = jnp.sum(keep, axis=-1, keepdims=True, dtype=jnp.int32)  # [B, ..., 1], >= 1
    threshold = jnp.take_along_axis(sorted_logits, n_keep - 1, axis=-1)  # [B, ..., 1], an unscaled logit
    return jnp.where(logits >= threshold, logits / temperature, -jnp.inf)  # [B, ..., V]


def warp(logits: jax.Array, params: RowParams) -> jax.Array:
    """Row-wise sampling distribution: temperature, top-k, renormalise, top-p (see `_truncate`).

    logits [B, ..., V] (fp32) -> probs [B, ..., V].
    """
    temperature = _expand(params.temperature, logits.ndim)  # [B, ..., 1]
    positive = jnp.maximum(temperature, _MIN_TEMPERATURE)  # [B, ..., 1]
    needs_truncation = jnp.any((params.top_k > 0) | (params.top_p < 1.0))
    scaled = jax.lax.cond(needs_truncation,
                          lambda x: _truncate(x, positive, params.top_k, params.top_p),
                          lambda x: x / positive, logits)  # [B, ..., V]
    probs = jax.nn.softmax(scaled, axis=-1)
    greedy = jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=probs.dtype)
    return jnp.where(temperature <= 0.0, greedy, probs)


def sample(probs: jax.Array, keys: jax.Array) -> jax.Array:
    """One token per row from probs [B, V] with per-row keys [B] -> [B] int32."""
    logp = jnp.log(probs)
    return jax.vmap(lambda key, lp: jax.random.categorical(key, lp))(keys, logp).astype(jnp.int32)


def row_keys(base_seeds: jax.Array, n_generated: jax.Array) -> jax.Array:
    """Fresh key per row: fold_in(fold_in(key(0), seed), n_generated). [B], [B] -> [B] keys.

    A request's randomness depends only on its own seed and progress, never on its batch.
    """
    base = jax.random.key(0)
    return jax.vmap(lambda s, n: jax.random.fold_in(jax.random.fold_in(base, s), n))(
        base_seeds, n_generated)


def subkeys(keys: jax.Array, purpose: int) -> jax.Array:
    """Derive an independent key per row for one purpose (draft i, accept, resample...)."""
    return jax.vmap(lambda k: jax.random.fold_in(k, purpose))(keys)


def draw(logits: jax.Array, params: RowParams, keys: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Sample one token per row from warp(logits) -> (tokens [B], probs [B, V]).

    When every row is greedy the V-sized softmax, sort and random bits are skipped (lax.cond):
    tokens are the argmax and probs its one-hot.
    """
    def sampled(logits):
        probs = warp(logits, params)
        return sample(probs, keys), probs

    def greedy(logits):
        tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        return tokens, jax.nn.one_hot(tokens, logits.shape[-1], dtype=jnp.float32)

    return jax.lax.cond(jnp.any(params.temperature > 0.0), sampled, greedy, logits)
