"""Log-probabilities of emitted tokens (the engine's static `logprobs` option): the target's raw distribution at
every emitted token, equal with and without speculation, through the scheduler's events and results."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxspec.engine.engine import Engine
from jaxspec.engine.fake import FakeEngine, fake_logprobs
from jaxspec.menu import Menu
from jaxspec.policy.fixed import FixedPolicy
from jaxspec.scheduling.requests import InvalidRequestError, Request
from jaxspec.scheduling.scheduler import Scheduler
from jaxspec.speculation.proposers.draft_model import DraftModelProposer
from jaxspec.speculation.proposers.prompt_lookup import PromptLookupProposer
from jaxspec.types import SamplingParams
from tests.conftest import _jitted_forward

MENU = Menu(num_slots=2, max_len=64, batch_buckets=(1,), k_menu=(0, 3), window_buckets=(64,), prefill_buckets=(16,))
PROMPT = [5, 9, 5, 9, 5, 9, 7, 3, 11]
N_TOP = 4
N_NEW = 14


def greedy_with_logprobs(engine: Engine, k: int) -> tuple[list[int], list]:
    """Greedy decoding of N_NEW tokens at a fixed k: (tokens, their TokenLogprobs)."""
    engine.reset()
    first = engine.prefill(0, PROMPT, SamplingParams())
    tokens, logprobs = [first], [engine.first_token_logprobs(0)]
    while len(tokens) < N_NEW:
        result = engine.step([0], k if engine.room(0) >= k else 0)
        tokens += result.row_tokens(0)
        logprobs += result.row_logprobs(0, N_TOP)
    return tokens[:N_NEW], logprobs[:N_NEW]


@pytest.mark.parametrize("proposer", ["draft", "ngram"])
def test_greedy_logprobs_are_the_targets_with_and_without_speculation(tiny_model, proposer):
    plain = Engine(tiny_model, None, MENU, logprobs=N_TOP)
    spec = Engine(tiny_model, DraftModelProposer(tiny_model) if proposer == "draft" else PromptLookupProposer(1, 3),
                  MENU, logprobs=N_TOP)
    for engine in (plain, spec):
        engine.warmup(progress=False)
    tokens, reference = greedy_with_logprobs(plain, 0)
    spec_tokens, speculated = greedy_with_logprobs(spec, 3)
    assert spec_tokens == tokens
    # the cache-free forward over prompt + output: log_softmax at the position before each emitted token
    padded = np.zeros((1, 64), np.int32)
    padded[0, :len(PROMPT) + N_NEW] = PROMPT + tokens
    logp = np.asarray(jax.nn.log_softmax(_jitted_forward(tiny_model)(padded)[0], axis=-1))  # [64, V]
    for j, (token, a, b) in enumerate(zip(tokens, reference, speculated, strict=True)):
        expected = logp[len(PROMPT) - 1 + j]
        top = np.argsort(-expected)[:N_TOP]
        for entry in (a, b):
            assert entry.token_id == token
            np.testing.assert_allclose(entry.logprob, expected[token], atol=2e-4)
            assert [i for i, _ in entry.top] == list(top)
            np.testing.assert_allclose([v for _, v in entry.top], expected[top], atol=2e-4)
            assert entry.top[0][0] == token  # greedy: the emitted token is the most likely one


def test_an_engine_without_the_option_returns_none(tiny_model):
    engine = Engine(tiny_model, None, MENU)
    engine.warmup(progress=False)
    engine.prefill(0, PROMPT, SamplingParams())
    assert engine.step([0], 0).logprobs is None
    with pytest.raises(ValueError, match="logprobs option is 0"):
        engine.first_token_logprobs(0)
    with pytest.raises(ValueError, match="logprobs must be in"):
        Engine(tiny_model, None, MENU, logprobs=21)


def test_the_scheduler_streams_logprobs_with_the_tokens_when_asked():
    engine = FakeEngine(MENU, vocab_size=64, accept=2, logprobs=3)
    engine.warmup(progress=False)
    scheduler = Scheduler(engine, FixedPolicy(3), None)
    asked = Request("a", (4, 5, 6), SamplingParams(max_tokens=9, logprobs=2))
    plain = Request("b", (4, 5, 6), SamplingParams(max_tokens=9))
    handle = scheduler.submit(asked)
    other = scheduler.submit(plain)
    while not (handle.done() and other.done()):
        scheduler.step_once()
    events = []
    while not handle._events.empty():
        events.append(handle.get())
    result = handle.result()
    assert [e.token_id for e in result.logprobs] == list(result.token_ids) == engine.expected_output([6], 9)
    assert result.logprobs == tuple(fake_logprobs(t, 2, 64) for t in result.token_ids)
    assert all(len(e.logprobs) == len(e.token_ids) for e in events) and len(events) > 2  # per event, aligned
    assert tuple(x for e in events for x in e.logprobs) == result.logprobs
    assert other.result().logprobs == ()


def test_logprobs_beyond_the_engines_option_are_refused():
    for option, asked, reason in ((0, 0, "logprobs are off"), (3, 4, "logprobs must be <= 3")):
        engine = FakeEngine(MENU, vocab_size=64, logprobs=option)
        engine.warmup(progress=False)
        with pytest.raises(InvalidRequestError, match=reason):
            Scheduler(engine, None, None).submit(Request("x", (1, 2), SamplingParams(logprobs=asked)))
    with pytest.raises(ValueError, match="logprobs must be in"):
        SamplingParams(logprobs=21).validate()
