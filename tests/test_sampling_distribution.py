"""Rejection sampling preserves the target distribution (DESIGN.md §6.3).

N = 60 000 independent rows share one set of target logits p and draft distribution q; each row has
its own key. The first emitted token must follow warp(p) exactly, for draft-probability proposals
and for point-mass (prompt lookup) proposals, at several temperatures / top-p / top-k.

Threshold: each of the V = 12 bins is checked with |p̂ − p| ≤ 5·sqrt(p(1−p)/N) + 2e-4. Under the
null the per-bin z-score is ~N(0,1), so a 5σ bound fails with probability ~6e-7 per bin, ~1e-4 over
all bins and cases: a correct sampler essentially never fails, while a sampler that is off by
0.5 percentage points in any bin (≈ 2.5σ at p = 0.1) is caught by the mutation checks below.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec import sampling
from jaxspec.types import Proposals, RowParams
from jaxspec.verify import verify

V, K, N = 12, 3, 60_000


def _rows(temperature: float, top_p: float, top_k: int, seed: int) -> RowParams:
    keys = sampling.row_keys(jnp.full((N,), seed, jnp.int32), jnp.arange(N, dtype=jnp.int32))
    return RowParams(temperature=jnp.full((N,), temperature, jnp.float32), top_p=jnp.full((N,), top_p, jnp.float32),
                     top_k=jnp.full((N,), top_k, jnp.int32), keys=keys)


def _logits(seed: int, scale: float = 1.5) -> jax.Array:
    return jax.random.normal(jax.random.key(seed), (K + 1, V)) * scale  # [K+1, V]


@jax.jit
def _first_tokens(target_logits, draft_logits, rows):
    """Draft K tokens per row from q = warp(draft), verify; first emitted token per row [N]."""
    n = rows.temperature.shape[0]
    target = jnp.broadcast_to(target_logits, (n,) + target_logits.shape)  # [N, K+1, V]
    q = sampling.warp(jnp.broadcast_to(draft_logits, (n,) + draft_logits.shape), rows)  # [N, K, V]
    drafted = jax.vmap(lambda key, qq: jax.random.categorical(key, jnp.log(qq), axis=-1))(
        sampling.subkeys(rows.keys, 77), q).astype(jnp.int32)  # [N, K] sampled from q
    proposals = Proposals(token_ids=drafted, lens=jnp.full((n,), K, jnp.int32), draft_probs=q)
    out, counts = verify(target, proposals, rows)
    return out[:, 0], counts


def _point_mass(target_logits, rows, tokens):
    n = rows.temperature.shape[0]
    target = jnp.broadcast_to(target_logits, (n,) + target_logits.shape)
    proposals = Proposals(token_ids=jnp.broadcast_to(tokens, (n, K)), lens=jnp.full((n,), K, jnp.int32),
                          draft_probs=None)
    out, counts = jax.jit(verify)(target, proposals, rows)
    return out[:, 0], counts


def _assert_matches(samples: np.ndarray, expected: np.ndarray) -> None:
    observed = np.bincount(samples, minlength=V) / len(samples)
    bound = 5 * np.sqrt(expected * (1 - expected) / len(samples)) + 2e-4
    assert np.all(np.abs(observed - expected) <= bound), (observed, expected)


CASES = [(1.0, 1.0, 0), (0.7, 1.0, 0), (1.3, 0.8, 0), (1.0, 0.6, 0), (1.0, 1.0, 4), (0.9, 0.9, 6)]


@pytest.mark.parametrize("temperature,top_p,top_k", CASES)
def test_draft_probability_proposals_preserve_target(temperature, top_p, top_k):
    rows = _rows(temperature, top_p, top_k, seed=1)
    target = _logits(0)
    draft = target[:K] + _logits(1, scale=0.8)[:K]  # a correlated but imperfect draft
    first, counts = _first_tokens(target, draft, rows)
    expected = np.asarray(sampling.warp(target[None, :1], rows_of(rows, 1)))[0, 0]
    _assert_matches(np.asarray(first), expected)
    assert 0 < float(np.mean(np.asarray(counts) > 1)) < 1  # some accepted, some rejected


@pytest.mark.parametrize("temperature,top_p,top_k", CASES[:4])
def test_point_mass_proposals_preserve_target(temperature, top_p, top_k):
    rows = _rows(temperature, top_p, top_k, seed=2)
    target = _logits(3)
    likely = jnp.argsort(-target, axis=-1)[:K, 0].astype(jnp.int32)  # plausible n-gram guesses [K]
    first, _ = _point_mass(target, rows, likely)
    expected = np.asarray(sampling.warp(target[None, :1], rows_of(rows, 1)))[0, 0]
    _assert_matches(np.asarray(first), expected)


def test_the_check_catches_a_mismatched_draft_warp():
    """Mutation check: verifying against q from different warping than the proposals were drawn
    from biases the output — the bound above must detect it (so the tests can fail)."""
    rows = _rows(1.0, 1.0, 0, seed=4)
    target, draft = _logits(0), _logits(1)[:K]
    n = rows.temperature.shape[0]
    q_true = sampling.warp(jnp.broadcast_to(draft, (n,) + draft.shape), rows)
    hot = RowParams(temperature=rows.temperature * 0.5, top_p=rows.top_p, top_k=rows.top_k, keys=rows.keys)
    q_wrong = sampling.warp(jnp.broadcast_to(draft, (n,) + draft.shape), hot)
    drafted = jax.vmap(lambda key, qq: jax.random.categorical(key, jnp.log(qq), axis=-1))(
        sampling.subkeys(rows.keys, 5), q_true).astype(jnp.int32)
    proposals = Proposals(token_ids=drafted, lens=jnp.full((n,), K, jnp.int32), draft_probs=q_wrong)
    out, _ = jax.jit(verify)(jnp.broadcast_to(target, (n,) + target.shape), proposals, rows)
    expected = np.asarray(sampling.warp(target[None, :1], rows_of(rows, 1)))[0, 0]
    with pytest.raises(AssertionError):
        _assert_matches(np.asarray(out[:, 0]), expected)


def test_greedy_rows_are_argmax_and_seeds_are_batch_independent():
    rows = _rows(0.0, 1.0, 0, seed=5)
    target = _logits(6)
    first, _ = _point_mass(target, rows, jnp.zeros((K,), jnp.int32))
    assert np.all(np.asarray(first) == int(jnp.argmax(target[0])))
    # a row's key depends only on (seed, n_generated)
    a = sampling.row_keys(jnp.array([7, 8, 9]), jnp.array([3, 0, 1]))
    b = sampling.row_keys(jnp.array([1, 7]), jnp.array([0, 3]))
    assert bool(jnp.all(jax.random.key_data(a[0]) == jax.random.key_data(b[1])))


def rows_of(rows: RowParams, n: int) -> RowParams:
    return RowParams(temperature=rows.temperature[:n], top_p=rows.top_p[:n], top_k=rows.top_k[:n], keys=rows.keys[:n])
