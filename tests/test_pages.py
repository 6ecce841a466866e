"""The page pool (jaxspec.engine.pages): admission, growth, release, the prefix cache and its eviction."""

from __future__ import annotations

import numpy as np
import pytest

from jaxspec.engine.pages import PagePool, PagesExhaustedError
from jaxspec.models.kv_cache import SCRATCH_PAGE

P = 4  # positions per page


def _pool(num_pages=9, num_slots=3, max_len=32, prefix_cache=True) -> PagePool:
    return PagePool(num_pages, P, num_slots, max_len, prefix_cache=prefix_cache, scope="test")


def _prefill(pool: PagePool, slot: int, prompt, cached: int) -> None:
    """What the engine does for an admitted prompt: write it from the cached count on, then publish."""
    pool.write_prompt(slot, prompt[cached:], cached)
    pool.publish(slot)


def _check_invariants(pool: PagePool) -> None:
    """Reference counts equal the tables' references; every page is held, cached-and-unheld, or free, once."""
    refs = np.zeros(pool.num_pages, np.int64)
    for slot in range(pool.num_slots + 1):
        row = pool.table[slot, :pool.held[slot]]
        assert SCRATCH_PAGE not in row
        assert (pool.table[slot, pool.held[slot]:] == SCRATCH_PAGE).all()
        np.add.at(refs, row, 1)
    refs[SCRATCH_PAGE] = 1
    np.testing.assert_array_equal(refs, pool._refs)
    free, evictable = set(pool._free), set(pool._evictable)
    assert len(free) == len(pool._free) and not free & evictable
    assert all(refs[p] == 0 for p in free | evictable)
    held = {p for p in range(1, pool.num_pages) if refs[p] > 0}
    assert held | free | evictable == set(range(1, pool.num_pages))
    assert set(pool._key_of) >= evictable and set(pool._page_of.values()) == set(pool._key_of)


def test_admit_takes_the_prompts_pages_and_release_gives_them_back():
    pool = _pool()
    assert pool.admit(0, list(range(10))) == 0  # nothing cached yet
    assert pool.held[0] == 3  # 10 prompt positions + the first generated one: 11 -> 3 pages
    assert SCRATCH_PAGE not in pool.table[0, :3]
    _check_invariants(pool)
    pool.grow([0], [17])  # 17 positions -> 5 pages
    assert pool.held[0] == 5
    pool.release(0)
    assert pool.stats().in_use == 0 and pool.stats().free == 8
    _check_invariants(pool)


def test_grow_takes_nothing_when_the_pool_is_short():
    pool = _pool(num_pages=5)  # 4 usable pages
    pool.grow([0, 1], [8, 4])  # 2 + 1 pages
    with pytest.raises(PagesExhaustedError):
        pool.grow([0, 1], [12, 8])  # 1 + 1 more: only 1 left
    assert list(pool.held[:2]) == [2, 1]  # nothing taken
    pool.grow([0], [12])
    assert pool.available == 0
    _check_invariants(pool)


def test_a_shared_prefix_is_served_from_the_cache():
    pool = _pool()
    system = list(range(100, 108))  # two full pages
    first, second = system + [1, 2, 3], system + [7, 8]
    assert pool.admit(0, first) == 0
    _prefill(pool, 0, first, 0)
    assert pool.admit(1, second) == 8
    np.testing.assert_array_equal(pool.table[1, :2], pool.table[0, :2])  # the same pages
    assert pool.table[1, 2] != pool.table[0, 2]  # the rest is private
    assert pool.cached_prefix(1) == system
    _check_invariants(pool)
    pool.release(0)
    pool.release(1)
    stats = pool.stats()
    assert stats.in_use == 0 and stats.cached == 2  # the prompt's full pages stay cached
    assert pool.admit(2, second) == 8  # still there after both requests ended
    _check_invariants(pool)


def test_clearing_the_prefix_cache_frees_unheld_pages_and_misses_after():
    """Cleared with one slot still holding a cached prefix: its pages stay its own (freed, not cached, on
    release); the unheld cached pages are free; the same prompt then misses."""
    pool = _pool(num_pages=13)
    system = list(range(100, 108))
    for slot in (0, 1):
        assert pool.admit(slot, system + [slot]) == (0 if slot == 0 else 8)
        _prefill(pool, slot, system + [slot], 8 if slot else 0)
    pool.release(0)
    other = list(range(200, 208)) + [5]
    pool.admit(2, other)
    _prefill(pool, 2, other, 0)
    pool.release(2)  # its two full pages: cached, unheld
    assert pool.stats().cached == 2
    pool.clear_prefix_cache()
    assert pool.stats().cached == 0
    _check_invariants(pool)
    assert pool.admit(2, other) == 0 and pool.admit(0, system + [9]) == 0
    pool.release(1)
    pool.release(0)
    pool.release(2)
    assert pool.stats().free == pool.num_pages - 1 - pool.stats().cached
    _check_invariants(pool)


def test_a_different_prefix_or_scope_misses():
    pool = _pool()
    prompt = list(range(100, 112))
    pool.admit(0, prompt)
    _prefill(pool, 0, prompt, 0)
    changed = prompt.copy()
    changed[5] += 1  # the second page differs: only the first is shared
    assert pool.admit(1, changed) == 4
    other = PagePool(9, P, 3, 32, scope="other model")
    assert other.admit(0, prompt) == 0


def test_the_last_prompt_token_is_always_computed():
    """A prompt of whole pages, all cached: its last page is not shared (the prefill writes its last token)."""
    pool = _pool()
    prompt = list(range(50, 58))  # exactly two pages
    pool.admit(0, prompt)
    _prefill(pool, 0, prompt, 0)
    assert pool.admit(1, prompt) == 4
    assert pool.table[1, 1] != pool.table[0, 1]


def test_no_prefix_cache_shares_nothing():
    pool = _pool(prefix_cache=False)
    prompt = list(range(20))
    pool.admit(0, prompt)
    _prefill(pool, 0, prompt, 0)
    pool.release(0)
    assert pool.admit(1, prompt) == 0
    assert pool.stats().cached == 0


def test_cached_pages_are_evicted_least_recently_used_first():
    pool = _pool(num_pages=8)  # 7 usable pages
    old, new = list(range(200, 208)) + [1], list(range(300, 308)) + [1]  # 2 full pages + 1 position each
    for slot, prompt in ((0, old), (1, new)):
        pool.admit(slot, prompt)
        _prefill(pool, slot, prompt, 0)
    pool.release(0)  # old's pages become evictable first
    pool.release(1)
    assert pool.stats().cached == 4 and pool.stats().free == 3
    pool.grow([2], [16])  # 4 pages: the 3 free ones, then old's first (the least recently used)
    assert pool.admit(0, new) == 8  # new's pages survived; its third page evicts old's second
    assert pool.stats().cached == 0
    pool.release(2)
    assert pool.admit(1, old) == 0  # old's chain is gone
    _check_invariants(pool)


def test_admit_refuses_without_side_effects_when_the_pool_is_full():
    pool = _pool(num_pages=4)  # 3 usable pages
    pool.grow([0], [8])
    assert pool.admit(1, list(range(8))) is None
    assert pool.held[1] == 0 and pool.held[0] == 2
    _check_invariants(pool)


def test_a_long_random_run_returns_every_page():
    """Thousands of random admissions, growth, chunked prefills, releases (finished or cancelled at any point):
    the invariants hold after every operation, and every page is back once the slots are empty."""
    rng = np.random.default_rng(0)
    pool = PagePool(40, P, 6, 64, scope="run")
    systems = [list(rng.integers(0, 50, 12)) for _ in range(3)]
    lengths = np.zeros(7, np.int64)
    for _ in range(3000):
        slot = int(rng.integers(0, 6))
        action = rng.random()
        if action < 0.3:
            shared = systems[rng.integers(0, 3)][:int(rng.integers(0, 13))]
            prompt = shared + list(rng.integers(0, 50, rng.integers(1, 20)))
            cached = pool.admit(slot, prompt)
            if cached is not None:
                assert cached % P == 0 and cached < len(prompt)
                for start in range(cached, len(prompt), 5):  # chunks of 5
                    pool.write_prompt(slot, prompt[start:start + 5], start)
                    pool.publish(slot)
                lengths[slot] = len(prompt)
        elif action < 0.8 and pool.held[slot]:
            target = min(64, int(lengths[slot] + rng.integers(1, 10)))
            try:
                pool.grow([slot], [target])
                lengths[slot] = target - 1
            except PagesExhaustedError:
                pool.release(slot)  # preempted
                lengths[slot] = 0
        else:
            pool.release(slot)
            lengths[slot] = 0
        _check_invariants(pool)
    for slot in range(6):
        pool.release(slot)
    stats = pool.stats()
    assert stats.in_use == 0 and stats.cached + stats.free == stats.total == 39
    _check_invariants(pool)
