"""The host side of the paged KV cache: who holds which page, and the prefix cache (docs/design.md, "Paged KV
cache" and "Prefix caching").

The target's pool has `num_pages` pages of `page_size` positions (jaxspec.models.kv_cache.PagedKVCache); page 0 is
scratch and never handed out. Each slot's block table row names the pages of its positions in order; a step gets
the rows of its slots, cut to its window (`block_table`).

A slot grows page by page: `admit` reserves a prompt's pages, `grow` the pages a step may write (its k + 1
positions, more while steps are in flight). When no page is left, `grow` raises `PagesExhaustedError` and takes
nothing; the scheduler preempts a request and tries again.

Prefix caching: once a prompt's full page is written, it is keyed by a hash chain (the page's tokens and its
parent's key, under a scope naming model, dtype and proposer) and kept when its requests end. `admit` maps the
longest chain of a new prompt's full pages that the cache holds into the slot, shared read-only (a request writes
only at positions at or past its length, past every page it shares; its last prompt token is always computed,
for its logits). Pages no slot holds are evicted least recently used first when the pool needs them.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
from collections.abc import Sequence

import numpy as np

from jaxspec.models.kv_cache import SCRATCH_PAGE


class PagesExhaustedError(RuntimeError):
    """The pool has too few free pages for what was asked (nothing was taken)."""


@dataclasses.dataclass(frozen=True)
class PageStats:
    """total: pages that can be handed out (scratch excluded); in_use: held by a slot (a shared page once);
    cached: prefix pages no slot holds, kept for reuse (evictable); free: neither."""

    total: int
    in_use: int
    cached: int
    free: int


class PagePool:
    """Pages of one engine's pool: each slot's block table row, reference counts, the prefix cache."""

    def __init__(self, num_pages: int, page_size: int, num_slots: int, max_len: int, prefix_cache: bool = True,
                 scope: str = ""):
        if num_pages < 2:
            raise ValueError(f"a pool needs at least 2 pages (page 0 is scratch), got {num_pages}")
        if max_len % page_size:
            raise ValueError(f"max_len {max_len} is not a multiple of the page size {page_size}")
        self.num_pages, self.page_size, self.num_slots = num_pages, page_size, num_slots
        self.prefix_cache = prefix_cache
        self._scope = hashlib.blake2b(scope.encode(), digest_size=16).digest()
        self.table = np.full((num_slots + 1, max_len // page_size), SCRATCH_PAGE, np.int32)  # [S+1, M/X]
        self.held = np.zeros(num_slots + 1, np.int64)  # pages each slot holds (the first held[s] of its row)
        self._refs = np.zeros(num_pages, np.int64)
        self._free: list[int] = []
        self._key_of: dict[int, bytes] = {}  # cached page -> its chain key
        self._page_of: dict[bytes, int] = {}  # chain key -> cached page
        self._tokens_of: dict[int, tuple[int, ...]] = {}  # cached page -> its tokens (checked on every hit)
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()  # LRU first
        self._prompt: list[list[int]] = [[] for _ in range(num_slots + 1)]  # each slot's prompt tokens so far
        self._keyed: list[list[bytes]] = [[] for _ in range(num_slots + 1)]  # chain keys of its full pages
        self._admitted = np.zeros(num_slots + 1, bool)  # admitted and not prefilled from position 0 yet
        self.reset()

    # --- accounting ---------------------------------------------------------------------

    def reset(self) -> None:
        """Every page free, every slot empty, the prefix cache empty (the device pool was re-initialised)."""
        self.table[:] = SCRATCH_PAGE
        self.held[:] = 0
        self._refs[:] = 0
        self._refs[SCRATCH_PAGE] = 1
        self._free = [p for p in range(self.num_pages - 1, -1, -1) if p != SCRATCH_PAGE]  # pop() gives low ids
        self._key_of.clear()
        self._page_of.clear()
        self._tokens_of.clear()
        self._evictable.clear()
        for slot in range(self.num_slots + 1):
            self._prompt[slot], self._keyed[slot] = [], []
        self._admitted[:] = False

    def clear_prefix_cache(self) -> None:
        """Forget every cached prefix (runs that must start alike): cached pages no slot holds are free again,
        held ones stay with their slots as private pages."""
        self._free.extend(sorted(self._evictable, reverse=True))
        self._evictable.clear()
        self._key_of.clear()
        self._page_of.clear()
        self._tokens_of.clear()

    @property
    def available(self) -> int:
        """Pages a request can take now: free ones and cached ones no slot holds."""
        return len(self._free) + len(self._evictable)

    def stats(self) -> PageStats:
        total = self.num_pages - 1
        return PageStats(total=total, in_use=total - self.available, cached=len(self._evictable),
                         free=len(self._free))

    def pages_for(self, positions: int) -> int:
        return -(-positions // self.page_size)

    # --- slots ----------------------------------------------------------------------------

    def admit(self, slot: int, prompt: Sequence[int]) -> int | None:
        """Give `slot` (emptied first) the pages of `prompt` and of its first generated position: the cached
        prefix's shared, the rest new. Returns the prompt tokens served from the cache (a multiple of the page
        size; prefill starts there), or None when the pool cannot hold the prompt now (the slot is then empty)."""
        self.release(slot)
        hits = self._cached_prefix(prompt)
        need = self.pages_for(len(prompt) + 1) - len(hits)
        if need > self.available - sum(page in self._evictable for page in hits):
            return None
        for page in hits:
            self._share(slot, page)
        self._take(slot, need)
        cached = len(hits) * self.page_size
        self._prompt[slot] = [int(t) for t in prompt[:cached]]
        self._keyed[slot] = self._chain_keys(self._prompt[slot])
        self._admitted[slot] = True
        return cached

    def grow(self, slots: Sequence[int], positions: Sequence[int]) -> None:
        """Make each slots[i] hold pages for its first positions[i] positions; raises PagesExhaustedError (taking
        nothing) when the pool has too few."""
        need = [max(0, self.pages_for(int(n)) - int(self.held[s])) for s, n in zip(slots, positions)]
        if sum(need) > self.available:
            raise PagesExhaustedError(f"{sum(need)} more pages needed, {self.available} available "
                                      f"(pool of {self.num_pages - 1})")
        for slot, n in zip(slots, need):
            self._take(slot, n)

    def cached_prefix(self, slot: int) -> list[int]:
        """The prompt tokens `admit` served from the cache, until the slot's first prefill chunk is written
        (then [])."""
        return list(self._prompt[slot]) if self._admitted[slot] else []

    def write_prompt(self, slot: int, tokens: Sequence[int], start: int) -> None:
        """Record that prompt tokens [start, start + len(tokens)) of `slot` are being written (a prefill chunk)
        and give it their pages. A chunk at 0 of a slot not just admitted starts a new prompt (the slot is emptied
        first). Call `publish` once the chunk is dispatched."""
        if start == 0 and not self._admitted[slot]:
            self.release(slot)
        self._admitted[slot] = False
        if start != len(self._prompt[slot]):
            raise ValueError(f"slot {slot}: a prompt chunk at {start}, but {len(self._prompt[slot])} prompt tokens "
                             f"are in the cache")
        self.grow([slot], [start + len(tokens)])
        self._prompt[slot].extend(int(t) for t in tokens)

    def publish(self, slot: int) -> None:
        """Key the slot's full prompt pages written so far into the prefix cache (after their prefill chunk was
        dispatched: the device runs calls in order, so a later call that reads them sees them written)."""
        if not self.prefix_cache:
            return
        prompt, keys = self._prompt[slot], self._keyed[slot]
        parent = keys[-1] if keys else self._scope
        for index in range(len(keys), len(prompt) // self.page_size):
            tokens = tuple(prompt[index * self.page_size:(index + 1) * self.page_size])
            parent = self._key(parent, tokens)
            keys.append(parent)
            page = int(self.table[slot, index])
            if parent not in self._page_of and page not in self._key_of:  # (a twin already cached stays private)
                self._page_of[parent], self._key_of[page], self._tokens_of[page] = page, parent, tokens

    def release(self, slot: int) -> None:
        """Give back the slot's pages: a cached page stays cached (evictable), the others are free."""
        for page in self.table[slot, :self.held[slot]]:
            page = int(page)
            self._refs[page] -= 1
            if self._refs[page] == 0:
                if page in self._key_of:
                    self._evictable[page] = None
                else:
                    self._free.append(page)
        self.table[slot] = SCRATCH_PAGE
        self.held[slot] = 0
        self._prompt[slot], self._keyed[slot] = [], []
        self._admitted[slot] = False

    def block_table(self, slots: Sequence[int], window: int) -> np.ndarray:
        """[n, ceil(W/X)] the pages of positions [0, W) of each slot (the scratch page past what it holds)."""
        return self.table[np.asarray(slots, np.int64), :self.pages_for(window)]

    # --- internals ------------------------------------------------------------------------

    def _key(self, parent: bytes, tokens: tuple[int, ...]) -> bytes:
        return hashlib.blake2b(parent + np.asarray(tokens, np.int64).tobytes(), digest_size=16).digest()

    def _chain_keys(self, tokens: Sequence[int]) -> list[bytes]:
        keys, parent = [], self._scope
        for index in range(len(tokens) // self.page_size):
            parent = self._key(parent, tuple(tokens[index * self.page_size:(index + 1) * self.page_size]))
            keys.append(parent)
        return keys

    def _cached_prefix(self, prompt: Sequence[int]) -> list[int]:
        """The cached pages of the prompt's longest cached chain of full pages, its last token's page excluded."""
        if not self.prefix_cache:
            return []
        hits, parent = [], self._scope
        for index in range((len(prompt) - 1) // self.page_size):
            tokens = tuple(int(t) for t in prompt[index * self.page_size:(index + 1) * self.page_size])
            parent = self._key(parent, tokens)
            page = self._page_of.get(parent)
            if page is None or self._tokens_of[page] != tokens:
                break
            hits.append(page)
        return hits

    def _share(self, slot: int, page: int) -> None:
        if self._refs[page] == 0:
            del self._evictable[page]
        self._refs[page] += 1
        self._append(slot, page)

    def _take(self, slot: int, n: int) -> None:
        for _ in range(n):
            if self._free:
                page = self._free.pop()
            else:  # the least recently used cached page no slot holds
                page, _ = self._evictable.popitem(last=False)
                del self._page_of[self._key_of.pop(page)]
                del self._tokens_of[page]
            self._refs[page] = 1
            self._append(slot, page)

    def _append(self, slot: int, page: int) -> None:
        if self.held[slot] >= self.table.shape[1]:
            raise ValueError(f"slot {slot} already holds {self.held[slot]} pages (max_len)")
        self.table[slot, self.held[slot]] = page
        self.held[slot] += 1


__all__ = ["PagePool", "PageStats", "PagesExhaustedError"]
