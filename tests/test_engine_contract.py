"""The engine contract (`jaxspec.engine.api.EngineAPI`), checked on both engines that claim it:
the compiled JAX engine over the tiny model (draft proposer) and the fake engine. What the
scheduler, the profiler and the servers rely on must hold for both, or tests on the fake engine
would prove nothing about the real one."""

from __future__ import annotations

import numpy as np
import pytest

from jaxspec.engine.api import EngineAPI, prefill_prompt
from jaxspec.engine.engine import Engine
from jaxspec.engine.fake import FakeEngine
from jaxspec.menu import CapacityError, CatchUpKey, Menu, MenuMissError, StepKey
from jaxspec.speculation.proposers.draft_model import DraftModelProposer
from jaxspec.types import SamplingParams

MENU = Menu(num_slots=4, max_len=64, batch_buckets=(1, 4), k_menu=(0, 2, 3), window_buckets=(32, 64),
            prefill_buckets=(8, 16))
GREEDY = SamplingParams()
HELD_MATMULS = 1000  # [256, 256] matmuls a slowed prefill chunk runs (test_a_prefill_chunk_has_run_when_it_returns)


@pytest.fixture(scope="module", params=["jax", "fake"])
def engine(request, tiny_model):
    if request.param == "jax":
        built = Engine(tiny_model, DraftModelProposer(tiny_model), MENU)
    else:
        built = FakeEngine(MENU, vocab_size=tiny_model.config.vocab_size, accept=1, tracks_context=True,
                           proposer_name="draft:tiny")
    built.warmup(progress=False)
    return built


@pytest.fixture
def fresh(engine):
    engine.reset()
    yield engine
    engine.reset()


def test_both_engines_satisfy_the_protocol(engine):
    assert isinstance(engine, EngineAPI)
    assert engine.menu == MENU and engine.vocab_size > 0 and engine.proposer_name.startswith("draft")


def test_lengths_room_and_counts_add_up(fresh):
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]  # 11 tokens: two prefill chunks
    first = prefill_prompt(fresh, 0, prompt, GREEDY, seed=0)
    assert 0 <= first < fresh.vocab_size
    assert fresh.length(0) == len(prompt) and fresh.room(0) == MENU.max_len - 1 - len(prompt)
    result = fresh.step([0], 3)
    assert result.tokens.shape == (1, 4) and 1 <= result.counts[0] <= 4 and result.proposed[0] == 3
    assert fresh.length(0) == len(prompt) + int(result.counts[0])


def test_rows_all_capped_at_0_run_the_plain_step(fresh):
    for slot in (0, 1):
        prefill_prompt(fresh, slot, [3 + slot] * 5, GREEDY, seed=0)
    result = fresh.step([0, 1], 3, row_k=[0, 0])
    assert result.tokens.shape == (2, 1) and list(result.counts) == [1, 1] and list(result.proposed) == [0, 0]


def test_shapes_outside_the_menu_and_the_cache_raise(fresh):
    prefill_prompt(fresh, 0, [4] * 61, GREEDY, seed=0)
    with pytest.raises(MenuMissError):
        fresh.step([0], 1)  # k = 1 is not in the menu
    with pytest.raises(CapacityError):
        fresh.step([0], 3)  # 61 + 3 + 1 > 64
    assert fresh.room(0) == 2
    fresh.step([0], 3, row_k=[fresh.room(0)])  # fits exactly
    with pytest.raises(CapacityError):
        prefill_prompt(fresh, 1, [4] * 64, GREEDY, seed=0)
    assert not fresh.state_lost()


def test_the_draft_sees_the_prompt_in_the_first_speculating_step(fresh):
    prefill_prompt(fresh, 0, [5] * 9, GREEDY, seed=0)
    plan = fresh.catch_up_plan(0)  # prefill left the draft alone
    assert plan and plan[0].start == 0 and sum(call.n for call in plan) >= 9 - 1
    result = fresh.step([0], 3)
    assert result.catch_up_calls == len(plan) and fresh.catch_up_plan(0) == []
    fresh.step([0], 0)
    prefill_prompt(fresh, 0, [6] * 5, GREEDY, seed=0)  # a new request in the slot: the draft starts over
    assert fresh.catch_up_plan(0)[0].start == 0


def test_catch_up_plan_after_plain_steps(fresh):
    prefill_prompt(fresh, 0, [5] * 9, GREEDY, seed=0)
    fresh.step([0], 3)  # the draft has seen the prompt
    assert fresh.catch_up_plan(0) == []
    for _ in range(12):
        fresh.step([0], 0)  # the draft falls behind
    plan = fresh.catch_up_plan(0)
    assert plan and all(isinstance(call.key, CatchUpKey) and call.key in fresh.shape_keys() for call in plan)
    assert plan[0].start >= 9 and sum(call.n for call in plan) >= 12 - 1
    result = fresh.step([0], 3)
    assert result.catch_up_calls == len(plan) and fresh.catch_up_plan(0) == []
    assert result.catch_up_tokens == sum(call.key.chunk for call in plan)


def test_a_catch_up_runs_the_smallest_chunk_that_holds_what_is_missing():
    """Below the smallest prefill bucket the catch-up has chunks of 8, 16, 32, ...: a few tokens missed in a
    short stretch at k = 0 run 8, not a prompt-sized chunk; a gap at least the largest chunk runs the largest
    first. The calls are the ones the prefill buckets alone would make, each chunk no larger."""
    menu = Menu(num_slots=4, max_len=512, batch_buckets=(1,), k_menu=(0, 1), window_buckets=(256, 512),
                prefill_buckets=(64, 256))
    assert menu.catch_up_buckets == (8, 16, 32, 64, 256)
    assert {key.chunk for key in menu.catch_up_keys()} == set(menu.catch_up_buckets)

    def chunks(seen, length):
        return [(call.start, call.n, call.key.chunk) for call in menu.catch_up_plan(seen, length, in_step=2)]

    assert chunks(100, 101) == []  # the step feeds the last committed token and the pending one itself
    assert chunks(100, 102) == [(100, 2, 8)]
    assert chunks(100, 109) == [(100, 9, 16)]
    assert chunks(0, 40) == [(0, 40, 64)]
    assert chunks(0, 150) == [(0, 150, 256)]
    assert chunks(0, 300) == [(0, 256, 256), (256, 44, 64)]
    assert menu.catch_up_plan(250, 262, in_step=2)[0].key.window == 512  # the window holds the chunk's end
    for seen, length in [(0, 5), (3, 70), (0, 255), (0, 511), (200, 330)]:
        plan = menu.catch_up_plan(seen, length, in_step=2)
        assert sum(call.n for call in plan) == length - seen and plan[0].start == seen
        assert all(call.n <= call.key.chunk for call in plan)
        assert len(plan) == -(-(length - seen) // 256)  # as many calls as with the prefill buckets alone


def test_free_and_reset_empty_slots(fresh):
    prefill_prompt(fresh, 0, [5] * 9, GREEDY, seed=0)
    prefill_prompt(fresh, 1, [6] * 9, GREEDY, seed=0)
    fresh.free(0)
    assert fresh.length(0) == 0 and fresh.length(1) == 9
    fresh.reset()
    assert all(fresh.length(s) == 0 for s in range(MENU.num_slots)) and not fresh.state_lost()


def test_shape_keys_are_the_whole_menu(engine):
    keys = engine.shape_keys()
    assert {k for k in keys if isinstance(k, StepKey)} == {StepKey(b, k, w) for b in MENU.batch_buckets
                                                          for k in MENU.k_menu for w in MENU.window_buckets}
    assert len(keys) == len(set(keys))


def test_a_shape_that_was_not_warmed_up_raises(tiny_model):
    for built in (Engine(tiny_model, None, MENU), FakeEngine(MENU)):
        built.warmup([StepKey(1, 0, 32), *MENU.prefill_keys()], progress=False)
        prefill_prompt(built, 0, [5] * 4, GREEDY, seed=0)
        built.step([0], 0)
        with pytest.raises(MenuMissError):
            built.step([0, 1], 0)  # batch bucket 4 was not compiled


def test_fake_engine_output_is_hand_checkable():
    fake = FakeEngine(MENU, vocab_size=16, accept=2)
    fake.warmup()
    prompt = [3, 9, 14]
    out = [prefill_prompt(fake, 0, prompt, GREEDY, seed=0)]
    for k in (3, 0, 2, 3):
        out += fake.step([0], k).row_tokens(0)
    assert out == fake.expected_output(prompt, len(out)) == [(14 + 1 + i) % 16 for i in range(len(out))]
    assert fake.history(0) == prompt + out[:-1]  # the newest token is pending, not yet committed
    np.testing.assert_array_equal(fake.step([0], 3).counts, [3])  # accept 2 of 3, plus the bonus


def test_a_prefill_chunk_has_run_when_it_returns(fresh, monkeypatch):
    """The step timings the cost model learns from must not include a prompt chunk left in flight: every output
    is ready when the call returns. The JAX engine's chunk is made slow (its outputs pass through HELD_MATMULS
    chained matmuls, about a second of XLA:CPU work dispatched asynchronously), so a chunk left in flight is
    still running when the test looks, however fast the tiny model's own chunk is. (A host callback cannot hold
    it instead: XLA:CPU runs an executable with one synchronously.)"""
    chunk = np.arange(5, 5 + MENU.largest_chunk, dtype=np.int32)  # [C] a whole non-last chunk
    if not isinstance(fresh, Engine):  # the fake engine computes on the host, in the call
        assert fresh.prefill_chunk(0, chunk, 0, False, GREEDY, 0) is None
        return
    import jax
    import jax.numpy as jnp

    @jax.jit
    def slowed(outputs):
        """`outputs`, each a fresh array (no input is forwarded as is) computed after the matmul chain."""
        def body(_, m):  # [256, 256] f32, renormalised every round
            m = m @ m
            return m / jnp.max(jnp.abs(m))

        m = jax.lax.fori_loop(0, HELD_MATMULS, body, jnp.full((256, 256), 1 / 256, jnp.float32))  # [256, 256]
        zero = (m[0, 0] * 0).astype(jnp.int32)  # [] 0, known only once the chain has run
        return jax.tree.map(lambda x: x | (zero != 0) if x.dtype == jnp.bool_ else x + zero.astype(x.dtype), outputs)

    compiled = fresh.executables.get
    monkeypatch.setattr(fresh.executables, "get", lambda key: lambda *args: slowed(compiled(key)(*args)))
    assert fresh.prefill_chunk(0, chunk, 0, False, GREEDY, 0) is None
    pending = [x for x in jax.tree.leaves(fresh.state) if not x.is_ready()]
    if pending:
        pytest.fail(f"{len(pending)} state arrays still in flight when prefill_chunk returned")
