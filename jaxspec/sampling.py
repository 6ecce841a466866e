"""Temperature / top-k / top-p warping with per-row traced parameters.

`warp` turns logits into the distribution a request actually samples from. The same function
is applied to the target (p) and the draft (q) so rejection sampling stays exact.
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


def _truncate(logits: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Mask logits outside each row's top-k and top-p nucleus. logits [B, ..., V]."""
    v = logits.shape[-1]
    # sorted_logits: [B, ..., V] descending
    sorted_logits = -jnp.sort(-logits, axis=-1)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, v), v)  # [B]
    k_index = jnp.broadcast_to(_expand(k - 1, logits.ndim), logits.shape[:-1] + (1,))
    kth = jnp.take_along_axis(sorted_logits, k_index.astype(jnp.int32), axis=-1)  # [B, ..., 1]
    sorted_probs = jax.nn.softmax(sorted_logits, axis=-1)
    # keep sorted token j if the mass before it is < top_p (always keeps the first)
    mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs  # [B, ..., V]
    keep_sorted = mass_before < _expand(top_p, logits.ndim)
    n_keep = jnp.sum(keep_sorted, axis=-1, keepdims=True)  # [B, ..., 1]
    pth = jnp.take_along_axis(sorted_logits, n_keep - 1, axis=-1)  # [B, ..., 1]
    threshold = jnp.maximum(kth, pth)
    return jnp.where(logits >= threshold, logits, -jnp.inf)


def warp(logits: jax.Array, params: RowParams) -> jax.Array:
    """Row-wise sampling distribution. logits [B, ..., V] (fp32) -> probs [B, ..., V]."""
    temperature = _expand(params.temperature, logits.ndim)
    scaled = logits / jnp.maximum(temperature, _MIN_TEMPERATURE)
    needs_truncation = jnp.any((params.top_k > 0) | (params.top_p < 1.0))
    scaled = jax.lax.cond(needs_truncation,
                          lambda x: _truncate(x, params.top_k, params.top_p),
                          lambda x: x, scaled)
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
