"""Suffix decoding's host structures (docs/design.md, "Suffix decoding"): depth-bounded suffix tries over token
ids with per-node counts, and the index that keeps them for the server's requests.

`SuffixTrie` holds every substring of at most `depth` tokens of its sequences as a path from the root; a node's
count is how many times its substring occurs. Sequences grow token by token (O(depth) per token) and leave whole
(their substrings' counts are taken back, nodes that reach 0 are dropped), so the trie always equals the one
built from the sequences it holds. A proposal walks from the longest suffix of the context that has a
continuation and leaves room for the proposal (`match_room`), taking the most frequent child each time; each
token carries its conditional frequency (count(child) / Σ count(children)), the tree's confidence.

`SuffixIndex` keeps, per scope key (global, per tenant, or none), one trie over the outputs of the last
`max_requests` requests (and at most `max_tokens` output tokens: the oldest finished request is evicted first),
plus, per live request, its own prompt (`PromptOccurrences`: searched as a trie over the prompt would be, from
each token's positions, so admission costs O(len), not O(len · depth)). Running requests' outputs enter their
scope's trie as they are committed; a cancelled or failed request's output is taken back out. Memory is bounded:
at most `max_tokens + live requests' outputs` tokens in the global tries, each at most `depth` nodes, plus the
live prompts' tokens.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
from collections.abc import Callable, Hashable, Sequence

SCOPES = ("global", "tenant", "off")


class _Node:
    __slots__ = ("children", "count")

    def __init__(self):
        self.children: dict[int, _Node] = {}
        self.count = 0


@dataclasses.dataclass(frozen=True)
class SuffixProposal:
    """A chain proposal: tokens, each one's conditional frequency in the trie (its confidence), and the length of
    the context suffix it continues (0: no match, no tokens)."""

    tokens: tuple[int, ...] = ()
    probs: tuple[float, ...] = ()
    match_len: int = 0

    @property
    def expected_accepted(self) -> float:
        """Σ_d Π_{j≤d} probs_j: the tokens this proposal is expected to get accepted, by the trie's counts."""
        total, reach = 0.0, 1.0
        for p in self.probs:
            reach *= p
            total += reach
        return total


@dataclasses.dataclass(frozen=True)
class SuffixTree:
    """A token tree proposal: node n (0-based) has token tokens[n], parent parents[n] (0: the root, i ≥ 1: node i)
    and depth depths[n] ≥ 1; parents come first; siblings carry distinct tokens."""

    tokens: tuple[int, ...] = ()
    parents: tuple[int, ...] = ()
    depths: tuple[int, ...] = ()



def best_first_tree(root, children: Callable, max_nodes: int, max_depth: int, min_prob: float) -> SuffixTree:
    """A tree of continuations, nodes added best-first by path probability (at least `min_prob`), at most
    `max_nodes` nodes and `max_depth` deep. `children(node, depth)` gives a node's continuations at `depth` as
    {token: (count, child node)}, in the order ties keep (a trie's, or the prompt's occurrences')."""
    tokens: list[int] = []
    parents: list[int] = []
    depths: list[int] = []
    heap: list[tuple] = []  # (-path prob, order, parent id, depth, token, child node)
    order = 0

    def push_children(parent, parent_id: int, parent_reach: float, depth: int) -> None:
        nonlocal order
        if depth > max_depth:
            return
        continuations = children(parent, depth)
        total = sum(count for count, _ in continuations.values())
        for token, (count, child) in continuations.items():
            reach = parent_reach * count / total
            if reach >= min_prob:
                heapq.heappush(heap, (-reach, order, parent_id, depth, token, child))
                order += 1

    push_children(root, 0, 1.0, 1)
    while heap and len(tokens) < max_nodes:
        neg_reach, _, parent_id, depth, token, child = heapq.heappop(heap)
        tokens.append(token)
        parents.append(parent_id)
        depths.append(depth)
        push_children(child, len(tokens), -neg_reach, depth + 1)
    return SuffixTree(tuple(tokens), tuple(parents), tuple(depths))

def match_room(depth: int, continuation: int) -> int:
    """The longest match a proposal of `continuation` tokens may continue in a trie of paths `depth` deep: a
    substring is at most `depth` tokens, match and continuation together, so a longer match would cut the
    proposal short just when the context repeats a held sequence (a copy proposes one token per step at
    match length depth − 1). At least 1."""
    return max(1, depth - continuation)


class SuffixTrie:
    """Every substring of at most `depth` tokens of the held sequences, with occurrence counts."""

    def __init__(self, depth: int):
        if depth < 2:
            raise ValueError(f"a suffix trie needs depth >= 2, got {depth}")
        self.depth = depth
        self.root = _Node()
        self.nodes = 1  # the root included
        self._sequences: dict[Hashable, list[int]] = {}
        self._active: dict[Hashable, list[_Node]] = {}  # per sequence: nodes of its suffixes of length 1 .. depth

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._sequences

    @property
    def tokens(self) -> int:
        """Tokens held over all sequences."""
        return sum(len(s) for s in self._sequences.values())

    def sequence(self, seq_id: Hashable) -> tuple[int, ...]:
        return tuple(self._sequences[seq_id])

    def extend(self, seq_id: Hashable, tokens: Sequence[int]) -> None:
        """Append tokens to a sequence (a new one if unseen): each adds the substrings ending at it."""
        seq = self._sequences.setdefault(seq_id, [])
        active = self._active.setdefault(seq_id, [])
        for token in tokens:
            token = int(token)
            grown = []
            for node in [self.root, *active[: self.depth - 1]]:  # suffixes of length 0 .. depth-1 grow by one
                child = node.children.get(token)
                if child is None:
                    child = node.children[token] = _Node()
                    self.nodes += 1
                child.count += 1
                grown.append(child)
            active[:] = grown  # suffixes of length 1 .. depth, shortest first
            seq.append(token)

    def remove(self, seq_id: Hashable) -> None:
        """Take a sequence's substrings back out (nodes whose count reaches 0 are dropped)."""
        seq = self._sequences.pop(seq_id)
        del self._active[seq_id]
        for start in range(len(seq)):
            node = self.root
            for token in seq[start: start + self.depth]:
                child = node.children[token]
                child.count -= 1
                if child.count == 0:
                    self.nodes -= self._size(child)
                    del node.children[token]
                    break  # its descendants (counts ≤ its own) went with it
                node = child

    @staticmethod
    def _size(node: _Node) -> int:
        stack, n = [node], 0
        while stack:
            cur = stack.pop()
            n += 1
            stack.extend(cur.children.values())
        return n

    def match(self, context: Sequence[int], max_len: int | None = None) -> tuple[_Node | None, int]:
        """The node of the longest suffix of `context` (shorter than `depth`, at most `max_len` tokens) that has a
        continuation, and its length; (None, 0) if none has. The trie holds every substring of what it holds, so if
        a suffix is continued every shorter one is too: a binary search over the length finds the longest,
        O(depth log depth)."""
        found: tuple[_Node | None, int] = (None, 0)
        longest = self.depth - 1 if max_len is None else min(max_len, self.depth - 1)
        low, high = 1, min(len(context), longest)
        while low <= high:
            length = (low + high) // 2
            node = self._continued(context, length)
            if node is None:
                high = length - 1
            else:
                found, low = (node, length), length + 1
        return found

    def _continued(self, context: Sequence[int], length: int) -> _Node | None:
        """The node of the last `length` tokens of `context` if the trie holds them with a continuation."""
        node = self.root
        for token in context[len(context) - length:]:
            node = node.children.get(int(token))
            if node is None:
                return None
        return node if node.children else None

    def propose(self, context: Sequence[int], max_tokens: int, min_prob: float) -> SuffixProposal:
        """The most frequent continuation of the context's longest continued suffix that leaves the continuation
        room for `max_tokens` tokens (`match_room`), up to `max_tokens` tokens, stopping before the path's
        probability (the product of the tokens' confidences) falls below `min_prob`."""
        node, match_len = self.match(context, match_room(self.depth, max_tokens))
        tokens, probs, reach = [], [], 1.0
        # a path is at most depth deep: the continuation of a match of n tokens has depth - n levels
        while node is not None and node.children and len(tokens) < min(max_tokens, self.depth - match_len):
            total = sum(c.count for c in node.children.values())
            token, child = max(node.children.items(), key=lambda item: (item[1].count, -item[0]))
            p = child.count / total
            if reach * p < min_prob:
                break
            reach *= p
            tokens.append(token)
            probs.append(p)
            node = child
        return SuffixProposal(tuple(tokens), tuple(probs), match_len if tokens else 0)

    def propose_tree(self, context: Sequence[int], max_nodes: int, max_depth: int, min_prob: float) -> SuffixTree:
        """The most probable continuations as a tree: nodes added best-first by path probability (at least
        `min_prob`), at most `max_nodes` nodes and `max_depth` deep."""
        node, match_len = self.match(context, match_room(self.depth, max_depth))
        if node is None:
            return SuffixTree()

        def children(parent: _Node, depth: int) -> dict[int, tuple[int, _Node]]:
            if match_len + depth > self.depth:  # a path is at most depth deep
                return {}
            return {token: (child.count, child) for token, child in parent.children.items()}

        return best_first_tree(node, children, max_nodes, max_depth, min_prob)


class PromptOccurrences:
    """A request's prompt, searched as a `SuffixTrie` of the same depth over it alone would be (the same match,
    counts, chain and tree), from the positions of each token: built in O(len) where the trie takes O(len · depth)
    nodes, and each query costs O(occurrences of the context's last token · depth)."""

    def __init__(self, prompt: Sequence[int], depth: int):
        if depth < 2:
            raise ValueError(f"a suffix trie needs depth >= 2, got {depth}")
        self.depth = depth
        self.tokens = [int(t) for t in prompt]
        self._positions: dict[int, list[int]] = {}
        for i, token in enumerate(self.tokens):
            self._positions.setdefault(token, []).append(i)

    def match(self, context: Sequence[int], max_len: int | None = None) -> tuple[list[int], int]:
        """The start positions of the longest suffix of `context` (shorter than `depth`, at most `max_len` tokens)
        that occurs in the prompt with a following token, among those occurrences that have one, and its length;
        ([], 0) if none."""
        prompt, n = self.tokens, len(self.tokens)
        limit = min(len(context), self.depth - 1 if max_len is None else min(max_len, self.depth - 1))
        if limit == 0:
            return [], 0
        tail = [int(t) for t in context[len(context) - limit:]]  # [limit] the suffixes' tokens
        best, starts = 0, []
        for end in self._positions.get(tail[-1], ()):  # an occurrence of the last token, continued if end + 1 < n
            if end + 1 >= n:
                continue
            length = 1
            while length < limit and end - length >= 0 and prompt[end - length] == tail[-1 - length]:
                length += 1
            if length > best:
                best, starts = length, [end - length + 1]
            elif length == best:
                starts.append(end - length + 1)
        return starts, best

    def _children(self, starts: list[int], length: int) -> dict[int, list[int]]:
        """The tokens following the substring of `length` tokens at `starts`, each with its starts (first
        occurrence first, the order the trie creates its children in)."""
        children: dict[int, list[int]] = {}
        for start in starts:
            if start + length < len(self.tokens):
                children.setdefault(self.tokens[start + length], []).append(start)
        return children

    def propose(self, context: Sequence[int], max_tokens: int, min_prob: float) -> SuffixProposal:
        """As `SuffixTrie.propose` over the prompt."""
        starts, match_len = self.match(context, match_room(self.depth, max_tokens))
        tokens, probs, reach, length = [], [], 1.0, match_len
        while starts and len(tokens) < min(max_tokens, self.depth - match_len):
            children = self._children(starts, length)
            if not children:
                break
            token, starts_after = max(children.items(), key=lambda item: (len(item[1]), -item[0]))
            p = len(starts_after) / sum(len(s) for s in children.values())
            if reach * p < min_prob:
                break
            reach *= p
            tokens.append(token)
            probs.append(p)
            starts, length = starts_after, length + 1
        return SuffixProposal(tuple(tokens), tuple(probs), match_len if tokens else 0)

    def propose_tree(self, context: Sequence[int], max_nodes: int, max_depth: int, min_prob: float) -> SuffixTree:
        """As `SuffixTrie.propose_tree` over the prompt."""
        starts, match_len = self.match(context, match_room(self.depth, max_depth))
        if not starts:
            return SuffixTree()

        def children(parent_starts: list[int], depth: int) -> dict[int, tuple[int, list[int]]]:
            if match_len + depth > self.depth:
                return {}
            return {token: (len(child_starts), child_starts)
                    for token, child_starts in self._children(parent_starts, match_len + depth - 1).items()}

        return best_first_tree(starts, children, max_nodes, max_depth, min_prob)


@dataclasses.dataclass(frozen=True)
class SuffixConfig:
    """scope:         'global' (one trie over every request's outputs), 'tenant' (one per tenant key) or 'off'
                   (no outputs shared between requests: each request sees its prompt and its own output only).
    depth:         longest substring held (match + continuation), in tokens.
    max_requests:  finished requests whose outputs a scope's trie keeps (oldest evicted first).
    max_tokens:    output tokens of finished requests a scope's trie keeps at most (oldest evicted first).
    min_prob:      a proposal stops before its path probability falls below this.
    ahead:         the scheduler overlaps suffix steps, proposing for a row in flight as if its step accepts its
                   proposals (docs/design.md, "The overlapped loop"); False: it reads each step first.
    """

    scope: str = "global"
    depth: int = 24
    max_requests: int = 256
    max_tokens: int = 65536
    min_prob: float = 0.1
    ahead: bool = False

    def __post_init__(self):
        if self.scope not in SCOPES:
            raise ValueError(f"suffix scope must be one of {', '.join(SCOPES)}, got {self.scope!r}")
        if self.depth < 2:
            raise ValueError(f"suffix depth must be >= 2, got {self.depth}")
        if self.max_requests < 0 or self.max_tokens < 0:
            raise ValueError("suffix max_requests and max_tokens must be >= 0")
        if not 0.0 <= self.min_prob <= 1.0:
            raise ValueError(f"suffix min_prob must be in [0, 1], got {self.min_prob}")


def _rank(proposal: SuffixProposal) -> tuple[float, int]:
    """How `SuffixIndex` ranks two tries' chains: expected accepted tokens, then match length."""
    return proposal.expected_accepted, proposal.match_len


@dataclasses.dataclass(eq=False)
class _Live:
    scope_key: Hashable
    context: list[int]  # prompt + committed output
    prompt: PromptOccurrences


class SuffixIndex:
    """The tries suffix decoding proposes from, fed by the scheduler (`start`, `extend`, `finish`)."""

    def __init__(self, config: SuffixConfig = SuffixConfig()):
        self.config = config
        self._outputs: dict[Hashable, SuffixTrie] = {}  # scope key -> trie of outputs
        self._finished: dict[Hashable, collections.OrderedDict[Hashable, int]] = {}  # scope -> request -> tokens
        self._live: dict[Hashable, _Live] = {}

    def _scope_key(self, request_id: Hashable, tenant: Hashable | None) -> Hashable:
        if self.config.scope == "global":
            return "global"
        if self.config.scope == "tenant":
            return ("tenant", tenant)
        return ("request", request_id)  # off: a request's own output only

    def start(self, request_id: Hashable, prompt: Sequence[int], tenant: Hashable | None = None) -> None:
        """A request is admitted: its prompt is indexed (`PromptOccurrences`, O(len))."""
        if request_id in self._live:
            raise ValueError(f"request {request_id!r} is already in the suffix index")
        self._live[request_id] = _Live(self._scope_key(request_id, tenant), [int(t) for t in prompt],
                                       PromptOccurrences(prompt, self.config.depth))

    def extend(self, request_id: Hashable, tokens: Sequence[int]) -> None:
        """Committed output tokens of a live request (they enter its scope's output trie at once)."""
        live = self._live[request_id]
        live.context.extend(int(t) for t in tokens)
        trie = self._outputs.get(live.scope_key)
        if trie is None:
            trie = self._outputs[live.scope_key] = SuffixTrie(self.config.depth)
        trie.extend(request_id, tokens)

    def finish(self, request_id: Hashable, keep: bool) -> None:
        """A request ended: its prompt goes; its output stays for later requests (keep=True, then the oldest
        beyond the bounds are evicted) or is taken back out (a cancelled or failed request). Unknown ids: no-op."""
        live = self._live.pop(request_id, None)
        if live is None:
            return
        trie = self._outputs.get(live.scope_key)
        if trie is None or request_id not in trie:
            return
        if not keep or self.config.scope == "off":
            self._drop(live.scope_key, request_id)
            return
        finished = self._finished.setdefault(live.scope_key, collections.OrderedDict())
        finished[request_id] = len(trie.sequence(request_id))
        self._evict(live.scope_key)

    def _drop(self, scope_key: Hashable, request_id: Hashable) -> None:
        trie = self._outputs[scope_key]
        trie.remove(request_id)
        if trie.nodes == 1:
            del self._outputs[scope_key]

    def _evict(self, scope_key: Hashable) -> None:
        finished = self._finished[scope_key]
        while finished and (len(finished) > self.config.max_requests
                            or sum(finished.values()) > self.config.max_tokens):
            oldest, _ = finished.popitem(last=False)
            self._drop(scope_key, oldest)
        if not finished:
            del self._finished[scope_key]

    def clear(self) -> None:
        """Forget every request and output (e.g. between benchmark runs that must start alike)."""
        self._outputs.clear()
        self._finished.clear()
        self._live.clear()

    def retained(self, scope_key: Hashable = "global") -> tuple[Hashable, ...]:
        """The finished requests whose outputs a scope keeps, oldest first."""
        return tuple(self._finished.get(scope_key, {}))

    def output_trie(self, scope_key: Hashable = "global") -> SuffixTrie | None:
        return self._outputs.get(scope_key)

    @property
    def nodes(self) -> int:
        """Trie nodes held, over every scope (the outputs' tries; live prompts are `prompt_tokens`)."""
        return sum(t.nodes for t in self._outputs.values())

    @property
    def prompt_tokens(self) -> int:
        """Tokens of the live requests' prompts held (one position each)."""
        return sum(len(v.prompt.tokens) for v in self._live.values())

    def context(self, request_id: Hashable) -> tuple[int, ...]:
        return tuple(self._live[request_id].context)

    def context_len(self, request_id: Hashable) -> int:
        """Tokens of a live request's context (prompt + committed output)."""
        return len(self._live[request_id].context)

    def context_holds(self, request_id: Hashable, at: int, tokens: Sequence[int]) -> bool:
        """Whether a live request's context holds `tokens` from position `at` (no copy of the context)."""
        context = self._live[request_id].context
        return len(context) >= at + len(tokens) and all(context[at + j] == t for j, t in enumerate(tokens))

    def propose(self, request_id: Hashable, max_tokens: int, assumed: Sequence[int] = ()) -> SuffixProposal:
        """The better of the prompt's and the output trie's chains: more expected accepted tokens, then (on a
        tie) the longer match, the continuation of more of the context. `assumed`: tokens taken as committed
        after the context (the overlapped loop proposes for a step in flight as if its guess holds)."""
        live = self._live[request_id]
        if max_tokens <= 0:
            return SuffixProposal()
        # both tries match at most depth - 1 tokens of the context's end
        context = live.context[-self.config.depth:] + [int(t) for t in assumed] if assumed else live.context
        best = live.prompt.propose(context, max_tokens, self.config.min_prob)
        trie = self._outputs.get(live.scope_key)
        if trie is not None:
            other = trie.propose(context, max_tokens, self.config.min_prob)
            if _rank(other) > _rank(best):
                best = other
        return best

    def propose_tree(self, request_id: Hashable, max_nodes: int, max_depth: int) -> SuffixTree:
        """The tree of whichever chain `propose` prefers (the output trie's, else the prompt's)."""
        live = self._live[request_id]
        chain_prompt = live.prompt.propose(live.context, max_depth, self.config.min_prob)
        trie = self._outputs.get(live.scope_key)
        if trie is not None:
            chain_out = trie.propose(live.context, max_depth, self.config.min_prob)
            if _rank(chain_out) > _rank(chain_prompt):
                return trie.propose_tree(live.context, max_nodes, max_depth, self.config.min_prob)
        return live.prompt.propose_tree(live.context, max_nodes, max_depth, self.config.min_prob)
