"""Draft-model token trees
(jaxspec/speculation/proposers/draft_model.py `propose_tree`, docs/design.md "Token trees"): the
tree is the EAGLE-2 expansion a cache-free reference computes, `commit_tree` leaves the draft cache a chain's,
and tree steps in the engine equal plain greedy decoding with nothing compiled after warm-up."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.engine import compile_counter
from jaxspec.engine.engine import Engine
from jaxspec.menu import Menu, TreeEnvelope
from jaxspec.models.config import TINY
from jaxspec.models.llama import chain_inputs
from jaxspec.speculation.proposers.base import StepContext
from jaxspec.speculation.proposers.draft_model import DraftModelProposer, tree_width
from jaxspec.speculation.sampling import row_keys
from jaxspec.types import RowParams, SamplingParams
from tests.conftest import random_prompts, reference_greedy
from tests.test_engine_greedy import _truncated
from tests.test_tree import mixed_batch_tree_counts

M = 64  # cache positions in the unit tests
WINDOW = 64


def _peaked(target):
    """A one-layer draft with a pruned vocabulary (every other id) and a scaled shared embedding: peaked
    distributions, so its trees go deep (the random tiny models' are nearly flat)."""
    from flax import nnx

    from jaxspec.models.draft import DraftLlama
    return DraftLlama(target.config.replace(num_layers=1), embed=target.embed.value * 4.0,
                      keep_ids=np.arange(0, target.config.vocab_size, 2), rngs=nnx.Rngs(3))


def _prefilled(proposer, prompt: list[int], pending: int):
    """(params, draft cache holding `prompt` in slot 0, ctx with `pending` at position len(prompt))."""
    params = proposer.params()
    s = len(prompt)
    state = proposer.init_state(1, M)
    inputs = chain_inputs(jnp.asarray([prompt], jnp.int32), jnp.asarray([0], jnp.int32), jnp.zeros((1,), jnp.int32))
    state = jax.jit(lambda p, st, x: proposer.prefill(p, st, x, jnp.asarray([s]), WINDOW))(params, state, inputs)
    history = np.zeros((2, M), np.int32)
    history[0, :s], history[0, s] = prompt, pending
    rows = RowParams(temperature=jnp.zeros((1,)), top_p=jnp.ones((1,)), top_k=jnp.zeros((1,), jnp.int32),
                     keys=row_keys(jnp.zeros((1,), jnp.int32), jnp.zeros((1,), jnp.int32)))
    ctx = StepContext(slot_ids=jnp.asarray([0], jnp.int32), start=jnp.asarray([s], jnp.int32),
                      history=jnp.asarray(history), rows=rows)
    return params, state, ctx


def _reference_tree(draft, context: list[int], envelope: TreeEnvelope):
    """The expansion of the module doc with the cache-free causal forward: [(token, parent, depth)] best first
    (parent = 0 for the root, else the parent's 1-based rank) and each node's path log-probability."""
    a, z = tree_width(envelope), envelope.depth

    def logp(path):  # log-probabilities after context + path
        logits = np.asarray(draft(jnp.asarray([context + path], jnp.int32))[0, -1], np.float64)
        return logits - np.logaddexp.reduce(logits)

    def top(path, score):  # the A most probable children of a node: [(score, token)]
        lp = logp(path)
        best = np.argsort(-lp, kind="stable")[:a]
        return [(score + lp[t], int(t)) for t in best]

    cands = [(s, t, -1, 1, [t]) for s, t in top([], 0.0)]  # score, token, parent index, depth, path
    frontier = list(range(len(cands)))
    for depth in range(2, z + 1):
        children = []
        for f in frontier:
            children += [(s, t, f, depth, cands[f][4] + [t]) for s, t in top(cands[f][4], cands[f][0])]
        first = len(cands)
        cands += children
        frontier = sorted(range(first, len(cands)), key=lambda i: -cands[i][0])[:a]
    order = sorted(range(len(cands)), key=lambda i: -cands[i][0])[:envelope.nodes]
    rank = {c: r + 1 for r, c in enumerate(order)}
    return [(cands[c][1], rank.get(cands[c][2], 0), cands[c][3]) for c in order], [cands[c][0] for c in order]


@pytest.mark.parametrize("kind,envelope", [("truncated", "6:3"), ("truncated", "8:4"), ("truncated", "4:1"),
                                           ("truncated", "3:3"), ("peaked", "8:3"), ("peaked", "7:4")])
def test_the_draft_tree_is_the_most_probable_expansion(tiny_model, kind, envelope):
    """The compiled tree (cached level calls under the tree mask) equals the reference expansion from the
    cache-free forward on every root path: same tokens, parents and depths in the same order; every node
    after its parent; siblings distinct. 3:3 (A = 1) is the draft's own greedy chain; the peaked draft has a
    pruned vocabulary (-inf logits outside it) and deep trees."""
    envelope = TreeEnvelope.parse(envelope)
    draft = _truncated(tiny_model, 1) if kind == "truncated" else _peaked(tiny_model)
    proposer = DraftModelProposer(draft)
    prompt = random_prompts([9], TINY.vocab_size, seed=4)[0]
    params, state, ctx = _prefilled(proposer, prompt, pending=17)
    nodes, _ = jax.jit(lambda p, st, c: proposer.propose_tree(p, st, c, envelope, WINDOW))(params, state, ctx)
    want, scores = _reference_tree(draft, prompt + [17], envelope)
    got = list(zip(*(np.asarray(x)[0].tolist() for x in (nodes.token_ids, nodes.parents, nodes.depth))))
    n = len(want)
    assert int(nodes.lens[0]) == n and got[:n] == want, (got, want)
    assert all(parent < i + 1 for i, (_, parent, _) in enumerate(got[:n]))
    assert np.all(np.diff(scores) <= 0)
    siblings = {}
    for token, parent, _ in got[:n]:
        siblings.setdefault(parent, []).append(token)
    assert all(len(set(ts)) == len(ts) for ts in siblings.values())
    if envelope.depth == envelope.nodes:  # A = 1: the greedy chain
        assert [p for _, p, _ in got] == list(range(envelope.nodes))


@pytest.mark.parametrize("accept", ["fed", "unfed", "none"])
def test_commit_keeps_the_accepted_path_where_a_chain_has_it(tiny_model, accept):
    """After `commit_tree`, the draft cache equals (to float32 rounding) a fresh prefill of prompt, pending and
    the accepted path, up to its new length: start + 1 + depth when the deepest accepted node was fed to the
    draft (a frontier node), one less when it was not (a leaf: the next step's catch-up feeds it)."""
    envelope = TreeEnvelope(8, 3)
    draft = _peaked(tiny_model)
    proposer = DraftModelProposer(draft)
    prompt = random_prompts([7], TINY.vocab_size, seed=1)[0]
    params, state, ctx = _prefilled(proposer, prompt, pending=22)
    nodes, state = jax.jit(lambda p, st, c: proposer.propose_tree(p, st, c, envelope, WINDOW))(params, state, ctx)
    tokens, parents, depth, slots = (np.asarray(x)[0] for x in (nodes.token_ids, nodes.parents, nodes.depth,
                                                                 nodes.draft_slots))
    fed = [i + 1 for i in range(len(depth)) if slots[i] >= 0 and depth[i] == 2]  # its parent was fed too
    unfed = [i + 1 for i in range(len(depth)) if slots[i] < 0]  # depth 3 = Z: never fed
    assert fed and unfed, "this prompt's tree has both kinds of node"
    node = {"fed": fed[0], "unfed": unfed[-1], "none": 0}[accept]
    path_nodes = []
    while node:
        path_nodes.insert(0, node)
        node = int(parents[node - 1])
    n = len(path_nodes)
    path = np.arange(envelope.depth + 1)
    path[1:n + 1] = path_nodes
    committed = jax.jit(lambda p, st, c, nd, pa, na: proposer.commit_tree(p, st, c, nd, pa, na, WINDOW))(
        params, state, ctx, nodes, jnp.asarray([path], jnp.int32), jnp.asarray([n], jnp.int32))
    kept = n - 1 if n and slots[path_nodes[-1] - 1] < 0 else n
    s = len(prompt)
    assert int(committed.lengths[0]) == s + 1 + kept
    fresh = [*prompt, 22, *(int(tokens[i - 1]) for i in path_nodes[:kept])]
    params, want, _ = _prefilled(proposer, fresh, pending=0)
    for layer in range(draft.config.num_layers):
        for name in ("k", "v"):
            got_kv = np.asarray(getattr(committed, name)[layer])[0, :len(fresh)]
            want_kv = np.asarray(getattr(want, name)[layer])[0, :len(fresh)]
            np.testing.assert_allclose(got_kv, want_kv, rtol=1e-5, atol=1e-6)


MENU = Menu(num_slots=3, max_len=128, batch_buckets=(3,), k_menu=(0, 4), window_buckets=(128,),
            prefill_buckets=(64,))


@pytest.mark.parametrize("draft_kind,envelope", [("self", "6:3"), ("truncated", "6:3"), ("truncated", "4:1"),
                                                 ("truncated", "5:5")])
def test_draft_tree_steps_equal_plain_greedy_decoding(tiny_model, draft_kind, envelope):
    """Three rows (one capped at 2 nodes), tree steps, chain steps at k = 4 and plain steps interleaved (the
    draft lags after k = 0 and catches up), a row freed and refilled: every row's tokens equal plain greedy
    decoding, the trees accept tokens, and nothing compiles after warm-up. The target as its own draft accepts
    whole paths (deep compaction); the truncated draft is often rejected."""
    envelope = TreeEnvelope.parse(envelope)
    draft = tiny_model if draft_kind == "self" else _truncated(tiny_model, 1)
    compile_counter.install()
    engine = Engine(tiny_model, DraftModelProposer(draft), MENU.with_tree(envelope))
    engine.warmup(progress=False)
    prompts = random_prompts([5, 17, 9, 12], TINY.vocab_size, seed=8)
    want = [reference_greedy(tiny_model, p, 24) for p in prompts]
    greedy = SamplingParams(temperature=0.0)
    out = {s: [engine.prefill(s, prompts[s], greedy)] for s in range(3)}
    compiles = compile_counter.count()
    k_cycle = [envelope.nodes, envelope.nodes, 4, 0, envelope.nodes]
    tree_counts = mixed_batch_tree_counts(engine, prompts, want, out, lambda step: k_cycle[step % len(k_cycle)],
                                          envelope.nodes)
    assert compile_counter.count() == compiles
    assert max(tree_counts) > 1  # trees did accept tokens
    if draft_kind == "self":  # the target's own argmax is always in its tree: every tree step accepts a path
        assert min(tree_counts) >= 2
