"""The scheduler over the page pool (fake engine): admission by pages, preemption, prefix-cache reporting, and a
long run with cancellations that ends with every page back."""

from __future__ import annotations

import numpy as np
import pytest

from jaxspec.engine.fake import FakeEngine
from jaxspec.menu import Menu
from jaxspec.policy.fixed import FixedPolicy
from jaxspec.scheduling.requests import FinishReason, Request
from jaxspec.scheduling.scheduler import Scheduler, SchedulerConfig
from jaxspec.types import SamplingParams

VOCAB = 64
PAGE = 8


def _engine(num_pages: int | None, accept: int = 2, prefix_cache: bool = True) -> FakeEngine:
    menu = Menu(num_slots=4, max_len=96, batch_buckets=(1, 4), k_menu=(0, 3), window_buckets=(32, 96),
                prefill_buckets=(16,), page_size=PAGE, num_pages=num_pages)
    engine = FakeEngine(menu, vocab_size=VOCAB, accept=accept, prefix_cache=prefix_cache)
    engine.warmup()
    return engine


def _expected(engine: FakeEngine, request: Request) -> tuple[int, ...]:
    return tuple(engine.expected_output(request.prompt_token_ids, request.params.max_tokens))


def _prompts(lengths, seed=0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(0, VOCAB, n)] for n in lengths]


@pytest.mark.parametrize("overlap", [True, False])
def test_a_small_pool_preempts_and_every_stream_is_whole(overlap):
    """4 requests growing to 8-9 pages each in a pool of 20: the youngest is preempted when a step cannot get
    its pages, recomputed later, and every request's stream and result are its exact output."""
    requests = [Request(f"r{i}", p, SamplingParams(max_tokens=50, ignore_eos=True))
                for i, p in enumerate(_prompts([10, 14, 18, 22]))]
    engine = _engine(num_pages=21)
    sched = Scheduler(engine, FixedPolicy(3), config=SchedulerConfig(overlap=overlap))
    handles = [sched.submit(r) for r in requests]
    for _ in range(2000):
        if all(h.done() for h in handles):
            break
        sched.step_once()
    results = [h.result(timeout=0) for h in handles]
    for request, handle, result in zip(requests, handles, results):
        assert (result.finish_reason, result.token_ids) == (FinishReason.LENGTH, _expected(engine, request))
        assert tuple(t for event in handle for t in event.token_ids) == result.token_ids
    assert sched.preemptions > 0 and sum(r.preemptions for r in results) == sched.preemptions
    assert engine.page_stats().in_use == 0


def test_admission_waits_for_pages():
    """Slots are free but pages are not: the second request waits until the first gives its pages back."""
    engine = _engine(num_pages=6)  # 5 usable pages
    sched = Scheduler(engine, FixedPolicy(0))
    first = sched.submit(Request("a", _prompts([30])[0], SamplingParams(max_tokens=4, ignore_eos=True)))
    second = sched.submit(Request("b", _prompts([20], seed=1)[0], SamplingParams(max_tokens=4, ignore_eos=True)))
    sched.step_once()
    assert sched.num_running == 1 and sched.num_waiting == 1  # a: 4 pages; b would need 3
    while not (first.done() and second.done()):
        sched.step_once()
    assert first.result().finish_reason == second.result().finish_reason == FinishReason.LENGTH


def test_cached_prompt_tokens_are_reported():
    """A prefix is shared once its pages are written: requests admitted after the first one's prefill share
    its system prompt's full pages; two admitted together (before either is written) do not share."""
    system = _prompts([27], seed=3)[0]  # 3 full pages
    requests = [Request(f"r{i}", system + tail, SamplingParams(max_tokens=5, ignore_eos=True))
                for i, tail in enumerate(_prompts([2, 9, 4, 6], seed=4))]
    for prefix_cache, cached in ((True, [0, 24, 24, 0]), (False, [0, 0, 0, 0])):
        engine = _engine(None, prefix_cache=prefix_cache)
        sched = Scheduler(engine, FixedPolicy(3))
        results = sched.generate_all(requests[:1]) + sched.generate_all(requests[1:3])
        results += Scheduler(_engine(None, prefix_cache=prefix_cache), FixedPolicy(3)).generate_all(requests[3:])
        assert [r.cached_prompt_tokens for r in results] == cached
        assert [r.stats()["cached_prompt_tokens"] for r in results] == cached
        assert [r.token_ids for r in results] == [_expected(engine, r) for r in requests]
    together = Scheduler(_engine(None), FixedPolicy(3)).generate_all(requests[:2])
    assert [r.cached_prompt_tokens for r in together] == [0, 0]


def test_a_long_run_with_cancellations_returns_every_page():
    """Two thousand requests of random lengths through a small pool, a fifth cancelled at random moments: every
    request ends (the cancelled as cancelled, the others with their exact output) and every page is back."""
    rng = np.random.default_rng(7)
    engine = _engine(num_pages=30)
    sched = Scheduler(engine, FixedPolicy(3), config=SchedulerConfig(max_queue=3000))
    system = _prompts([16], seed=9)[0]
    requests = []
    for i in range(2000):
        tail = [int(t) for t in rng.integers(0, VOCAB, rng.integers(1, 30))]
        prompt = (system if rng.random() < 0.5 else []) + tail
        requests.append(Request(f"r{i}", prompt, SamplingParams(max_tokens=int(rng.integers(1, 40)),
                                                                 ignore_eos=True)))
    handles = [sched.submit(r, stream=False) for r in requests]
    cancel_at = {int(i): int(rng.integers(0, 6000)) for i in rng.choice(2000, 400, replace=False)}
    iteration = 0
    while not all(h.done() for h in handles):
        for i, at in list(cancel_at.items()):
            if at <= iteration:
                handles[i].cancel()
                del cancel_at[i]
        sched.step_once()
        iteration += 1
        assert iteration < 40000
    cancelled = 0
    for request, handle in zip(requests, handles):
        result = handle.result()
        if result.finish_reason == FinishReason.CANCELLED:
            cancelled += 1
        else:
            assert (result.finish_reason, result.token_ids) == (FinishReason.LENGTH, _expected(engine, request))
    assert cancelled > 0 and sched.preemptions > 0
    stats = engine.page_stats()
    assert stats.in_use == 0 and stats.free + stats.cached == stats.total
