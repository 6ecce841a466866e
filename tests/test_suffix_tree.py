"""The suffix tries and index of suffix decoding (jaxspec.speculation.suffix_tree): counts, proposals, the memory
bound, eviction, scopes, and that removal (a cancelled request) leaves exactly the trie of what remains."""

from __future__ import annotations

import numpy as np
import pytest

from jaxspec.speculation.suffix_tree import PromptOccurrences, SuffixConfig, SuffixIndex, SuffixTrie


def _shape(trie: SuffixTrie) -> dict[tuple[int, ...], int]:
    """Every path of the trie with its count."""
    out, stack = {}, [((), trie.root)]
    while stack:
        path, node = stack.pop()
        for token, child in node.children.items():
            out[path + (token,)] = child.count
            stack.append((path + (token,), child))
    return out


def _substring_counts(seqs, depth) -> dict[tuple[int, ...], int]:
    counts: dict[tuple[int, ...], int] = {}
    for seq in seqs:
        for i in range(len(seq)):
            for j in range(i + 1, min(len(seq), i + depth) + 1):
                counts[tuple(seq[i:j])] = counts.get(tuple(seq[i:j]), 0) + 1
    return counts


def test_trie_counts_every_substring_up_to_depth_incrementally():
    rng = np.random.default_rng(0)
    seqs = [list(rng.integers(0, 4, size=n)) for n in (30, 7, 18)]
    trie = SuffixTrie(depth=5)
    for i, seq in enumerate(seqs):  # fed in pieces, as committed tokens arrive
        for a in range(0, len(seq), 4):
            trie.extend(i, seq[a:a + 4])
    assert _shape(trie) == _substring_counts(seqs, 5)
    assert trie.nodes == len(_substring_counts(seqs, 5)) + 1


def test_match_is_the_longest_continued_suffix():
    """`match` (a binary search over the suffix length) against every length tried from the longest down, on
    random contexts over a small alphabet, after some sequences were removed too."""
    rng = np.random.default_rng(7)
    trie = SuffixTrie(depth=6)
    for i in range(5):
        trie.extend(i, list(rng.integers(0, 3, size=int(rng.integers(5, 30)))))
    trie.remove(1)
    substrings = _shape(trie)
    for _ in range(300):
        context = list(rng.integers(0, 3, size=int(rng.integers(0, 12))))
        expected = 0
        for length in range(min(len(context), 5), 0, -1):
            suffix = tuple(context[len(context) - length:])
            if suffix in substrings and any(path[:-1] == suffix for path in substrings if len(path) == length + 1):
                expected = length
                break
        node, length = trie.match(context)
        assert length == expected, context
        assert (node is None) == (expected == 0)


def test_removal_leaves_the_trie_of_the_remaining_sequences():
    rng = np.random.default_rng(1)
    seqs = {i: list(rng.integers(0, 3, size=25)) for i in range(4)}
    trie = SuffixTrie(depth=6)
    for i, seq in seqs.items():
        trie.extend(i, seq)
    trie.remove(2)
    trie.remove(0)
    rest = [seqs[1], seqs[3]]
    assert _shape(trie) == _substring_counts(rest, 6)
    assert trie.nodes == len(_substring_counts(rest, 6)) + 1


def test_prompt_occurrences_propose_what_a_trie_over_the_prompt_would():
    """`PromptOccurrences` (a prompt's token positions) against a `SuffixTrie` built from the same prompt: the
    same chain (tokens, confidences, match length) and the same tree, on random prompts over small alphabets,
    contexts that continue the prompt or not, every bound and threshold."""
    rng = np.random.default_rng(11)
    for _ in range(2000):
        depth, alphabet = int(rng.integers(2, 9)), int(rng.integers(2, 6))
        prompt = list(rng.integers(0, alphabet, size=int(rng.integers(0, 40))))
        trie = SuffixTrie(depth)
        trie.extend("p", prompt)
        occurrences = PromptOccurrences(prompt, depth)
        head = prompt[:int(rng.integers(0, len(prompt) + 1))] if rng.random() < 0.5 else []
        context = head + list(rng.integers(0, alphabet, size=int(rng.integers(0, 8))))
        max_tokens, min_prob = int(rng.integers(0, 8)), float(rng.choice([0.0, 0.1, 0.3]))
        assert occurrences.propose(context, max_tokens, min_prob) == trie.propose(context, max_tokens, min_prob)
        nodes, max_depth = int(rng.integers(1, 10)), int(rng.integers(1, 5))
        assert (occurrences.propose_tree(context, nodes, max_depth, min_prob)
                == trie.propose_tree(context, nodes, max_depth, min_prob)), (prompt, context, depth)


def test_proposal_is_the_most_frequent_continuation_with_its_frequencies():
    trie = SuffixTrie(depth=8)
    trie.extend("a", [1, 2, 3, 4, 5])
    trie.extend("b", [1, 2, 3, 4, 6])
    trie.extend("c", [1, 2, 3, 7, 8])
    p = trie.propose([9, 1, 2], max_tokens=5, min_prob=0.0)
    # after "1 2": 3 always (3/3), then 4 (2/3) over 7, then 5 or 6 (1/2, the smaller id on a tie)
    assert p.tokens == (3, 4, 5) and p.match_len == 2
    assert p.probs == pytest.approx((1.0, 2 / 3, 0.5))
    assert p.expected_accepted == pytest.approx(1 + 2 / 3 + 1 / 3)


def test_proposal_is_sized_by_confidence():
    trie = SuffixTrie(depth=8)
    trie.extend("a", [1, 2, 3, 4, 5])
    trie.extend("b", [1, 2, 3, 4, 6])
    trie.extend("c", [1, 2, 3, 7, 8])
    assert trie.propose([1, 2], 5, min_prob=0.5).tokens == (3, 4)  # 3 (1.0), 4 (0.67), 5 would be 0.33
    assert trie.propose([1, 2], 5, min_prob=0.9).tokens == (3,)
    assert trie.propose([1, 2], 1, min_prob=0.0).tokens == (3,)
    assert trie.propose([42], 5, min_prob=0.0).tokens == ()  # no match


def test_match_skips_its_own_unfinished_occurrence():
    """The context's own tail is in the trie (a live output) without a continuation: the match is the longest
    suffix that has one."""
    trie = SuffixTrie(depth=8)
    trie.extend("old", [5, 6, 7, 8])
    trie.extend("me", [1, 2, 6, 7])
    p = trie.propose([1, 2, 6, 7], 4, min_prob=0.0)
    assert p.tokens == (8,) and p.match_len == 2


def test_tree_is_best_first_with_distinct_siblings():
    trie = SuffixTrie(depth=8)
    for i, seq in enumerate(([1, 2, 3], [1, 2, 3], [1, 4, 5], [1, 2, 9])):
        trie.extend(i, seq)
    tree = trie.propose_tree([1], max_nodes=4, max_depth=2, min_prob=0.0)
    # children of "1": 2 (3/4), 4 (1/4); under 2: 3 (2/3 -> 0.5), 9 (1/3 -> 0.25); depth 2 at most
    assert tree.tokens[:2] == (2, 3) and tree.parents[:2] == (0, 1) and tree.depths[:2] == (1, 2)
    assert sorted(zip(tree.tokens, tree.parents, tree.depths)) == [(2, 0, 1), (3, 1, 2), (4, 0, 1), (9, 1, 2)]
    for n, parent in enumerate(tree.parents):
        assert parent <= n


def test_index_memory_bound_and_oldest_first_eviction():
    config = SuffixConfig(depth=4, max_requests=3, max_tokens=25)
    index = SuffixIndex(config)
    rng = np.random.default_rng(2)
    outputs = {}
    for r in range(8):
        index.start(r, [100 + r])
        outputs[r] = list(rng.integers(0, 50, size=10))
        index.extend(r, outputs[r])
        index.finish(r, keep=True)
        trie = index.output_trie()
        assert trie.tokens <= config.max_tokens and len(index.retained()) <= config.max_requests
        assert trie.nodes <= 1 + config.depth * config.max_tokens
    assert index.retained() == (6, 7)  # 3 × 10 tokens exceed 25: two newest kept
    assert _shape(index.output_trie()) == _substring_counts([outputs[6], outputs[7]], 4)
    assert index.nodes == index.output_trie().nodes  # no live prompt left


def test_cancelled_request_leaves_the_index_consistent():
    index = SuffixIndex(SuffixConfig(depth=5))
    index.start("done", [1, 2])
    index.extend("done", [3, 4, 5, 3, 4])
    index.finish("done", keep=True)
    before = _shape(index.output_trie())
    index.start("cancelled", [1])
    index.extend("cancelled", [3, 4, 9])
    index.extend("cancelled", [9, 9])
    assert _shape(index.output_trie()) != before
    index.finish("cancelled", keep=False)
    assert _shape(index.output_trie()) == before
    index.finish("cancelled", keep=False)  # a second finish is a no-op
    with pytest.raises(KeyError):
        index.propose("cancelled", 3)


def test_random_lifecycles_keep_every_scope_equal_to_its_model():
    """Requests of three tenants start, grow in pieces, finish (kept) or are cancelled (taken out), interleaved.
    After every operation each tenant's trie is exactly the trie of its retained outputs plus its live ones, the
    retained ones are that tenant's newest kept outputs within both bounds, and the index's nodes are its tries'
    (nothing leaks when a scope empties)."""
    config = SuffixConfig(scope="tenant", depth=4, max_requests=3, max_tokens=12)
    index = SuffixIndex(config)
    rng = np.random.default_rng(5)
    live: dict[int, tuple[str, list[int]]] = {}  # request -> (tenant, output so far)
    kept: dict[str, list[tuple[int, list[int]]]] = {"a": [], "b": [], "c": []}  # tenant -> kept outputs, in order
    next_id = 0
    for _ in range(400):
        op = rng.integers(0, 4) if live else 0
        if op == 0:  # a request starts
            tenant = "abc"[int(rng.integers(0, 3))]
            index.start(next_id, list(rng.integers(0, 6, size=3)), tenant=tenant)
            live[next_id] = (tenant, [])
            next_id += 1
        else:
            rid = list(live)[int(rng.integers(0, len(live)))]
            tenant, output = live[rid]
            if op == 1:  # committed tokens
                piece = list(rng.integers(0, 6, size=int(rng.integers(1, 5))))
                index.extend(rid, piece)
                output.extend(piece)
            else:  # op 2: finished and kept; op 3: cancelled
                index.finish(rid, keep=op == 2)
                del live[rid]
                if op == 2 and output:
                    kept[tenant].append((rid, output))
        for tenant, outputs in kept.items():
            retained, tokens = [], 0
            for rid, output in reversed(outputs):  # the newest first, while both bounds hold
                if len(retained) == config.max_requests or tokens + len(output) > config.max_tokens:
                    break
                retained.insert(0, (rid, output))
                tokens += len(output)
            kept[tenant] = retained  # an evicted output never comes back
            assert index.retained(("tenant", tenant)) == tuple(rid for rid, _ in retained)
            held = [o for _, o in retained] + [o for t, o in live.values() if t == tenant and o]
            trie = index.output_trie(("tenant", tenant))
            assert (_shape(trie) if trie else {}) == _substring_counts(held, config.depth)
        tries = [index.output_trie(("tenant", t)) for t in kept]
        assert index.nodes == sum(t.nodes for t in tries if t) and index.prompt_tokens == 3 * len(live)
    assert next_id > 50 and any(kept.values())


def test_scopes_share_outputs_only_where_configured():
    def proposal(scope: str, tenant_b: str) -> tuple[int, ...]:
        index = SuffixIndex(SuffixConfig(scope=scope, depth=6))
        index.start("a", [7], tenant="t1")
        index.extend("a", [1, 2, 3, 4])
        index.finish("a", keep=True)
        index.start("b", [9, 1, 2], tenant=tenant_b)
        return index.propose("b", 4).tokens

    assert proposal("global", "t2") == (3, 4)
    assert proposal("tenant", "t1") == (3, 4)
    assert proposal("tenant", "t2") == ()
    assert proposal("off", "t1") == ()


def test_prompt_trie_proposes_from_the_request_own_prompt():
    index = SuffixIndex(SuffixConfig(scope="off", depth=6))
    index.start("r", [5, 6, 7, 8, 1, 5, 6])
    assert index.propose("r", 3).tokens == (7, 8, 1)
    index.finish("r", keep=True)
    assert index.nodes == 0 and index.prompt_tokens == 0


def test_on_equal_confidence_the_longer_match_wins():
    """The prompt continues the last token alone (1 token matched), an earlier output the whole context (6): both
    chains are certain by their counts, and the output's, conditioned on more, is proposed (chain and tree)."""
    index = SuffixIndex(SuffixConfig(depth=8, min_prob=0.0))
    index.start("earlier", [9])
    index.extend("earlier", [1, 5, 2, 7, 3, 5, 3, 1, 3])
    index.finish("earlier", keep=True)
    index.start("r", [1, 5, 2, 7, 3])
    index.extend("r", [5])
    assert index.output_trie() is not None
    chain = index.propose("r", 2)
    assert chain.tokens == (3, 1) and chain.match_len == 6  # the prompt's chain: (2, 7), matching 1
    assert chain.expected_accepted == 2.0
    assert index.propose_tree("r", max_nodes=2, max_depth=2).tokens == (3, 1)


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="scope"):
        SuffixConfig(scope="everyone")
    with pytest.raises(ValueError, match="depth"):
        SuffixConfig(depth=1)


def test_a_copy_of_a_held_sequence_is_proposed_in_full_at_every_position():
    """Repeating an earlier output: however long the context's match, the proposal has room for every token asked
    (the match is cut to depth − max_tokens), from the trie and from the prompt alike."""
    seq = list(range(100, 140))
    depth, k = 10, 6
    trie = SuffixTrie(depth)
    trie.extend("earlier", seq)
    occurrences = PromptOccurrences(seq, depth)
    for n in range(1, len(seq) - k):
        for source in (trie, occurrences):
            p = source.propose(seq[:n], k, min_prob=0.5)
            assert p.tokens == tuple(seq[n:n + k]), (n, source)
            assert p.match_len == min(n, depth - k)
            tree = source.propose_tree(seq[:n], max_nodes=k, max_depth=k, min_prob=0.5)
            assert tree.tokens == tuple(seq[n:n + k]) and tree.depths == tuple(range(1, k + 1))


def test_context_holds_checks_a_span_of_the_committed_context():
    index = SuffixIndex(SuffixConfig(depth=8))
    index.start("r", [1, 2, 3])
    index.extend("r", [4, 5])
    assert index.context_holds("r", 3, (4, 5)) and index.context_holds("r", 0, ())
    assert not index.context_holds("r", 3, (4, 6))
    assert not index.context_holds("r", 4, (5, 6))  # runs past what is committed
