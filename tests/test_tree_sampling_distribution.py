"""Tree verification preserves the target distribution at every emitted position
(jaxspec.speculation.verify.verify_tree).

Setup. V = 8 tokens and one tree shape inside the envelope N = 6, D = 3::

    root ── n1 ── n3 ── n5
        │     └── n4
        └── n2 ── n6

The target is a Markov chain given as a table: the logits at a node of depth j depend on j and the
node's token (the pending token for the root). Each row's tree tokens are chosen independently of the
verify's randomness, as a proposer's are (a deterministic function of the context): the children of a
node are the top 2 (or 1) of the target's logits at that node plus Gumbel noise from their own keys,
so siblings differ and acceptance is high enough to reach every depth. N = 2^19 rows; rows cycle
through caps 6 (half the rows), 2 and 0 (a quarter each): a row capped at c verifies nodes 1..c only.

What must hold. Given that a row emitted x_0 .. x_{j-1}, x_j follows warp(target at depth j after
x_{j-1}), whether x_j continues the tree or is the token after the deepest accepted node (a bonus, at
depth 3 or past a cap). Checked: x_0 over all rows, and for each cap c and each position j the row can
reach, x_j over the rows of that cap reaching j, in cells (x_{j-1}, x_j): one Pearson chi-square per
test, cells expected below 10 pooled, Bonferroni over the m tests at α = 1e-3 per case.

Power. As in tests/test_sampling_distribution.py (the same N, V and m = 8 tests): a bias of δ = 0.5
points in x_0 between any two tokens gives λ = N δ² (1/π_a + 1/π_b) ≥ 4 N δ² = 52.4, and at
α/m = 1.25e-4 (critical value χ²_7 = 29.35) the power is ≥ 0.989 (scipy.stats.ncx2). Shown here: a verify whose first
token is biased by 0.5 points is rejected, and so is one that draws every node from the root's
distribution (a position error), at the same seed where the real verify passes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.speculation import sampling
from jaxspec.speculation import tree as tree_lib
from jaxspec.speculation.verify import verify_tree
from jaxspec.types import TreeProposals
from tests.test_sampling_distribution import PENDING, N, V, _params, _warped, biased_first_token, position_p_values

DEPTH = 3  # V = 8 tokens, N = 2^19 rows and the pending token: those of tests/test_sampling_distribution.py
PARENTS = (0, 0, 1, 1, 3, 2)  # node i + 1's parent (0 = root)
NODE_DEPTH = (1, 1, 2, 2, 3, 2)
CAPS = (6, 6, 2, 0)  # row r verifies nodes 1 .. CAPS[r % 4]
ALPHA = 1e-3
TREE_KEY = 3_000_001  # the test's own fold_in purpose for the tree tokens


def _table(seed: int) -> jax.Array:
    """Target logits [D + 1, V, V]: depth j, the node's token, next token."""
    return jax.random.normal(jax.random.key(seed), (DEPTH + 1, V, V)) * 1.2


def _exact(logits, tokens, parents, depth, rows):
    return verify_tree(logits, tokens, parents, depth, rows, DEPTH)


def _drawn_from_the_root(logits, tokens, parents, depth, rows):
    """Broken: every node is scored with the root's logits."""
    return verify_tree(jnp.broadcast_to(logits[:, :1], logits.shape), tokens, parents, depth, rows, DEPTH)


def _first_token_biased(logits, tokens, parents, depth, rows):
    """Broken by δ = BIAS: moves BIAS of x_0's mass from its most likely token a to the second b."""
    out, counts, path = verify_tree(logits, tokens, parents, depth, rows, DEPTH)
    first, move = biased_first_token(out[:, 0], logits[:, 0], rows)
    # a moved first token no longer continues the tree: the row emits it alone
    out = jnp.where(move[:, None], jnp.where(jnp.arange(out.shape[1])[None, :] == 0, first[:, None], -1), out)
    return out, jnp.where(move, 1, counts), path


@functools.partial(jax.jit, static_argnames=("sampler",))
def _emit(table, rows, caps, sampler):
    """Build each row's tree (tokens from noisy top-2 of the target, independent of the verify's keys),
    score every node from the table, run `sampler` -> out [N, T], counts [N]."""
    n = caps.shape[0]
    parents = jnp.broadcast_to(jnp.asarray(PARENTS, jnp.int32), (n, len(PARENTS)))
    depth = jnp.broadcast_to(jnp.asarray(NODE_DEPTH, jnp.int32), (n, len(PARENTS)))
    node_tokens = [jnp.full((n,), PENDING, jnp.int32)]  # the root's token, then each node's
    rank = {}  # a node's rank among its siblings
    for i, parent in enumerate(PARENTS):
        rank[i + 1] = sum(1 for p in PARENTS[:i] if p == parent)
        logits = table[NODE_DEPTH[parent - 1] if parent else 0, node_tokens[parent]]  # [N, V]
        keys = sampling.subkeys(sampling.subkeys(rows.keys, TREE_KEY), parent)
        noisy = logits + jax.vmap(lambda key: jax.random.gumbel(key, (V,)))(keys)  # the same noise for siblings
        node_tokens.append(jnp.argsort(-noisy, axis=-1)[:, rank[i + 1]].astype(jnp.int32))  # distinct siblings
    proposals = TreeProposals(token_ids=jnp.stack(node_tokens[1:], axis=1), parents=parents, depth=depth,
                              lens=caps)
    valid = jnp.arange(len(PARENTS))[None, :] < caps[:, None]
    tokens, parents_t, depth_t = tree_lib.with_root(proposals, valid)  # [N, T]
    node_depth = depth_t
    context = jnp.stack(node_tokens, axis=1)  # [N, T] each node's own token (the root's: pending)
    logits = table[node_depth, context]  # [N, T, V]
    out, counts, _ = sampler(logits, tokens, parents_t, depth_t, rows)
    return out, counts


def _p_values(out, counts, caps, expected) -> dict[str, tuple[float, int, int]]:
    reach = {6: DEPTH, 2: 1, 0: 0}  # the deepest node a row of this cap can accept
    tests = {"x0, all rows": (np.ones_like(caps, bool), 0)}
    for c in sorted(set(CAPS), reverse=True):
        for j in range(reach[c] + 1):
            tests[f"cap {c}, x{j}" + (" (bonus only)" if j == reach[c] else "")] = (caps == c, j)
    return position_p_values(out, counts, tests, expected)


CONFIGS = [(1.0, 1.0, 0), (0.7, 1.0, 0), (1.3, 0.8, 0), (0.9, 0.9, 6)]
CASES = ([pytest.param(c, _exact, True, id=f"T{c[0]}-p{c[1]}-k{c[2]}") for c in CONFIGS]
         + [pytest.param(CONFIGS[3], _first_token_biased, False, id="first-token-biased"),
            pytest.param(CONFIGS[0], _drawn_from_the_root, False, id="drawn-from-the-root")])


@pytest.mark.parametrize("config,sampler,accepted", CASES)
def test_tree_verify_preserves_the_target_at_every_position(config, sampler, accepted):
    table = _table(seed=0)
    rows = _params(N, *config, seed=1)
    caps = np.asarray(CAPS, np.int32)[np.arange(N) % len(CAPS)]
    out, counts = map(np.asarray, _emit(table, rows, jnp.asarray(caps), sampler=sampler))
    if accepted:  # structure: 1 .. depth reachable + 1 tokens, -1 after; every depth is reached
        assert np.all((counts >= 1) & (counts <= np.where(caps == 6, DEPTH, np.minimum(caps, 1)) + 1))
        assert np.all(np.where(np.arange(out.shape[1])[None, :] >= counts[:, None], out == -1, out >= 0))
        assert 0 < np.mean(counts[caps == 6] == DEPTH + 1) < 1
    results = _p_values(out, counts, caps, _warped(table, config))
    level = ALPHA / len(results)
    report = "\n".join(f"  {name}: p = {p:.3g} (df {df}, {n} rows)" for name, (p, df, n) in results.items())
    if accepted:
        assert all(p >= level for p, _, _ in results.values()), f"rejected at p < {level:.3g}:\n{report}"
    else:
        assert any(p < level for p, _, _ in results.values()), f"a broken verify was accepted:\n{report}"


def test_greedy_tree_rows_emit_the_target_argmax():
    table = _table(seed=0)
    caps = np.asarray(CAPS, np.int32)[np.arange(N) % len(CAPS)]
    out, counts = map(np.asarray, _emit(table, _params(N, 0.0, 1.0, 0, seed=5), jnp.asarray(caps), sampler=_exact))
    argmax = np.asarray(jnp.argmax(table, axis=-1))  # [D + 1, V]
    previous = np.concatenate([np.full((N, 1), PENDING), out[:, :-1]], axis=1)
    emitted = np.arange(out.shape[1])[None, :] < counts[:, None]
    assert np.all(out[emitted] == argmax[np.nonzero(emitted)[1], previous[emitted]])
    assert np.any(counts == DEPTH + 1)
