"""Token trees (jaxspec/speculation/tree.py, docs/design.md "Token trees"): masks, the prompt-lookup trie, the
accepted path, compaction, and tree steps in the engine equal to plain greedy decoding."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.engine import compile_counter
from jaxspec.engine.engine import Engine
from jaxspec.menu import Menu, TreeEnvelope
from jaxspec.models.kv_cache import init_cache
from jaxspec.models.llama import chain_inputs, serving_split
from jaxspec.speculation import tree as tree_lib
from jaxspec.speculation.proposers.base import StepContext
from jaxspec.speculation.proposers.prompt_lookup import PromptLookupProposer
from jaxspec.speculation.sampling import row_keys
from jaxspec.speculation.verify import verify_tree
from jaxspec.types import RowParams, SamplingParams, TreeProposals
from tests.conftest import random_prompts, reference_greedy


def picture(mask: np.ndarray) -> list[str]:
    return ["".join("x" if v else "." for v in row) for row in mask]


def tree(tokens, parents, depth) -> TreeProposals:
    """One row's tree (nodes 1..N in the step's numbering)."""
    as_row = lambda v: jnp.asarray([v], jnp.int32)  # noqa: E731
    return TreeProposals(token_ids=as_row(tokens), parents=as_row(parents), depth=as_row(depth),
                         lens=jnp.asarray([len(tokens)], jnp.int32))


# root ── a(1) ── b(2) ── c(4)
#     └── d(3)
DOC_TREE = tree(tokens=[11, 12, 13, 14], parents=[0, 1, 0, 2], depth=[1, 2, 1, 3])


def test_the_ancestor_mask_of_the_documented_tree():
    _, parents, depth = tree_lib.with_root(DOC_TREE, jnp.ones((1, 4), bool))
    assert np.asarray(depth)[0].tolist() == [0, 1, 2, 1, 3]
    assert picture(np.asarray(tree_lib.ancestor_mask(parents, max_depth=3))[0]) == [
        "x....",   # root
        "xx...",   # a
        "xxx..",   # b
        "x..x.",   # d
        "xxx.x",   # c
    ]


def test_a_chain_is_the_lower_triangular_tree():
    chain = tree(tokens=[5, 6, 7], parents=[0, 1, 2], depth=[1, 2, 3])  # node i's parent is i − 1
    _, parents, _ = tree_lib.with_root(chain, jnp.ones((1, 3), bool))
    assert picture(np.asarray(tree_lib.ancestor_mask(parents, max_depth=3))[0]) == ["x...", "xx..", "xxx.", "xxxx"]


def _history(tokens: list[int], m: int = 32) -> jax.Array:
    hist = np.zeros((2, m), np.int32)
    hist[0, :len(tokens)] = tokens
    return jnp.asarray(hist)


def test_the_prompt_lookup_trie_merges_shared_prefixes_and_keeps_the_preferred_chain_first():
    # context ... 1 2 | earlier: "1 2 3 4 5", "1 2 3 9 9", "1 2 7 7 7"; the suffix is the pending "1 2"
    context = [1, 2, 3, 4, 5, 0, 1, 2, 3, 9, 9, 0, 1, 2, 7, 7, 7, 0, 1, 2]
    ctx = StepContext(slot_ids=jnp.asarray([0]), start=jnp.asarray([len(context) - 1]),
                      history=_history(context), rows=None)
    proposer = PromptLookupProposer(min_ngram=1, max_ngram=2)
    nodes, _ = proposer.propose_tree((), (), ctx, TreeEnvelope(nodes=6, depth=3), window=32)
    n = int(nodes.lens[0])
    got = list(zip(np.asarray(nodes.token_ids)[0, :n].tolist(), np.asarray(nodes.parents)[0, :n].tolist(),
                   np.asarray(nodes.depth)[0, :n].tolist(), strict=True))
    # most recent match first: 7 7 7 (the chain `propose` gives), then 3 9 9 and 3 4 5 sharing "3"
    #   root ── 7(1) ── 7(2) ── 7(3)
    #       └── 3(4) ── 9(5) ── 9(6)
    #                └── 4(7)  (over the 6-node budget: dropped)
    assert got == [(7, 0, 1), (7, 1, 2), (7, 2, 3), (3, 0, 1), (9, 4, 2), (9, 5, 3)]
    chain, _ = proposer.propose((), (), ctx, 3, window=32)
    assert np.asarray(chain.token_ids)[0].tolist() == [7, 7, 7]


def test_no_match_gives_an_empty_tree():
    ctx = StepContext(slot_ids=jnp.asarray([0]), start=jnp.asarray([3]), history=_history([1, 2, 3, 4]), rows=None)
    nodes, _ = PromptLookupProposer(1, 3).propose_tree((), (), ctx, TreeEnvelope(4, 2), window=32)
    assert int(nodes.lens[0]) == 0


def _greedy_rows(b: int) -> RowParams:
    return RowParams(temperature=jnp.zeros((b,)), top_p=jnp.ones((b,)), top_k=jnp.zeros((b,), jnp.int32),
                     keys=row_keys(jnp.zeros((b,), jnp.int32), jnp.zeros((b,), jnp.int32)))


def test_greedy_tree_verify_walks_the_argmax_path_and_emits_the_next_token():
    v = 20
    # the target's argmax at each node of DOC_TREE: root -> 13 (d), d -> 5 (no child), a -> 12, b -> 14
    argmax = {0: 13, 1: 12, 2: 14, 3: 5, 4: 8}
    logits = jnp.asarray([[jax.nn.one_hot(argmax[t], v) * 3.0 for t in range(5)]], jnp.float32)  # [1, T, V]
    tokens, parents, depth = tree_lib.with_root(DOC_TREE, jnp.ones((1, 4), bool))
    out, counts, path = verify_tree(logits, tokens, parents, depth, _greedy_rows(1), max_depth=3)
    assert np.asarray(out)[0].tolist() == [13, 5, -1, -1, -1] and int(counts[0]) == 2
    assert np.asarray(path)[0].tolist() == [0, 3, 2, 3]  # root, d; columns past the path hold their own index
    # the root drawing 11 follows a -> b -> c, and c's own draw is the bonus token
    argmax[0] = 11
    logits = jnp.asarray([[jax.nn.one_hot(argmax[t], v) * 3.0 for t in range(5)]], jnp.float32)
    out, counts, path = verify_tree(logits, tokens, parents, depth, _greedy_rows(1), max_depth=3)
    assert np.asarray(out)[0].tolist() == [11, 12, 14, 8, -1] and int(counts[0]) == 4
    assert np.asarray(path)[0].tolist() == [0, 1, 2, 4]
    # invalid nodes are never accepted
    tokens, parents, depth = tree_lib.with_root(DOC_TREE, jnp.asarray([[True, False, False, False]]))
    out, counts, _ = verify_tree(logits, tokens, parents, depth, _greedy_rows(1), max_depth=3)
    assert np.asarray(out)[0].tolist() == [11, 12, -1, -1, -1] and int(counts[0]) == 2


def test_compaction_moves_the_accepted_path_to_where_a_chain_has_it(tiny_model):
    """After a tree step over DOC_TREE with the path root, a, b, c accepted, compaction leaves at
    positions start .. start + 3 exactly (bitwise) the K/V the tree step wrote for those nodes, and the
    history before untouched. Scored as a chain of the same width over the same cache, the same path gives
    the same K/V: bitwise where the nodes sit in the chain's own columns (root, a, b: masked columns add
    exact zeros), and to float32 rounding for c, which the tree step scored in column 4 (its attention
    sums the same terms in another order)."""
    c = tiny_model.config
    graphdef, (params, layers) = serving_split(tiny_model)
    window, prompt = 32, [3, 9, 4, 7, 1, 8]
    s = len(prompt)
    start = jnp.asarray([s], jnp.int32)
    slot = jnp.asarray([0], jnp.int32)

    @jax.jit
    def run(cache, inputs):
        from flax import nnx

        return nnx.merge(graphdef, params).forward_cached(inputs, cache, window, layers=layers)[1]

    cache = run(init_cache(c, 1, window), chain_inputs(jnp.asarray([prompt]), slot, jnp.zeros((1,), jnp.int32)))
    rooted = tree_lib.with_root(DOC_TREE, jnp.ones((1, 4), bool))
    tree_cache = run(cache, tree_lib.tree_inputs(jnp.asarray([5]), rooted, slot, start, 3))
    compacted = tree_lib.compact(tree_cache, slot, start, jnp.asarray([[0, 1, 2, 4]], jnp.int32))  # root, a, b, c
    chain_cache = run(cache, chain_inputs(jnp.asarray([[5, 11, 12, 14, 0]]), slot, start))  # T = 5, as the tree
    for layer in range(c.num_layers):
        for name in ("k", "v"):
            before, got = np.asarray(getattr(tree_cache, name)[layer]), np.asarray(getattr(compacted, name)[layer])
            want = np.asarray(getattr(chain_cache, name)[layer])
            np.testing.assert_array_equal(got[0, :s], before[0, :s])  # the history
            np.testing.assert_array_equal(got[0, s:s + 4], before[0, [s, s + 1, s + 2, s + 4]])  # moved exactly
            np.testing.assert_array_equal(got[0, :s + 3], want[0, :s + 3])  # root, a, b
            np.testing.assert_allclose(got[0, s + 3], want[0, s + 3], rtol=1e-5, atol=1e-6)  # c


MENU = Menu(num_slots=3, max_len=128, batch_buckets=(1, 2, 3), k_menu=(0, 4, 6), window_buckets=(64, 128),
            prefill_buckets=(16, 64))


@pytest.fixture(scope="module")
def tree_engine(tiny_model):
    compile_counter.install()
    engine = Engine(tiny_model, PromptLookupProposer(1, 3), MENU.with_tree(TreeEnvelope(6, 3)))
    engine.warmup(progress=False)
    return engine


def test_a_menu_holds_each_tree_at_its_k_and_refuses_bad_envelopes():
    menu = MENU.with_tree(TreeEnvelope(8, 4))
    assert menu.k_menu == (0, 4, 6, 8) and menu.tree_at(8) == TreeEnvelope(8, 4) and menu.tree_at(4) is None
    assert menu.with_k_menu((0, 4)).tree_envelopes == ()
    assert TreeEnvelope.parse("8") == TreeEnvelope(8, 4) and TreeEnvelope.parse("5:2") == TreeEnvelope(5, 2)
    for bad in ("0", "4:5", "x", "4:0", "4:"):
        with pytest.raises(ValueError):
            TreeEnvelope.parse(bad)
    with pytest.raises(ValueError, match="needs k=5"):
        Menu(k_menu=(0, 4), tree_envelopes=(TreeEnvelope(5, 2),))


def test_an_engine_refuses_trees_from_a_proposer_that_cannot_build_them(tiny_model):
    from jaxspec.speculation.proposers.draft_model import DraftModelProposer
    from jaxspec.speculation.proposers.noisy import NoisyProposer

    with pytest.raises(ValueError, match="token trees"):
        Engine(tiny_model, NoisyProposer(DraftModelProposer(tiny_model), 0.5, tiny_model.config.vocab_size),
               MENU.with_tree(TreeEnvelope(6, 3)))


def test_tree_steps_equal_plain_greedy_decoding_in_a_mixed_batch(tiny_model, tree_engine):
    """Three rows (repetitive prompts, so the trie has branches; one capped at 2), tree steps at k = 6 and
    chain steps at k = 4 interleaved, a row freed and refilled: every row's tokens equal plain greedy
    decoding, and nothing compiles after warm-up."""
    engine = tree_engine
    engine.reset()
    base = random_prompts([5, 7, 4, 6], tiny_model.config.vocab_size, seed=3)
    prompts = [base[0] * 3 + base[1], base[1] * 2 + base[0] * 2, base[2] * 4, base[3] * 3]
    want = [reference_greedy(tiny_model, p, 24) for p in prompts]
    greedy = SamplingParams(temperature=0.0)
    out = {s: [engine.prefill(s, prompts[s], greedy)] for s in range(3)}
    compiles = compile_counter.count()
    tree_tokens = mixed_batch_tree_counts(engine, prompts, want, out, lambda step: 6 if step % 3 else 4, 6)
    assert compile_counter.count() == compiles
    assert max(tree_tokens) > 1  # trees did accept tokens


def mixed_batch_tree_counts(engine, prompts, want, out, k_at, tree_k: int, n: int = 24) -> list[int]:
    """Step slots 0..2 (prefilled with prompts 0..2; `out` holds their first tokens) with k = k_at(step), row 1
    capped at 2, until each has n tokens, asserting they equal `want`; slot by slot the last prompt is
    prefilled into the first freed slot. Returns the counts every row emitted in the steps at k = tree_k."""
    greedy = SamplingParams(temperature=0.0)
    queue, rows, steps, tree_counts = [3], {0: 0, 1: 1, 2: 2}, 0, []
    while rows:
        slots = sorted(rows)
        k = k_at(steps)
        result = engine.step(slots, k, row_k=[2 if rows[s] == 1 else k for s in slots])
        for i, s in enumerate(slots):
            out[s] += list(result.tokens[i, :result.counts[i]])
            if k == tree_k:
                tree_counts.append(int(result.counts[i]))
        steps += 1
        for s in slots:
            if len(out[s]) >= n:
                done = rows.pop(s)
                assert [int(t) for t in out[s][:n]] == want[done], f"prompt {done}"
                engine.free(s)
                if queue:
                    p = queue.pop()
                    rows[s] = p
                    out[s] = [engine.prefill(s, prompts[p], greedy)]
    return tree_counts


def test_real_smollm2_tree_steps_equal_plain_greedy_decoding():
    """The real default model on a code-editing prompt (the answer repeats the input, so the trie has
    real branches): tree steps of 8 nodes from prompt lookup (at most 4 deep) and from the shipped draft
    (at most 3 deep, EAGLE-2-style) give the plain engine's greedy tokens, accept more than one token per
    step on average, and compile nothing after warm-up."""
    from jaxspec.engine.build import build_model, build_proposer

    built = build_model(None)
    menu = Menu(num_slots=1, max_len=512, batch_buckets=(1,), k_menu=(0, 8), window_buckets=(512,),
                prefill_buckets=(256,))
    source = ("def add_numbers(first, second):\n    total = first + second\n    return total\n\n"
              "def multiply_numbers(first, second):\n    product = first * second\n    return product\n")
    text = built.tokenizer.apply_chat_template([{"role": "user", "content": source + "\nRename `first` to `a` "
                                                 "and `second` to `b` in both functions; return the whole code."}])
    prompt = built.tokenizer.encode(text)
    greedy = SamplingParams(temperature=0.0)

    compile_counter.install()

    def decode(engine, k, n=48):
        engine.warmup(progress=False)
        compiles = compile_counter.count()
        out, steps = [engine.prefill(0, prompt, greedy)], 0
        while len(out) < n:
            result = engine.step([0], k)
            out += [int(t) for t in result.tokens[0, :result.counts[0]]]
            steps += 1
        return out[:n], steps, compile_counter.count() - compiles

    plain, _, _ = decode(Engine(built.model, None, menu), 0)
    trees = {"prompt lookup": (PromptLookupProposer(1, 3), TreeEnvelope(8, 4)),
             "shipped draft": (build_proposer("draft", built.model, "default"), TreeEnvelope(8, 3))}
    for name, (proposer, envelope) in trees.items():
        tree_out, steps, compiles = decode(Engine(built.model, proposer, menu.with_tree(envelope)), 8)
        assert tree_out == plain, name
        assert compiles == 0, name
        assert steps < len(plain) - 1, name  # some step accepted proposals
