"""Rejection sampling preserves the target distribution at every emitted position (docs/design.md, "Correctness tests").

Setup. V = 8 tokens, K = 3 proposals. Target and draft are Markov chains given as tables
(`_tables`): the target's logits at position j depend on j and the token before it (the pending
token for j = 0, else draft d_j), so each position has its own conditional distributions, and the
draft is correlated with but not equal to the target. Each of N = 2^19 rows drafts K tokens from
the draft (with its own key) and one jitted call verifies them all. Rows cycle through the per-row
caps of the engine's `row_k`: K (half the rows), 1 and 0 (a quarter each).

What must hold. Given that a row emitted the tokens x_0 .. x_{j-1}, its token x_j follows
warp(target at position j after x_{j-1}); for a row capped at c, x_c is the bonus token after c
accepted drafts. Checked per case: (a) x_0 over all rows, and (b) for each cap c and each position
j <= c, x_j over the rows of that cap reaching j, in cells (x_{j-1}, x_j). Each is one Pearson
chi-square goodness-of-fit test over all its cells (expected = rows in the group × warped target;
cells expected below 10 are pooled, so the χ² approximation is sound; a token with target probability 0
must never appear). A case fails if any of its m = 8 tests has p < α/m with α = 1e-3 (Bonferroni):
a correct verify fails a case with probability ≲ 1e-3. Seeds are fixed, so the test is deterministic.

Power. If x_0's distribution π is off by δ = 0.5 percentage points (δ of mass moved from token a to
token b), Pearson's statistic over N rows is approximately noncentral χ²(df, λ) with
λ = N δ² (1/π_a + 1/π_b) ≥ 4 N δ² (as π_a + π_b ≤ 1), df ≤ V − 1 = 7 (fewer only adds power).
At α/m = 1.25e-4 the critical value is χ²_7 = 29.35, and P(χ²'(7, λ) > 29.35) ≥ 0.95 needs
λ ≥ 43.0, i.e. N ≥ 430,000 in the worst case. N = 2^19 = 524,288 gives λ ≥ 52.4: power ≥ 0.989
for any pair of tokens (scipy.stats.ncx2).
(A multinomial simulation of this test's statistic at π_a ≈ π_b ≈ 0.5 rejects 99.6% of the time.)
The cases show it: at the same config and seed where the real verify is accepted, a verify whose
first token is biased by 0.5 points (top-k and top-p on) is rejected, and so is one that judges every
position by position 0's distribution (no truncation: the full support, so only χ² can tell).
Later positions see only the rows that reach them, split by the previous token, so their power is
for larger biases; a position error shifts their distributions by tens of points.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.stats import chi2

from jaxspec.speculation import sampling
from jaxspec.speculation.verify import verify
from jaxspec.types import Proposals, RowParams

V, K, N = 8, 3, 2**19
PENDING = 0  # the token before the step (position 0's context)
CAPS = (K, K, 1, 0)  # row r is capped at CAPS[r % 4]
ALPHA = 1e-3  # per case
MIN_EXPECTED = 10.0
BIAS = 0.005  # the biased verify's shift, and the smallest one the test is sized to catch
BIAS_KEY = 2_000_001  # fold_in purpose for the biased verify's coin (distinct from verify's)


def _tables(seed: int) -> tuple[jax.Array, jax.Array]:
    """Target logits [K+1, V, V] (position j, previous token, next) and draft logits [K, V, V]."""
    kt, kd = jax.random.split(jax.random.key(seed))
    target = jax.random.normal(kt, (K + 1, V, V)) * 1.2
    return target, target[:K] + jax.random.normal(kd, (K, V, V)) * 0.8


@functools.partial(jax.jit, static_argnames=("n",))
def _params(n: int, temperature: float, top_p: float, top_k: int, seed: int) -> RowParams:
    """n rows with one sampling config; row r's key is that of request `seed` at step r."""
    return RowParams(temperature=jnp.full((n,), temperature, jnp.float32), top_p=jnp.full((n,), top_p, jnp.float32),
                     top_k=jnp.full((n,), top_k, jnp.int32),
                     keys=sampling.row_keys(jnp.full((n,), seed, jnp.int32), jnp.arange(n, dtype=jnp.int32)))


def _warped(table: jax.Array, config: tuple[float, float, int]) -> np.ndarray:
    """warp every row of a [P, V, V] logits table under one config -> probabilities [P, V, V]."""
    flat = table.reshape(-1, V)  # [P*V, V]
    return np.asarray(sampling.warp(flat, _params(flat.shape[0], *config, seed=0))).reshape(table.shape)


# --- the verify under test and broken ones --------------------------------------------------------

def _exact(target_logits, proposals, rows):
    return verify(target_logits, proposals, rows)


def _judged_by_position_0(target_logits, proposals, rows):
    """Broken: every position is accepted against and sampled from position 0's distribution."""
    return verify(jnp.broadcast_to(target_logits[:, :1], target_logits.shape), proposals, rows)


def biased_first_token(first, logits0, rows):
    """Moves δ = BIAS of x_0's mass from its most likely token a to the second b: first [N] emitted x_0,
    logits0 [N, V] its target logits -> (first [N] after the move, moved [N] bool)."""
    p0 = sampling.warp(logits0, rows)  # [N, V]
    order = jnp.argsort(-p0, axis=-1)  # [N, V]
    a, b = order[:, 0], order[:, 1]  # [N]
    p_a = jnp.take_along_axis(p0, a[:, None], axis=1)[:, 0]  # [N]
    u = jax.vmap(lambda key: jax.random.uniform(key))(sampling.subkeys(rows.keys, BIAS_KEY))  # [N]
    move = (first == a) & (u * p_a < BIAS)  # P(move) = π_a · BIAS/π_a = BIAS
    return jnp.where(move, b, first).astype(first.dtype), move


def _first_token_biased(target_logits, proposals, rows):
    """Broken by δ = BIAS: moves BIAS of x_0's mass from its most likely token a to the second b."""
    tokens, counts = verify(target_logits, proposals, rows)  # [N, K+1], [N]
    first, _ = biased_first_token(tokens[:, 0], target_logits[:, 0], rows)
    return tokens.at[:, 0].set(first), counts


@functools.partial(jax.jit, static_argnames=("point_mass", "sampler"))
def _emit(target_table, q_table, rows, lens, point_mass, sampler):
    """Draft K tokens per row from q_table [K, V, V] (warped draft), score them with target_table
    [K+1, V, V] (logits), run `sampler`. -> tokens [N, K+1], counts [N], drafts [N, K]."""
    n = lens.shape[0]
    previous = jnp.full((n,), PENDING, jnp.int32)
    drafts, qs = [], []
    for i in range(K):
        q = q_table[i, previous]  # [N, V]
        previous = sampling.sample(q, sampling.subkeys(rows.keys, i))  # [N], d_{i+1} ~ q
        drafts.append(previous)
        qs.append(q)
    drafts = jnp.stack(drafts, axis=1)  # [N, K]
    context = jnp.concatenate([jnp.full((n, 1), PENDING, jnp.int32), drafts], axis=1)  # [N, K+1]
    target_logits = target_table[jnp.arange(K + 1)[None, :], context]  # [N, K+1, V]
    # point-mass proposals (prompt lookup) are valid for any guess chosen independently of verify
    proposals = Proposals(token_ids=drafts, lens=lens, draft_probs=None if point_mass else jnp.stack(qs, axis=1))
    tokens, counts = sampler(target_logits, proposals, rows)
    return tokens, counts, drafts


# --- the statistics ---------------------------------------------------------------------------------

def _pearson(observed: np.ndarray, probs: np.ndarray) -> tuple[float, int, int]:
    """Chi-square over groups of cells: observed counts and expected probabilities, both [G, V]
    (group = previous token). Each group is a multinomial given its size.
    -> (statistic, df, tokens emitted where the target has probability 0)."""
    stat, df = 0.0, 0
    impossible = int(observed[probs == 0].sum())
    for o, p in zip(observed, probs):
        if not o.any():  # no row has this previous token
            continue
        e, o = o.sum() * p[p > 0], o[p > 0]
        order = np.argsort(e)
        e, o = e[order], o[order]  # ascending expected
        small = e < MIN_EXPECTED
        pool_e, pool_o, e, o = e[small].sum(), o[small].sum(), e[~small], o[~small]
        if 0 < pool_e < MIN_EXPECTED and len(e):  # top the pool up with the smallest remaining cell
            pool_e, pool_o, e, o = pool_e + e[0], pool_o + o[0], e[1:], o[1:]
        if 0 < pool_e < MIN_EXPECTED:  # the whole group expects fewer than MIN_EXPECTED: uninformative
            continue
        if pool_e > 0:
            e, o = np.append(e, pool_e), np.append(o, pool_o)
        stat += float(np.sum((o - e) ** 2 / e))
        df += len(e) - 1
    return stat, df, impossible


def _p_values(tokens, counts, lens, expected) -> dict[str, tuple[float, int, int]]:
    """{test: (p-value, df, rows)} for x_0 over all rows and for every (cap c, position j <= c).
    expected [K+1, V, V]: warped target for position j after each previous token."""
    tests = {"x0, all rows": (np.ones_like(lens, bool), 0)}
    for c in sorted(set(CAPS), reverse=True):
        for j in range(c + 1):
            tests[f"cap {c}, x{j}" + (" (bonus)" if j == c else "")] = (lens == c, j)
    return position_p_values(tokens, counts, tests, expected)


def position_p_values(tokens, counts, tests, expected) -> dict[str, tuple[float, int, int]]:
    """{test: (p-value, df, rows)} for tests {name: (rows [N] bool, position j)}: the x_j of those rows
    that reach j, in cells (x_{j-1}, x_j), against expected[j] [V, V] (previous token, next)."""
    out = {}
    for name, (rows, j) in tests.items():
        reached = rows & (counts > j)
        previous = np.full(counts.shape, PENDING) if j == 0 else tokens[:, j - 1]
        cells = np.bincount(previous[reached] * V + tokens[reached, j], minlength=V * V).reshape(V, V)
        stat, df, impossible = _pearson(cells, expected[j])
        assert df > 0, name
        # one impossible token is conclusive: p = 0
        out[name] = (0.0 if impossible else float(chi2.sf(stat, df)), df, int(reached.sum()))
    return out


# (temperature, top_p, top_k): plain, sharp, top-p, tight top-p, top-k, both
CONFIGS = [(1.0, 1.0, 0), (0.7, 1.0, 0), (1.3, 0.8, 0), (1.0, 0.6, 0), (1.0, 1.0, 4), (0.9, 0.9, 6)]


def _case(config, kind, sampler=_exact):
    name = f"{kind}-T{config[0]}-p{config[1]}-k{config[2]}-{sampler.__name__[1:]}"
    return pytest.param(config, kind, sampler, sampler is _exact, id=name)


# point-mass proposals differ from draft ones only in q: three configs cover their warping paths
CASES = ([_case(c, "draft") for c in CONFIGS] + [_case(CONFIGS[i], "point") for i in (0, 2, 5)]
         + [_case(CONFIGS[5], "draft", _first_token_biased), _case(CONFIGS[0], "draft", _judged_by_position_0)])


@pytest.mark.parametrize("config,kind,sampler,accepted", CASES)
def test_verify_preserves_the_target_at_every_position(config, kind, sampler, accepted):
    target_table, draft_table = _tables(seed=0)
    rows = _params(N, *config, seed=1)
    lens = np.asarray(CAPS, np.int32)[np.arange(N) % len(CAPS)]  # [N]
    tokens, counts, drafts = map(np.asarray, _emit(target_table, jnp.asarray(_warped(draft_table, config)), rows,
                                                   jnp.asarray(lens), point_mass=kind == "point", sampler=sampler))
    if accepted:  # structure, exactly: 1..cap+1 tokens, the accepted drafts first, -1 after
        slots = np.arange(K + 1)[None, :]
        assert np.all((counts >= 1) & (counts <= lens + 1))
        assert np.all(np.where(slots < counts[:, None] - 1, tokens == np.pad(drafts, ((0, 0), (0, 1))), True))
        assert np.all(np.where(slots >= counts[:, None], tokens == -1, tokens >= 0))
        for c in set(CAPS) - {0}:  # not vacuous: every cap has rows that accept all and rows that reject
            assert 0 < np.mean(counts[lens == c] == c + 1) < 1, c

    results = _p_values(tokens, counts, lens, _warped(target_table, config))
    level = ALPHA / len(results)
    report = "\n".join(f"  {name}: p = {p:.3g} (df {df}, {n} rows)" for name, (p, df, n) in results.items())
    if accepted:
        assert all(p >= level for p, _, _ in results.values()), f"rejected at p < {level:.3g}:\n{report}"
    else:
        assert any(p < level for p, _, _ in results.values()), f"a broken verify was accepted:\n{report}"


def test_greedy_rows_emit_the_target_argmax_and_seeds_are_batch_independent():
    target_table, draft_table = _tables(seed=0)
    lens = np.asarray(CAPS, np.int32)[np.arange(N) % len(CAPS)]  # [N]
    q_table = jnp.asarray(_warped(draft_table, CONFIGS[0]))  # random drafts, so some are accepted
    tokens, counts, _ = map(np.asarray, _emit(target_table, q_table, _params(N, 0.0, 1.0, 0, seed=5),
                                              jnp.asarray(lens), point_mass=True, sampler=_exact))
    argmax = np.asarray(jnp.argmax(target_table, axis=-1))  # [K+1, V]: position j, previous token
    previous = np.concatenate([np.full((N, 1), PENDING), tokens[:, :-1]], axis=1)  # [N, K+1]
    emitted = np.arange(K + 1)[None, :] < counts[:, None]  # [N, K+1]
    assert np.all(tokens[emitted] == argmax[np.nonzero(emitted)[1], previous[emitted]])
    assert np.any(counts == K + 1)  # every position was reached
    # a row's key depends only on (seed, n_generated)
    a = sampling.row_keys(jnp.array([7, 8, 9]), jnp.array([3, 0, 1]))
    b = sampling.row_keys(jnp.array([1, 7]), jnp.array([0, 3]))
    assert bool(jnp.all(jax.random.key_data(a[0]) == jax.random.key_data(b[1])))
