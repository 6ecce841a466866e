"""Engine behaviour beyond greedy equality: seeded sampling, batch independence, no compiles."""

from __future__ import annotations

import numpy as np
import pytest

from jaxspec.engine import compile_counter
from jaxspec.engine.engine import Engine
from jaxspec.menu import Menu, StepKey
from jaxspec.models.config import TINY
from jaxspec.speculation.proposers.draft_model import DraftModelProposer
from jaxspec.types import SamplingParams
from tests.conftest import decode, random_prompts

CONFIG = Menu(num_slots=8, max_len=128, batch_buckets=(1, 4, 8), k_menu=(0, 2, 3),
                      window_buckets=(64, 128), prefill_buckets=(32,))


@pytest.fixture(scope="module")
def engine(tiny_model):
    e = Engine(tiny_model, DraftModelProposer(tiny_model), CONFIG)
    e.warmup(progress=False)
    return e


def _sample(engine, slots, prompts, params, k, n):
    return decode(engine, prompts, k, n, params=params, slots=slots)[0]


def test_seeded_sampling_is_reproducible_and_batch_independent(engine):
    prompts = random_prompts((6, 15, 9, 20), TINY.vocab_size, seed=3)
    params = [SamplingParams(temperature=1.0, top_p=0.9, seed=s) for s in (11, 12, 13, 14)]
    alone = _sample(engine, [0], prompts[:1], params[:1], 3, 12)[0]
    again = _sample(engine, [5], prompts[:1], params[:1], 3, 12)[0]
    assert alone == again  # same seed, different slot
    batched = _sample(engine, [2, 3, 4, 6], prompts, params, 3, 12)
    assert batched[0] == alone  # unaffected by who else is in the batch
    other_seed = _sample(engine, [0], prompts[:1], [SamplingParams(temperature=1.0, top_p=0.9, seed=99)], 3, 12)[0]
    assert other_seed != alone


def test_mixed_greedy_and_sampled_rows(engine, tiny_model):
    from tests.conftest import reference_greedy
    prompts = random_prompts((8, 12), TINY.vocab_size, seed=4)
    params = [SamplingParams(), SamplingParams(temperature=1.0, seed=5)]
    outs = _sample(engine, [0, 1], prompts, params, 2, 10)
    assert outs[0] == reference_greedy(tiny_model, prompts[0], 10)


def test_no_compiles_over_200_steps_with_changing_batches_and_k(engine):
    compile_counter.install()
    before = compile_counter.count()
    rng = np.random.default_rng(0)
    prompts = random_prompts([int(n) for n in rng.integers(2, 30, 8)], TINY.vocab_size, seed=5)
    live: dict[int, int] = {}
    steps = 0
    while steps < 200:
        free = [s for s in range(CONFIG.num_slots) if s not in live]
        if free and (not live or rng.random() < 0.3):  # admit a request with new sampling values
            slot = free[0]
            params = SamplingParams(temperature=float(rng.choice([0.0, 0.7, 1.2])), top_k=int(rng.integers(0, 5)),
                                    top_p=float(rng.choice([1.0, 0.8])), seed=int(rng.integers(1000)))
            engine.prefill(slot, prompts[slot], params, seed=params.seed)
            live[slot] = 0
        slots = sorted(live)
        k = int(rng.choice(CONFIG.k_menu))
        result = engine.step(slots, k, row_k=[int(rng.integers(0, k + 1)) for _ in slots])
        steps += 1
        for i, slot in enumerate(slots):
            live[slot] += int(result.counts[i])
            if engine.lengths[slot] > 100 or rng.random() < 0.05:  # retire
                engine.free(slot)
                del live[slot]
    assert compile_counter.count() == before


class _Spy:
    """Records the executable keys an engine looks up (steps and catch-up calls)."""

    def __init__(self, engine, monkeypatch):
        self.keys, lookup = [], engine.executables.get
        monkeypatch.setattr(engine.executables, "get", lambda key: self.keys.append(key) or lookup(key))

    def take(self):
        keys, self.keys = self.keys, []
        return keys


def _prefilled(engine, prompts, slots):
    for slot in range(CONFIG.num_slots):
        engine.free(slot)
    return [[engine.prefill(s, p, SamplingParams())] for s, p in zip(slots, prompts)]


def test_rows_all_capped_at_0_run_plain_decoding_without_catch_up(engine, tiny_model, monkeypatch):
    from tests.conftest import reference_greedy
    prompts = random_prompts((9, 14), TINY.vocab_size, seed=6)
    slots = [0, 1]
    outs = _prefilled(engine, prompts, slots)
    spy = _Spy(engine, monkeypatch)
    for _ in range(3):  # k = 0 steps: the draft falls behind
        result = engine.step(slots, 0)
        for row, out in enumerate(outs):
            out += result.row_tokens(row)
    assert all(engine.catch_up_plan(s) for s in slots)  # a speculating step would catch up first
    spy.take()
    seen = engine.proposer_lengths[slots].copy()
    result = engine.step(slots, 3, row_k=[0, 0])
    assert spy.take() == [StepKey(4, 0, 64)]  # the k = 0 executable, no catch-up call
    assert result.catch_up_calls == 0 and result.tokens.shape == (2, 1)
    np.testing.assert_array_equal(engine.proposer_lengths[slots], seen)  # the draft was left alone
    for row, out in enumerate(outs):
        out += result.row_tokens(row)
    # the largest cap decides: caps (1, 0) at k = 3 run the smallest menu k >= 1, k = 2
    result = engine.step(slots, 3, row_k=[1, 0])
    assert [key for key in spy.take() if isinstance(key, StepKey)] == [StepKey(4, 2, 64)]
    assert result.tokens.shape == (2, 3) and list(result.proposed) == [1, 0]
    for row, out in enumerate(outs):
        out += result.row_tokens(row)
    for out, prompt in zip(outs, prompts):
        assert out == reference_greedy(tiny_model, prompt, len(out))


def test_engine_and_goodput_agree_on_the_shape_of_every_step(engine, monkeypatch):
    """The policy prices and files each step under the shape the engine runs (one function picks
    it): a long row capped at 0 does not push a short row's k = 3 step into the larger window."""
    from jaxspec.policy.acceptance import AcceptanceTracker
    from jaxspec.policy.base import BatchView
    from jaxspec.policy.goodput import GoodputConfig, GoodputPolicy
    from tests.policy.sim import linear_cost, synthetic_cost_model

    prompts = random_prompts((61, 8), TINY.vocab_size, seed=7)
    slots = [0, 1]
    _prefilled(engine, prompts, slots)
    cost = synthetic_cost_model(linear_cost(), CONFIG.batch_buckets, CONFIG.k_menu, CONFIG.window_buckets)
    policy = GoodputPolicy(cost, AcceptanceTracker(), GoodputConfig(cold_start="all"))  # cold start at the deepest k
    filed, observe = [], cost.observe
    monkeypatch.setattr(cost, "observe", lambda b, k, w, *a, **kw: filed.append(StepKey(b, k, w)) or observe(
        b, k, w, *a, **kw))
    spy = _Spy(engine, monkeypatch)
    for _ in range(4):
        lens = tuple(int(n) for n in engine.lengths[slots])
        view = BatchView(request_ids=("long", "short"), context_lens=lens, row_max_k=(0, CONFIG.max_k),
                         k_menu=CONFIG.k_menu, batch_bucket=4)
        decision = policy.choose(view)
        result = engine.step(slots, decision.k, None if decision.row_k is None else list(decision.row_k))
        policy.observe(view, decision, result, elapsed_s=1e-3)
    ran = [key for key in spy.take() if isinstance(key, StepKey)]
    assert ran == filed
    assert ran[0] == StepKey(4, 3, 64)  # 61 + 3 + 1 > 64, but the long row verifies nothing


def test_warming_up_more_shapes_leaves_live_requests_alone(tiny_model):
    """Warm-up runs each new executable once on the scratch slot: a request decoding around a later
    warm-up (here of every shape, on a fresh engine) gives the same tokens as one that never saw it."""
    prompts = random_prompts((9, 14), TINY.vocab_size, seed=21)
    params = [SamplingParams(temperature=1.0, seed=3), SamplingParams()]
    reference = _sample_fresh(tiny_model, prompts, params, warm_in_between=False)
    assert _sample_fresh(tiny_model, prompts, params, warm_in_between=True) == reference


def _sample_fresh(tiny_model, prompts, params, warm_in_between: bool):
    e = Engine(tiny_model, DraftModelProposer(tiny_model), CONFIG)
    keys = [k for k in e.shape_keys() if not (isinstance(k, StepKey) and k.batch == 8)]
    e.warmup(keys, progress=False)
    outputs = [[e.prefill(s, p, q)] for s, p, q in zip((0, 1), prompts, params)]
    for i in range(8):
        if warm_in_between and i == 3:
            assert e.warmup(progress=False) > 0  # the B = 8 steps: compiled and run now
        result = e.step([0, 1], 2)
        for row in range(2):
            outputs[row] += result.row_tokens(row)
    return outputs
