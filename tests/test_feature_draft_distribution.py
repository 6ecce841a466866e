"""With the feature draft's q, the engine's speculative step preserves the target distribution at every position.

Setup. The whole engine step (feature-draft proposals with their q, target pass, rejection sampling, commit) on
a random target with V = 8 tokens and a feature draft made from its last layer, whose output vocabulary is pruned
to 6 tokens (q is exactly 0 on the other two). 512 slots hold the same context (prompt and pending token); each of 1024
rounds restores that state, gives every slot a fresh seed and runs one k = 3 step: N = 2^19 rows. Rows cycle
through the caps (3, 3, 1, 0) of `row_k`.

What must hold. Given that a row emitted x_0 .. x_{j-1}, x_j follows warp(target after context, x_0 .. x_{j-1})
(from the cache-free reference forward). Checked as in tests/test_sampling_distribution.py: x_0 over all rows,
and for each cap c and position j <= c, x_j over that cap's rows reaching j, in cells (x_0 .. x_{j-1}, x_j);
one Pearson chi-square per test (cells expected below 10 pooled), m = 8 tests, Bonferroni at α = 1e-3.

Power. The same N, V and m as tests/test_sampling_distribution.py, so a 0.5-point bias in x_0 between any two
tokens is caught with power >= 0.989 (its docstring has the computation). Shown here: the same engine with a
verify whose first token is biased by 0.5 points is rejected at the same seeds where the real one passes, and
so is one that judges every position by position 0's distribution (a later-position error, which moves the
later positions' distributions by far more: N / 16 rows show it).
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.stats import chi2

from jaxspec.engine import step_bodies
from jaxspec.engine.draft_artifacts import FeatureArch, build_feature_draft
from jaxspec.engine.engine import Engine
from jaxspec.menu import Menu
from jaxspec.models.config import TINY
from jaxspec.models.llama import random_model
from jaxspec.speculation import sampling
from jaxspec.speculation.proposers.feature_draft import FeatureDraftProposer
from jaxspec.types import RowParams, SamplingParams
from tests.test_sampling_distribution import ALPHA, N, V, _first_token_biased, _judged_by_position_0, _pearson

K, SLOTS, CAPS = 3, 512, (3, 3, 1, 0)
CONFIG = (0.9, 0.9, 6)  # temperature, top-p, top-k: every warping path
CONTEXT = [1, 5, 2, 7, 3]
MENU = Menu(num_slots=SLOTS, max_len=16, batch_buckets=(SLOTS,), k_menu=(0, K), window_buckets=(16,),
            prefill_buckets=(8,))
TARGET_CONFIG = TINY.replace(name="tiny-v8", vocab_size=V)


def _models():
    """A random target and a feature draft built from its last layer (so it is often, not always, right)."""
    target = random_model(TARGET_CONFIG, seed=3)
    return target, build_feature_draft(target, FeatureArch(vocab_keep=None), keep_ids=np.arange(6))


def _emit(target, draft, n: int = N) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """n rows of one k = 3 step from the same context. -> tokens [n, K+1], counts [n], caps [n], pending."""
    engine = Engine(target, FeatureDraftProposer(draft), MENU)
    engine.warmup(progress=False)
    return emit_rows(engine, K, CAPS, CONFIG, n)


def emit_rows(engine: Engine, k: int, caps: tuple[int, ...], config: tuple[float, float, int], n: int = N,
              host_proposals=None):
    """n rows of one step at k, all from CONTEXT: every slot prefilled alike (one seed, so one pending token),
    then each of n / slots rounds restores that state, gives every slot a fresh seed and steps once, slot s
    capped at caps[s % len(caps)]. The draft's catch-up of the context runs once, before the snapshot: every
    round starts with the draft's cache holding it. A proposer that proposes on the host gets `host_proposals`
    (engine.step's callback). -> tokens [n, k+1], counts [n], caps [n], pending."""
    slots = engine.menu.num_slots
    temperature, top_p, top_k = config
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k)
    pending = {engine.prefill(s, CONTEXT, params, seed=0) for s in range(slots)}  # one seed: one pending token
    assert len(pending) == 1
    # the draft's lazy catch-up (one call per slot) runs once, into the snapshot, not again in every round
    engine.catch_up(range(slots))
    snapshot, lengths = jax.tree.map(jnp.copy, engine.state), engine.lengths.copy()
    proposer_lengths = engine.proposer_lengths.copy()
    row_caps = np.asarray(caps)[np.arange(slots) % len(caps)]
    tokens, counts = [], []
    for r in range(n // slots):
        state = jax.tree.map(jnp.copy, snapshot)
        seeds = state.params.seed.at[:slots].set(jnp.arange(slots, dtype=jnp.int32) + (r + 1) * slots)
        engine.state = state.__class__(**{**vars(state), "params": state.params.__class__(
            **{**vars(state.params), "seed": seeds})})
        engine.lengths[:], engine.proposer_lengths[:] = lengths, proposer_lengths
        result = engine.step(list(range(slots)), k, row_caps.tolist(), host_proposals=host_proposals)
        tokens.append(result.tokens)
        counts.append(result.counts)
    return np.concatenate(tokens), np.concatenate(counts), np.tile(row_caps, n // slots), pending.pop()


def expected_after(target, pending: int, depth: int, config: tuple[float, float, int]):
    """warp(target) after CONTEXT + pending + every prefix of up to `depth` tokens: {prefix: probabilities [V]}."""
    prefixes = [p for j in range(depth + 1) for p in itertools.product(range(V), repeat=j)]
    base = CONTEXT + [pending]
    width = len(base) + depth
    tokens = np.zeros((len(prefixes), width), np.int32)
    for i, p in enumerate(prefixes):
        tokens[i, :len(base) + len(p)] = base + list(p)
    last = np.asarray([len(base) + len(p) - 1 for p in prefixes])
    logits = np.asarray(target(jnp.asarray(tokens)))[np.arange(len(prefixes)), last]  # [P, V]
    temperature, top_p, top_k = config
    n = len(prefixes)
    rows = RowParams(temperature=jnp.full((n,), temperature), top_p=jnp.full((n,), top_p),
                     top_k=jnp.full((n,), top_k, jnp.int32), keys=sampling.row_keys(jnp.zeros((n,), jnp.int32),
                                                                                   jnp.zeros((n,), jnp.int32)))
    probs = np.asarray(sampling.warp(jnp.asarray(logits), rows))
    return dict(zip(prefixes, probs))


def capped_p_values(tokens, counts, caps, expected, depth: int) -> dict[str, tuple[float, int, int]]:
    """{test: (p-value, df, rows)}: x_0 over all rows, and x_j for each cap c and position j <= min(c, depth)
    over that cap's rows reaching j, in cells (x_0 .. x_{j-1}, x_j) against `expected` {prefix: [V]}.
    A test no row reaches is left out (the caller checks which ran)."""
    tests = {"x0, all rows": (np.ones_like(caps, bool), 0)}
    for c in sorted(set(caps.tolist()), reverse=True):
        for j in range(min(c, depth) + 1):
            tests[f"cap {c}, x{j}" + (" (bonus)" if j == c else "")] = (caps == c, j)
    out = {}
    for name, (rows, j) in tests.items():
        reached = rows & (counts > j)
        if not reached.any():
            continue
        groups = [p for p in expected if len(p) == j]  # every prefix x_0 .. x_{j-1}
        index = {p: g for g, p in enumerate(groups)}
        prefix = np.asarray([index[tuple(row[:j])] for row in tokens[reached]])
        cells = np.bincount(prefix * V + tokens[reached, j], minlength=len(groups) * V).reshape(len(groups), V)
        stat, df, impossible = _pearson(cells, np.stack([expected[p] for p in groups]))
        assert df > 0, name
        out[name] = (0.0 if impossible else float(chi2.sf(stat, df)), df, int(reached.sum()))
    return out


def later_position(name: str) -> bool:
    """Whether a test of `capped_p_values` checks a position after x_0."""
    return not name.startswith("x0") and not name.split(", ")[1].startswith("x0")


def judge(results: dict[str, tuple[float, int, int]], broken: bool, caught_by=lambda name: True) -> None:
    """Bonferroni over the tests that ran at α = ALPHA: a broken sampler must fail one of those `caught_by`
    selects, the real one none."""
    level = ALPHA / len(results)
    report = "\n".join(f"  {name}: p = {p:.3g} (df {df}, {n} rows)" for name, (p, df, n) in results.items())
    if broken:
        assert any(p < level for name, (p, _, _) in results.items() if caught_by(name)), \
            f"a broken verify was accepted:\n{report}"
    else:
        assert all(p >= level for p, _, _ in results.values()), f"rejected at p < {level:.3g}:\n{report}"


@pytest.mark.parametrize("broken,rows", [(None, N), (_first_token_biased, N), (_judged_by_position_0, N // 16)],
                         ids=["exact", "first-token-biased", "judged-by-position-0"])
def test_feature_draft_steps_preserve_the_target_at_every_position(broken, rows, monkeypatch):
    biased = broken is not None
    if biased:  # the engine's step traces `verify` when it compiles: swap in the broken one
        monkeypatch.setattr(step_bodies, "verify", broken)
    target, draft = _models()
    tokens, counts, caps, pending = _emit(target, draft, rows)
    if not biased:  # structure, and not vacuous: every cap has rows that accept all and rows that reject
        assert np.all((counts >= 1) & (counts <= caps + 1))
        for c in set(CAPS) - {0}:
            assert 0 < np.mean(counts[caps == c] == c + 1) < 1, c
        assert np.all(tokens[:, 0][counts >= 1] < V)
    results = capped_p_values(tokens, counts, caps, expected_after(target, pending, K, CONFIG), K)
    assert len(results) == 8  # x0, then cap 3: x0..x3, cap 1: x0, x1, cap 0: x0
    # position 0's judge draws x_0 right: it must be caught at a later position
    judge(results, broken=biased, caught_by=later_position if broken is _judged_by_position_0 else lambda name: True)
