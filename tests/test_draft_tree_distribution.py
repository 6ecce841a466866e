"""Through the engine, draft-model token trees preserve the target distribution at every emitted position.

Setup. The whole engine tree step (the draft's EAGLE-2 expansion, one target pass under the ancestor mask,
`verify_tree`, compaction, commit) on the random V = 8 target of tests/test_feature_draft_distribution.py,
drafting for itself (its trees then reach full depth often enough to test every position; the tree is still
built from the unwarped draft, the verify draws from the warped target), envelope 6:3 (three nodes fed per
level, siblings at every depth; the 6 most probable nodes this model keeps are at most 2 deep, so a row emits up
to 3 tokens, and the test asserts which positions it checked). 512 slots hold the same context; each of 1024
rounds restores that state, gives every slot a fresh seed and runs one tree step: N = 2^19 rows. Rows cycle
through the caps (6, 6, 2, 0) of `row_k` (a row capped at c verifies nodes 1 .. c).

What must hold, and how it is checked: as in tests/test_feature_draft_distribution.py (`capped_p_values`):
x_0 over all rows, and for each cap c and position j <= min(c, 3), x_j over that cap's rows reaching j, in cells
(x_0 .. x_{j-1}, x_j) against the cache-free target after that prefix; Bonferroni at α = 1e-3 over the tests.

Power. The same N, V and (at most) m = 8 tests as tests/test_sampling_distribution.py: a 0.5-point bias in
x_0 is caught with power >= 0.989 (its docstring). Shown here: the same engine with a tree verify whose first
token is biased by 0.5 points is rejected at the seeds where the real one passes, and so is one that scores every
node with the root's logits (a later-position error: caught at a later position, on N / 16 rows).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.engine import step_bodies
from jaxspec.engine.engine import Engine
from jaxspec.menu import Menu, TreeEnvelope
from jaxspec.models.llama import random_model
from jaxspec.speculation.proposers.draft_model import DraftModelProposer
from jaxspec.speculation.verify import verify_tree
from tests.test_feature_draft_distribution import (
    CONFIG,
    TARGET_CONFIG,
    V,
    capped_p_values,
    emit_rows,
    expected_after,
    judge,
    later_position,
)
from tests.test_sampling_distribution import N, biased_first_token

ENVELOPE = TreeEnvelope(6, 3)
CAPS, SLOTS = (6, 6, 2, 0), 512
MENU = Menu(num_slots=SLOTS, max_len=24, batch_buckets=(SLOTS,), k_menu=(0, ENVELOPE.nodes), window_buckets=(24,),
            prefill_buckets=(8,), page_size=8).with_tree(ENVELOPE)


def _first_token_biased(logits, tokens, parents, depth, rows, max_depth):
    """Broken by 0.5 points: moves that much of x_0's mass from its most likely token to the second."""
    out, counts, path = verify_tree(logits, tokens, parents, depth, rows, max_depth)
    first, move = biased_first_token(out[:, 0], logits[:, 0], rows)
    # a moved first token no longer continues the tree: the row emits it alone, and keeps no path
    column = jnp.arange(out.shape[1])[None, :]
    out = jnp.where(move[:, None], jnp.where(column == 0, first[:, None], -1), out)  # [B, T]
    path = jnp.where(move[:, None], jnp.arange(path.shape[1])[None, :], path)  # [B, Z+1] nothing moves
    return out, jnp.where(move, 1, counts), path


def _judged_by_the_root(logits, tokens, parents, depth, rows, max_depth):
    """Broken: every node is accepted against and sampled from the root's distribution (position 0's)."""
    return verify_tree(jnp.broadcast_to(logits[:, :1], logits.shape), tokens, parents, depth, rows, max_depth)


@pytest.mark.parametrize("broken,rows", [(None, N), (_first_token_biased, N), (_judged_by_the_root, N // 16)],
                         ids=["exact", "first-token-biased", "judged-by-the-root"])
def test_draft_tree_steps_preserve_the_target_at_every_position(broken, rows, monkeypatch):
    biased = broken is not None
    if biased:  # the engine's step traces `verify_tree` when it compiles: swap in the broken one
        monkeypatch.setattr(step_bodies, "verify_tree", broken)
    target = random_model(TARGET_CONFIG, seed=3)
    engine = Engine(target, DraftModelProposer(target), MENU)
    engine.warmup(progress=False)
    tokens, counts, caps, pending = emit_rows(engine, ENVELOPE.nodes, CAPS, CONFIG, rows)
    deepest = int(counts.max()) - 1  # every row has the same tree (one context): its deepest accepted path
    if not biased:  # structure, and not vacuous: paths 2+ deep, full-path rows and rejections at every capped cap
        assert deepest >= 2 and np.all((counts >= 1) & (counts <= np.minimum(caps, ENVELOPE.depth) + 1))
        assert 0 < np.mean(counts[caps == 6] == deepest + 1) < 1
        assert 0 < np.mean(counts[caps == 2] >= 2) < 1
        assert np.all(tokens[:, 0] < V)
    results = capped_p_values(tokens, counts, caps, expected_after(target, pending, ENVELOPE.depth, CONFIG),
                              ENVELOPE.depth)
    # every emitted position: x0 (all rows), cap 6: x0 .. x_deepest, cap 2: x0, x1 (x2 if its nodes form a path),
    # cap 0: the bonus x0
    assert set(results) >= ({"x0, all rows", "cap 2, x0", "cap 2, x1", "cap 0, x0 (bonus)"}
                            | {f"cap 6, x{j}" for j in range(deepest + 1)})
    assert len(results) <= 8  # the power computation's m
    # the root's judge draws x_0 right: it must be caught at a later position
    judge(results, broken=biased, caught_by=later_position if broken is _judged_by_the_root else lambda name: True)
