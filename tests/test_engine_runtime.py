"""Engine behaviour beyond greedy equality: seeded sampling, batch independence, no compiles."""

from __future__ import annotations

import numpy as np
import pytest

from jaxspec import compile_counter
from jaxspec.engine import Engine, EngineConfig
from jaxspec.proposers.draft_model import DraftModelProposer
from jaxspec.types import SamplingParams
from models.config import TINY
from tests.conftest import decode, random_prompts

CONFIG = EngineConfig(num_slots=8, max_len=128, batch_buckets=(1, 4, 8), k_menu=(0, 2, 3),
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
