"""Greedy equality: every proposer × every k of the menu × batch {1, 3, 8} equals plain decoding."""

from __future__ import annotations

import numpy as np
import pytest

from jaxspec.engine import compile_counter
from jaxspec.engine.engine import Engine
from jaxspec.menu import CapacityError, Menu, MenuMissError
from jaxspec.models.config import TINY, TINY_QWEN
from jaxspec.models.llama import random_model
from jaxspec.speculation.proposers.draft_model import DraftModelProposer
from jaxspec.speculation.proposers.noisy import NoisyProposer
from jaxspec.speculation.proposers.prompt_lookup import PromptLookupProposer
from jaxspec.types import SamplingParams
from tests.conftest import decode, needs_cpu_kernels, random_prompts, reference_greedy

MENU = Menu(num_slots=8, max_len=128, batch_buckets=(1, 8), k_menu=(0, 1, 2, 3, 4, 5, 6, 8),
                    window_buckets=(128,), prefill_buckets=(32,))
N_NEW = 16
PROMPT_LENGTHS = (5, 40, 11, 23, 7, 33, 2, 18)


def _repetitive(prompt: list[int], continuation: list[int]) -> list[int]:
    """A prompt that already contains its own greedy continuation (so prompt lookup hits)."""
    return prompt + continuation[:10] + prompt[-3:]


@pytest.fixture(scope="module")
def references(tiny_model):
    prompts = random_prompts(PROMPT_LENGTHS, TINY.vocab_size, seed=1)
    prompts = [_repetitive(p, reference_greedy(tiny_model, p, 10)) for p in prompts]
    return prompts, [reference_greedy(tiny_model, p, N_NEW) for p in prompts]


def _proposers(target):
    return {
        "ngram": lambda: PromptLookupProposer(),
        "draft-self": lambda: DraftModelProposer(target),
        "draft-truncated": lambda: DraftModelProposer(_truncated(target, 1)),
        "noisy-0.6": lambda: NoisyProposer(DraftModelProposer(target), 0.6, TINY.vocab_size),
    }


def _truncated(target, layers: int):
    """A copy of the target with only its first `layers` layers (a cheap, imperfect draft)."""
    from jaxspec.models.llama import from_hf_state_dict, to_hf_state_dict
    return from_hf_state_dict(target.config.replace(num_layers=layers), to_hf_state_dict(target))


@pytest.mark.parametrize("name", ["ngram", "draft-self", "draft-truncated", "noisy-0.6"])
def test_greedy_equals_plain_decoding(tiny_model, references, name):
    compile_counter.install()
    engine = Engine(tiny_model, _proposers(tiny_model)[name](), MENU)
    engine.warmup(progress=False)
    compiles = compile_counter.count()
    prompts, expected = references
    rates = {}
    for k in MENU.k_menu:
        for batch in (1, 3, 8):
            outputs, rates[k, batch] = decode(engine, prompts[:batch], k, N_NEW)
            for row, (out, ref) in enumerate(zip(outputs, expected)):
                assert out == ref, f"{name} k={k} batch={batch} row={row}"
    assert compile_counter.count() == compiles, "a step compiled after warm-up"
    if name == "draft-self":  # the target as its own draft accepts everything at temperature 0
        assert all(r == 1.0 for (k, _), r in rates.items() if k > 0)
    else:
        assert any(r > 0 for (k, _), r in rates.items() if k > 0), "nothing was ever accepted"


@needs_cpu_kernels
@pytest.mark.parametrize("name", ["ngram", "draft-self"])
def test_greedy_equals_plain_decoding_with_the_table_head(name):
    """A tied embedding on XLA:CPU float32: the engine's LM head is the table kernel (and its layers panels);
    every k and batch still equals plain decoding by the cache-free XLA forward."""
    target = random_model(TINY_QWEN, seed=3)
    engine = Engine(target, _proposers(target)[name](), MENU)
    engine.warmup(progress=False)
    assert engine.kernels.table_head and engine.kernels.panels
    prompts = random_prompts(PROMPT_LENGTHS, TINY_QWEN.vocab_size, seed=4)
    prompts = [_repetitive(p, reference_greedy(target, p, 10)) for p in prompts]
    expected = [reference_greedy(target, p, N_NEW) for p in prompts]
    for k in (0, 1, 4, 8):
        for batch in (1, 8):
            outputs, rate = decode(engine, prompts[:batch], k, N_NEW)
            assert outputs == expected[:batch], f"{name} k={k} batch={batch}"
            if name == "draft-self" and k > 0:
                assert rate == 1.0


def test_plain_engine_and_menu_errors(tiny_model, references):
    engine = Engine(tiny_model, None, MENU.replace(batch_buckets=(1,)))
    assert engine.menu.k_menu == (0,)
    engine.warmup(progress=False)
    prompts, expected = references
    outputs, _ = decode(engine, prompts[:1], 0, N_NEW)
    assert outputs[0] == expected[0]
    with pytest.raises(MenuMissError):
        engine.step([0], 3)
    with pytest.raises(MenuMissError):
        engine.step([0, 1], 0)
    with pytest.raises(CapacityError):
        engine.prefill(1, list(range(2, 2 + MENU.max_len)), SamplingParams())
    with pytest.raises(ValueError):
        engine.prefill(1, [], SamplingParams())


def test_vocab_mismatch_is_a_clear_error(tiny_model):
    other = random_model(TINY.replace(vocab_size=32), seed=3)
    with pytest.raises(ValueError, match="vocabulary"):
        Engine(tiny_model, DraftModelProposer(other), MENU)


def test_draft_cache_stays_in_sync_across_k0_steps(tiny_model, references):
    """Alternate k = 0 and k > 0: with the target as draft every proposal must be accepted,
    which only holds if the draft cache saw every committed token (bonus ones included). k = 0
    steps leave the draft alone; runs of them are caught up in chunks when speculation resumes."""
    cfg = MENU.replace(batch_buckets=(4,), k_menu=(0, 3))
    engine = Engine(tiny_model, DraftModelProposer(tiny_model), cfg)
    engine.warmup(progress=False)
    prompts, expected = references
    slots = [0, 1, 2]
    outputs = [[engine.prefill(s, p, SamplingParams())] for s, p in zip(slots, prompts[:3])]
    catch_ups = 0
    for k in (0, 0, 3, 0, 3, 3, 0, 0, 0, 3, 0, 0, 0, 0, 0, 0, 0, 0, 3, 3):
        planned = [len(engine.catch_up_plan(s)) for s in slots]
        result = engine.step(slots, k)
        if k:
            assert (result.accepted == k).all()
            # the step ran exactly the planned catch-up calls and left nothing pending
            assert result.catch_up_calls == sum(planned)
            assert (result.catch_up_s > 0) == (sum(planned) > 0)
            assert all(not engine.catch_up_plan(s) for s in slots)
            catch_ups += result.catch_up_calls
        else:
            assert result.catch_up_calls == 0
        for row, out in enumerate(outputs):
            out += result.row_tokens(row)
    assert catch_ups >= len(slots)  # the runs of k = 0 steps did need catching up
    assert engine.catch_up_totals.calls == catch_ups
    draft_lengths = np.asarray(engine.state.proposer.lengths)[slots]
    np.testing.assert_array_equal(draft_lengths, engine.proposer_lengths[slots])  # host mirror is exact
    # after an all-accepted step the draft lacks d_k
    np.testing.assert_array_equal(draft_lengths + 1, engine.lengths[slots])
    for out, ref in zip(outputs, expected):
        assert out[:N_NEW] == ref


def test_a_one_token_prompt_in_a_reused_slot_starts_the_draft_afresh(tiny_model):
    """Prefill leaves the draft alone but empties its context: a 1-token prompt needs no catch-up call (the
    step's own catch-up feeds it), and must not inherit the draft length of the slot's previous request."""
    engine = Engine(tiny_model, DraftModelProposer(tiny_model), MENU.replace(batch_buckets=(1,), k_menu=(0, 3)))
    engine.warmup(progress=False)
    long_prompt = random_prompts((30,), TINY.vocab_size, seed=12)[0]
    decode(engine, [long_prompt], 3, 12)
    token = [int(long_prompt[4])]
    output = [engine.prefill(0, token, SamplingParams())]
    assert engine.catch_up_plan(0) == []
    while len(output) < 12:
        result = engine.step([0], 3)
        assert (result.accepted == 3).all()  # the target as its own draft: a draft in sync accepts everything
        output += result.row_tokens(0)
    assert output[:12] == reference_greedy(tiny_model, token, 12)
