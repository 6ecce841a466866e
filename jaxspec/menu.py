"""The static shape menu and all of its arithmetic (docs/design.md, "Static shapes").

Static (one compiled executable each): batch bucket B, speculation length k, attention window W,
prefill chunk C. Everything that asks "which shape does this need?" or "how much room is left?"
asks a `Menu`: the engine, the cost model, the profiler, the policies and the scheduler.

A step is asked for at a padded k (a menu value) with per-row caps. Row i verifies
c_i = min(k, cap_i) proposals and writes its pending token plus them at positions
len_i .. len_i + c_i; what a row writes past its cap is padding, never attended. So

    k_run  = the smallest menu value ≥ max_i c_i         (k itself when some row takes k)
    needed = max_i (len_i + c_i) + 1                      cache positions the step attends over
    window = the smallest window bucket ≥ needed

A tree envelope (`TreeEnvelope`: k proposal nodes, at most Z deep) takes the place of the chain at
that k in the menu: the step verifies k + 1 tokens per row (the pending token and the k nodes) at
the same window and caps arithmetic as a chain of k (a row capped at c verifies only nodes
1..c, which are at most c deep), so every rule above holds for trees unchanged.

A batch whose rows are all capped at 0 runs the k = 0 executable (and no draft catch-up); a long
row capped at a small k does not push the window, so it does not take large k from the other rows.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence


class MenuMissError(LookupError):
    """A shape was requested that the menu (or the warm-up) does not hold."""


class CapacityError(ValueError):
    """A request does not fit the cache (prompt + generation beyond max_len)."""


# --- shape keys: one executable each ----------------------------------------------------


@dataclasses.dataclass(frozen=True, order=True)
class StepKey:
    """A speculative step: batch bucket B, speculation length k (0 = plain decoding), window W."""

    batch: int
    k: int
    window: int


@dataclasses.dataclass(frozen=True, order=True)
class PrefillKey:
    """A prompt chunk of C tokens (padded) into one slot, attending over window W."""

    chunk: int
    window: int


@dataclasses.dataclass(frozen=True, order=True)
class CatchUpKey:
    """Feeding C committed tokens of one slot to the draft (lazy catch-up), window W; C is a `catch_up_buckets`
    size."""

    chunk: int
    window: int


ShapeKey = StepKey | PrefillKey | CatchUpKey


@dataclasses.dataclass(frozen=True, order=True)
class TreeEnvelope:
    """A static token-tree shape: `nodes` proposals (k, the verify width less the pending token), at
    most `depth` (Z) deep; depth = nodes is the chain. Parsed from `--tree N[:D]` (nodes N, depth D,
    which defaults to ceil(N / 2))."""

    nodes: int
    depth: int

    def __post_init__(self):
        if not 1 <= self.depth <= self.nodes:
            raise ValueError(f"a tree envelope needs 1 <= depth <= nodes, got nodes={self.nodes} depth={self.depth}")

    @classmethod
    def parse(cls, text: str) -> TreeEnvelope:
        """'8' -> TreeEnvelope(8, 4); '8:3' -> TreeEnvelope(8, 3). ValueError otherwise."""
        nodes, sep, depth = str(text).strip().partition(":")
        if not nodes.isdigit() or (sep and not depth.isdigit()) or int(nodes) < 1:
            raise ValueError(f"bad tree envelope {text!r}: expected N or N:D with integers 1 <= D <= N, e.g. 8 or 8:4")
        n = int(nodes)
        return cls(n, int(depth) if sep else max(1, -(-n // 2)))

    def __str__(self) -> str:
        return f"{self.nodes}:{self.depth}"


@dataclasses.dataclass(frozen=True)
class CatchUpCall:
    """One planned catch-up call: feed committed tokens [start, start + n) as one `key` chunk."""

    start: int
    n: int
    key: CatchUpKey


@dataclasses.dataclass(frozen=True)
class StepShape:
    """What a step at padded k with per-row caps runs at (see the module doc).

    k: the padded k that runs. window: its attention window (None if no bucket is large enough).
    needed: max_i (len_i + caps_i) + 1. caps: per-row verified proposals min(k, cap_i)."""

    k: int
    window: int | None
    needed: int
    caps: tuple[int, ...]

    @property
    def real_tokens(self) -> int:
        """Σ_i (caps_i + 1): verified token slots the live rows use."""
        return sum(c + 1 for c in self.caps)


def step_shape(context_lens: Sequence[int], row_caps: Sequence[int] | None, k: int, k_menu: Sequence[int],
               window_buckets: Sequence[int] | None) -> StepShape:
    """The shape of a step at padded k with per-row caps (None: every row at k); the one rule the
    engine runs and the policies price (see the module doc).

    window_buckets None means an unbucketed window (W = needed), as a cost model over a continuous
    window uses. Raises ValueError for an empty batch, a k outside the menu, a negative cap or caps
    of another length than the batch."""
    lens, menu, limits = _shape_inputs(context_lens, row_caps, k_menu, k)
    return _shape(lens, limits, k, menu, window_buckets)


def menu_step_shapes(context_lens: Sequence[int], row_caps: Sequence[int], k_menu: Sequence[int],
                     window_buckets: Sequence[int] | None) -> list[StepShape]:
    """`step_shape` at every k of the menu (increasing), the inputs checked once: what a policy prices each
    step, on the host between two steps."""
    if row_caps is None:
        raise ValueError("menu_step_shapes needs each row's cap")
    lens, menu, limits = _shape_inputs(context_lens, row_caps, k_menu, None)
    return [_shape(lens, limits, k, menu, window_buckets) for k in menu]


def _shape_inputs(context_lens, row_caps, k_menu, k: int | None) -> tuple[list[int], list[int], list[int]]:
    """(lens, sorted menu, row limits) checked (`step_shape`'s errors, k in the menu unless None); None caps:
    every row at k."""
    lens = [int(n) for n in context_lens]
    if not lens:
        raise ValueError("a step needs at least one row")
    menu = sorted(int(m) for m in k_menu)
    if k is not None and k not in menu:
        raise ValueError(f"k={k} is not in the menu {tuple(menu)}")
    limits = [k] * len(lens) if row_caps is None else [int(c) for c in row_caps]
    if len(limits) != len(lens):
        raise ValueError(f"{len(limits)} row caps for {len(lens)} rows")
    if any(c < 0 for c in limits):
        raise ValueError(f"row caps must be >= 0, got {tuple(limits)}")
    return lens, menu, limits


def _shape(lens: list[int], limits: list[int], k: int, menu: list[int],
           window_buckets: Sequence[int] | None) -> StepShape:
    """The rule itself, on checked inputs (k in the sorted menu)."""
    caps = tuple(min(k, c) for c in limits)
    k_run = next(m for m in menu if m >= max(caps))  # exists: k itself is ≥ every cap
    needed = max(n + c for n, c in zip(lens, caps, strict=True)) + 1
    if window_buckets is None:
        window = needed
    else:
        window = next((w for w in sorted(window_buckets) if w >= needed), None)
    return StepShape(k=k_run, window=window, needed=needed, caps=caps)


def smallest_at_least(buckets: Iterable[int], needed: int, what: str) -> int:
    """The first bucket ≥ needed; MenuMissError if none."""
    for b in buckets:
        if b >= needed:
            return b
    raise MenuMissError(f"no {what} bucket >= {needed} in the menu {tuple(buckets)}")


# the smallest draft catch-up chunk: on this CPU a catch-up call of the shipped draft takes 1.25 ms as an 8-token
# chunk and 4.2 ms as a 64-token one, whatever it feeds (docs/benchmarks.md, "Right-sized draft catch-up")
SMALLEST_CATCH_UP = 8


def _powers_of_two(first: int, below: int) -> list[int]:
    """first, 2·first, 4·first, ... while < below."""
    out = []
    while first < below:
        out.append(first)
        first *= 2
    return out


# --- the menu ---------------------------------------------------------------------------


# positions per KV page; the kernel alone reads 32-position pages 3-5 % faster at B = 8 (docs/benchmarks.md,
# "Paged KV cache"): a default of 32 would also make it the multiple every window bucket must be
DEFAULT_PAGE_SIZE = 16


def whole_pages(positions: int, page_size: int = DEFAULT_PAGE_SIZE) -> int:
    """`positions` rounded up to whole KV pages (every window bucket, `max_len` included, is a multiple of one)."""
    return -(-positions // page_size) * page_size


@dataclasses.dataclass(frozen=True)
class Menu:
    """The static shape menu and cache size (a named entry of jaxspec/configs/engine.yaml).

    num_slots:       rows a step can hold, and requests admitted at once at most (S).
    max_len:         positions one request may use (M); the largest window.
    page_size:       positions per page of the target's paged KV cache (X); every window is a multiple of it.
    num_pages:       pages in the target's pool (I, the cache's memory; page 0 is scratch); None: as many as
                     S + 1 slots of max_len positions take (`pool_pages`).
    batch_buckets:   padded batch sizes B a step can run at.
    k_menu:          speculation lengths a step can run at (0 = plain decoding).
    window_buckets:  attention windows W (the last is max_len).
    prefill_buckets: prompt chunk sizes C.
    tree_envelopes:  token-tree shapes; each replaces the chain at k = nodes (which k_menu must hold).
    """

    num_slots: int = 8
    max_len: int = 1024
    batch_buckets: tuple[int, ...] = (1, 4, 8)
    k_menu: tuple[int, ...] = (0, 1, 2, 3, 4, 5, 6, 8)
    window_buckets: tuple[int, ...] = (256, 1024)
    prefill_buckets: tuple[int, ...] = (32, 128)
    tree_envelopes: tuple[TreeEnvelope, ...] = ()
    page_size: int = DEFAULT_PAGE_SIZE
    num_pages: int | None = None

    def __post_init__(self):
        for name in ("batch_buckets", "k_menu", "window_buckets", "prefill_buckets"):
            values = tuple(int(v) for v in getattr(self, name))
            if not values or list(values) != sorted(set(values)):
                raise ValueError(f"{name} must be a non-empty increasing tuple, got {values}")
            object.__setattr__(self, name, values)
        if self.batch_buckets[0] < 1:
            raise ValueError(f"batch buckets must be >= 1, got {self.batch_buckets}")
        if self.batch_buckets[-1] > self.num_slots:
            raise ValueError(f"largest batch bucket {self.batch_buckets[-1]} > num_slots {self.num_slots}")
        if self.window_buckets[-1] != self.max_len:
            raise ValueError(f"the largest window bucket must equal max_len={self.max_len}, "
                             f"got {self.window_buckets}")
        if self.page_size < 1 or any(w % self.page_size for w in self.window_buckets):
            raise ValueError(f"every window bucket must be a multiple of the page size {self.page_size}, got "
                             f"{self.window_buckets}")
        if self.num_pages is not None and self.num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is scratch), got {self.num_pages}")
        if self.k_menu[0] < 0:
            raise ValueError("k_menu values must be >= 0")
        if self.prefill_buckets[0] < 1 or self.prefill_buckets[-1] > self.max_len:
            raise ValueError(f"prefill buckets must be in [1, max_len], got {self.prefill_buckets}")
        trees = tuple(t if isinstance(t, TreeEnvelope) else TreeEnvelope.parse(t) for t in self.tree_envelopes)
        object.__setattr__(self, "tree_envelopes", trees)
        nodes = [t.nodes for t in trees]
        if len(set(nodes)) != len(nodes):
            raise ValueError(f"two tree envelopes with the same node count: {', '.join(map(str, trees))}")
        missing = [t for t in trees if t.nodes not in self.k_menu]
        if missing:
            raise ValueError(f"tree envelope {missing[0]} needs k={missing[0].nodes} in k_menu {self.k_menu}")

    def replace(self, **changes) -> Menu:
        return dataclasses.replace(self, **changes)

    def with_k_menu(self, k_menu: Sequence[int]) -> Menu:
        """This menu with only the k values `k_menu` (and the tree envelopes that still have their k)."""
        k_menu = tuple(k_menu)
        return self.replace(k_menu=k_menu, tree_envelopes=tuple(t for t in self.tree_envelopes if t.nodes in k_menu))

    def with_tree(self, tree: TreeEnvelope) -> Menu:
        """This menu with `tree` at k = tree.nodes (added to k_menu if absent; replaces the chain there)."""
        others = tuple(t for t in self.tree_envelopes if t.nodes != tree.nodes)
        return self.replace(k_menu=tuple(sorted(set(self.k_menu) | {tree.nodes})),
                            tree_envelopes=tuple(sorted(others + (tree,))))

    def tree_at(self, k: int) -> TreeEnvelope | None:
        """The tree envelope that runs at k, or None for a chain."""
        return next((t for t in self.tree_envelopes if t.nodes == k), None)

    @property
    def pool_pages(self) -> int:
        """Pages in the target's pool (page 0, scratch, included)."""
        if self.num_pages is not None:
            return self.num_pages
        return (self.num_slots + 1) * self.max_len // self.page_size

    def pages_for(self, positions: int) -> int:
        """Pages that hold `positions` positions."""
        return -(-positions // self.page_size)

    @property
    def max_k(self) -> int:
        return self.k_menu[-1]

    @property
    def largest_batch(self) -> int:
        return self.batch_buckets[-1]

    @property
    def largest_chunk(self) -> int:
        return self.prefill_buckets[-1]

    # --- buckets ----------------------------------------------------------------------

    def batch_bucket(self, rows: int) -> int:
        return smallest_at_least(self.batch_buckets, rows, "batch")

    def prefill_bucket(self, tokens: int) -> int:
        return smallest_at_least(self.prefill_buckets, tokens, "prefill")

    def window(self, needed: int) -> int:
        """The smallest window bucket ≥ needed cache positions."""
        return smallest_at_least(self.window_buckets, needed, "window")

    def prefill_key(self, start: int, tokens: int) -> PrefillKey:
        """The shape that writes `tokens` prompt tokens at positions start.. ."""
        chunk = self.prefill_bucket(tokens)
        return PrefillKey(chunk, self.window(min(start + chunk, self.max_len)))

    # --- capacity ---------------------------------------------------------------------

    def room(self, length: int) -> int:
        """The largest k a row of `length` committed tokens can verify: it writes its pending token
        and k proposals at positions length .. length + k, all < max_len."""
        return max(0, self.max_len - 1 - length)

    def fits_prompt(self, prompt_len: int) -> bool:
        """A prompt fits when it leaves room for at least one generated token."""
        return 0 < prompt_len and prompt_len + 1 <= self.max_len

    # --- steps ------------------------------------------------------------------------

    def step_shape(self, context_lens: Sequence[int], row_caps: Sequence[int] | None, k: int) -> StepShape:
        """`step_shape` over this menu. Raises MenuMissError for a k outside the menu and
        CapacityError when a row does not fit the cache."""
        if k not in self.k_menu:
            raise MenuMissError(f"k={k} is not in the compiled menu k={self.k_menu}")
        shape = step_shape(context_lens, row_caps, k, self.k_menu, self.window_buckets)
        if shape.window is None:
            raise CapacityError(f"a slot needs {shape.needed} cache positions > max_len {self.max_len}")
        return shape

    # --- draft catch-up -----------------------------------------------------------------

    @property
    def catch_up_buckets(self) -> tuple[int, ...]:
        """Chunk sizes C of the draft catch-up: the prefill buckets and, below the smallest, powers of two from
        `SMALLEST_CATCH_UP` (a catch-up after a few k = 0 steps feeds a few tokens, and a chunk's time grows with
        its padded size: docs/design.md, "The goodput policy", catch-up charge)."""
        return tuple(_powers_of_two(SMALLEST_CATCH_UP, self.prefill_buckets[0])) + self.prefill_buckets

    def catch_up_plan(self, seen: int, length: int, in_step: int) -> list[CatchUpCall]:
        """Catch-up calls feeding committed tokens [seen, length) until at most `in_step` tokens (what the
        proposer feeds itself inside a step) are left: while tokens are missing, the smallest catch-up chunk
        that holds them (the largest while more are missing than it holds)."""
        plan = []
        while length + 1 - seen > in_step:
            missing = length - seen
            if missing <= 0:
                break
            chunk = smallest_at_least(self.catch_up_buckets, min(missing, self.catch_up_buckets[-1]), "catch-up")
            n = min(missing, chunk)
            plan.append(CatchUpCall(seen, n, CatchUpKey(chunk, self.window(min(seen + chunk, self.max_len)))))
            seen += n
        return plan

    # --- every shape ----------------------------------------------------------------------

    def step_keys(self, batch_buckets: Iterable[int] | None = None,
                  k_menu: Iterable[int] | None = None) -> list[StepKey]:
        return [StepKey(b, k, w) for b in (batch_buckets or self.batch_buckets)
                for k in (k_menu or self.k_menu) for w in self.window_buckets]

    def prefill_keys(self) -> list[PrefillKey]:
        return [PrefillKey(c, w) for c in self.prefill_buckets for w in self.window_buckets if w >= c]

    def catch_up_keys(self) -> list[CatchUpKey]:
        return [CatchUpKey(c, w) for c in self.catch_up_buckets for w in self.window_buckets if w >= c]
