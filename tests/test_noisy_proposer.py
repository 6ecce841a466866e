"""NoisyProposer keeps the draft cache equal to the committed history, also under sampling."""

from __future__ import annotations

import numpy as np
import pytest

from jaxspec.engine.engine import Engine
from jaxspec.menu import Menu
from jaxspec.models.config import TINY
from jaxspec.speculation.proposers.base import Proposer
from jaxspec.speculation.proposers.draft_model import DraftModelProposer
from jaxspec.speculation.proposers.noisy import NoisyProposer
from jaxspec.types import SamplingParams
from tests.conftest import random_prompts

CONFIG = Menu(num_slots=4, max_len=128, batch_buckets=(4,), k_menu=(0, 4), window_buckets=(128,),
                      prefill_buckets=(32,))


def _draft_kv(engine: Engine, slot: int, n: int) -> list[np.ndarray]:
    """The draft cache's K and V of positions [0, n) of a slot, every layer: [n, G, H] each."""
    cache = engine.state.proposer
    return [np.asarray(x[slot, :n]) for x in (*cache.k, *cache.v)]


def test_draft_cache_equals_a_fresh_prefill_of_the_history_under_sampling(tiny_model):
    """Every proposal is replaced (α = 0), so every accepted proposal is a replacement: the draft
    must hold the replacement's K/V at its position, as a draft prefilled with the history does."""
    engine = Engine(tiny_model, NoisyProposer(DraftModelProposer(tiny_model), 0.0, TINY.vocab_size), CONFIG)
    engine.warmup(progress=False)
    slots = list(range(4))
    prompts = random_prompts((7, 12, 5, 9), TINY.vocab_size, seed=8)
    for slot, prompt in zip(slots, prompts):
        engine.prefill(slot, prompt, SamplingParams(temperature=1.5, seed=slot), seed=slot)
    accepted = 0
    for _ in range(40):
        if engine.lengths[slots].max() + 5 > CONFIG.max_len:
            break
        accepted += int(engine.step(slots, 4).accepted.sum())
    assert accepted >= 3  # replacements were accepted (p(token) > 0 under sampling)

    # the reference: a plain draft fed the history (its catch-up in the first speculating step)
    fresh = Engine(tiny_model, DraftModelProposer(tiny_model), CONFIG)
    fresh.warmup(progress=False)
    history = np.asarray(engine.state.history)
    for slot in slots:
        seen = int(engine.proposer_lengths[slot])
        assert seen == int(np.asarray(engine.state.proposer.lengths)[slot])
        fresh.prefill(slot, [int(t) for t in history[slot, :seen]], SamplingParams())
        fresh.step([slot], 4)
        for got, want in zip(_draft_kv(engine, slot, seen), _draft_kv(fresh, slot, seen)):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=f"slot {slot}")


def test_a_stateful_proposer_it_cannot_keep_in_sync_is_refused():
    class Stateful(Proposer):  # tracks context, but is no draft model
        name = "stateful"
        tracks_context = True

    with pytest.raises(TypeError, match="history"):
        NoisyProposer(Stateful(), 0.5, TINY.vocab_size)
