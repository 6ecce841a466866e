"""Through the engine, suffix decoding's proposals keep the target distribution at every emitted position.

Setup. As tests/test_feature_draft_distribution.py (its random V = 8 target, context, warping config, 512 slots
× 1024 rounds = N = 2^19 rows of one k = 3 step, caps (3, 3, 1, 0)), with the suffix proposer: every slot is a
request of a `SuffixIndex` fed as the scheduler feeds it (its prompt, then the pending token as its first output),
and the global trie holds an earlier output that continued the same context with the target's three most likely
tokens. Each step takes the rows' proposals from the index through `host_proposals` (point masses, so the verify
judges them by the target alone); about 6 % of the capped-at-3 rows accept all three.

What must hold, and how it is checked: as there (`capped_p_values`): x_0 over all rows, and for each cap c and
position j <= c, x_j over that cap's rows reaching j, in cells (x_0 .. x_{j-1}, x_j) against the cache-free
target after that prefix; m = 8 Pearson tests, Bonferroni at α = 1e-3.

Power. The same N, V and m as tests/test_sampling_distribution.py: a 0.5-point bias in x_0 between any two tokens
is caught with power >= 0.989 (its docstring has the computation). Shown here: the same engine and proposals with
a verify whose first token is biased by 0.5 points is rejected at the seeds where the real one passes, and so is
one that judges every position by position 0's distribution (caught at a later position, on N / 16 rows).
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxspec.engine import step_bodies
from jaxspec.engine.engine import Engine
from jaxspec.models.llama import random_model
from jaxspec.speculation.proposers.suffix import SuffixProposer, host_proposals
from jaxspec.speculation.suffix_tree import SuffixConfig, SuffixIndex
from jaxspec.types import SamplingParams
from tests.test_feature_draft_distribution import (
    CAPS,
    CONFIG,
    CONTEXT,
    MENU,
    SLOTS,
    TARGET_CONFIG,
    V,
    capped_p_values,
    emit_rows,
    expected_after,
    judge,
    later_position,
)
from tests.test_sampling_distribution import N, _first_token_biased, _judged_by_position_0

K = 3


def _most_likely_chain(expected: dict[tuple[int, ...], np.ndarray]) -> tuple[int, ...]:
    """The target's most likely x_0, x_1 .. x_{K-1}, each after the ones before it."""
    chain: tuple[int, ...] = ()
    for _ in range(K):
        chain += (int(np.argmax(expected[chain])),)
    return chain


@pytest.mark.parametrize("broken,rows", [(None, N), (_first_token_biased, N), (_judged_by_position_0, N // 16)],
                         ids=["exact", "first-token-biased", "judged-by-position-0"])
def test_suffix_steps_preserve_the_target_at_every_position(broken, rows, monkeypatch):
    biased = broken is not None
    if biased:  # the engine's step traces `verify` when it compiles: swap in the broken one
        monkeypatch.setattr(step_bodies, "verify", broken)
    target = random_model(TARGET_CONFIG, seed=3)
    index = SuffixIndex(SuffixConfig(depth=16, min_prob=0.0))
    engine = Engine(target, SuffixProposer(index), MENU)
    engine.warmup(progress=False)
    temperature, top_p, top_k = CONFIG
    pending = engine.prefill(0, CONTEXT, SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k), seed=0)
    engine.free(0)
    expected = expected_after(target, pending, K, CONFIG)
    chain = _most_likely_chain(expected)
    index.start("earlier", [0])
    index.extend("earlier", [*CONTEXT, pending, *chain])
    index.finish("earlier", keep=True)
    request_ids = [f"slot-{s}" for s in range(SLOTS)]
    for rid in request_ids:
        index.start(rid, CONTEXT)
        index.extend(rid, [pending])
    assert index.propose(request_ids[0], K).tokens == chain  # the earlier output's, not the prompt's continuation
    steps = []

    def proposals(k, tree):  # every round: each row's chain from the index
        assert tree is None
        steps.append(k)
        return host_proposals(index, request_ids, k, tree)

    tokens, counts, caps, emitted_pending = emit_rows(engine, K, CAPS, CONFIG, rows, host_proposals=proposals)
    assert emitted_pending == pending and steps == [K] * (rows // SLOTS)
    if not biased:  # structure, and not vacuous: every cap has rows that accept all and rows that reject
        assert np.all((counts >= 1) & (counts <= caps + 1))
        for c in set(CAPS) - {0}:
            assert 0 < np.mean(counts[caps == c] == c + 1) < 1, c
        full = counts[caps == K] == K + 1
        assert np.all(tokens[caps == K][full][:, :K] == chain)  # accepted rows emitted the proposal
        assert np.all(tokens[:, 0] < V)
    results = capped_p_values(tokens, counts, caps, expected, K)
    assert len(results) == 8  # x0, then cap 3: x0..x3, cap 1: x0, x1, cap 0: x0
    # position 0's judge draws x_0 right: it must be caught at a later position
    judge(results, broken=biased, caught_by=later_position if broken is _judged_by_position_0 else lambda name: True)
