"""Continuous batching: batched == one-at-a-time (greedy, every proposer), streaming, stops,
cancellation, failure isolation, queue limits, threads and timings. Tiny models, small menus."""

from __future__ import annotations

import threading
import time

import jax
import numpy as np
import pytest

from jaxspec.engine import Engine, EngineConfig
from jaxspec.policy.base import BatchView, Decision
from jaxspec.policy.fixed import FixedPolicy, NoSpeculation
from jaxspec.proposers.draft_model import DraftModelProposer
from jaxspec.proposers.prompt_lookup import PromptLookupProposer
from jaxspec.scheduler import (FinishReason, InvalidRequestError, QueueFullError, Request, RequestResult,
                               Scheduler, SchedulerClosedError, SchedulerConfig)
from jaxspec.types import SamplingParams
from tests.fake_tokenizer import EOS, ascii_tokenizer, multibyte_tokenizer

MAX_LEN = 64
CHUNK = 16
LENGTHS = (3, 9, 16, 17, 40, 5)  # 40 > CHUNK: prefilled in three chunks


def _config(batch_buckets, k_menu):
    return EngineConfig(num_slots=4, max_len=MAX_LEN, batch_buckets=batch_buckets, k_menu=k_menu,
                        window_buckets=(MAX_LEN,), prefill_buckets=(CHUNK,))


def _engine(model, proposer, batch_buckets, k_menu) -> Engine:
    engine = Engine(model, proposer, _config(batch_buckets, k_menu))
    engine.warmup(progress=False)
    return engine


@pytest.fixture(scope="module")
def plain(tiny_model):
    return _engine(tiny_model, None, (1, 4), (0,))


@pytest.fixture(scope="module")
def ngram(tiny_model):
    return _engine(tiny_model, PromptLookupProposer(), (4,), (0, 3))


@pytest.fixture(scope="module")
def draft(tiny_model):
    return _engine(tiny_model, DraftModelProposer(tiny_model), (4,), (0, 3))


def prompts(lengths=LENGTHS, seed=0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(3, 64, size=n)] for n in lengths]


def requests(max_tokens=12, **params) -> list[Request]:
    out = [Request(f"r{i}", p, SamplingParams(max_tokens=max_tokens, ignore_eos=i % 2 == 0, **params))
           for i, p in enumerate(prompts())]
    # the cache caps this one at MAX_LEN - 60 = 4 tokens
    out.append(Request("long", prompts((60,), seed=1)[0], SamplingParams(max_tokens=30, ignore_eos=True)))
    return out


@pytest.fixture(scope="module")
def reference(plain) -> dict[str, RequestResult]:
    """One request at a time, plain decoding."""
    sched = Scheduler(plain)
    return {r.request_id: sched.generate_all([r])[0] for r in requests()}


def same_outputs(results, reference):
    for r in results:
        ref = reference[r.request_id]
        assert (r.token_ids, r.finish_reason) == (ref.token_ids, ref.finish_reason), r.request_id


def drive(sched: Scheduler, handles, limit=1000):
    for _ in range(limit):
        if all(h.done() for h in handles):
            return [h.result() for h in handles]
        sched.step_once()
    raise AssertionError("requests did not finish")


def test_reference_is_sane(reference):
    assert reference["long"].token_ids and len(reference["long"].token_ids) == 4
    assert reference["long"].finish_reason is FinishReason.LENGTH
    reasons = {r.finish_reason for r in reference.values()}
    assert reasons <= {FinishReason.LENGTH, FinishReason.EOS}


@pytest.mark.parametrize("which", ["plain", "ngram", "draft"])
def test_batched_greedy_matches_one_at_a_time(which, request, reference):
    engine = request.getfixturevalue(which)
    policy = NoSpeculation() if which == "plain" else FixedPolicy(3)
    results = Scheduler(engine, policy).generate_all(requests())
    same_outputs(results, reference)
    if which != "plain":
        assert sum(r.accepted for r in results) > 0
        assert any(s.k == 3 for r in results for s in r.steps)
    for r in results:
        assert all(s.accepted <= s.proposed <= s.k for s in r.steps)


def test_staggered_arrivals_in_a_loop_thread(ngram, reference):
    sched = Scheduler(ngram, FixedPolicy(3))
    sched.start()
    try:
        handles = []
        for req in requests():
            handles.append(sched.submit(req))
            next(iter(handles[-1]))  # wait for this request's first event before the next arrives
        results = [h.result(timeout=60) for h in handles]
        events = {h.request_id: list(h) for h in handles[:1]}  # the first handle still holds its later events
    finally:
        sched.stop()
    same_outputs(results, reference)
    assert not sched._thread.is_alive()
    first = results[0]
    assert len(first.token_ids) > 1 and events  # streamed pieces arrived after the first


def test_streamed_events_add_up_to_the_result(ngram, reference):
    sched = Scheduler(ngram, FixedPolicy(3), ascii_tokenizer())
    handles = [sched.submit(r) for r in requests()]
    results = drive(sched, handles)
    for h, res in zip(handles, results):
        events = list(h)
        assert events[-1].finished and events[-1].result is res
        assert sum((e.token_ids for e in events), ()) == res.token_ids
        assert "".join(e.text for e in events) == res.text
    same_outputs(results, reference)


def test_long_prompt_prefill_is_interleaved_with_decode_steps(plain, monkeypatch):
    calls = []
    real_prefill, real_step = plain.prefill_chunk, plain.step
    monkeypatch.setattr(plain, "prefill_chunk", lambda slot, *a, **kw: calls.append(("prefill", slot)) or
                        real_prefill(slot, *a, **kw))
    monkeypatch.setattr(plain, "step", lambda slots, *a, **kw: calls.append(("step", tuple(slots))) or
                        real_step(slots, *a, **kw))
    sched = Scheduler(plain)
    short = sched.submit(Request("short", prompts((4,))[0], SamplingParams(max_tokens=20, ignore_eos=True)))
    sched.step_once()
    long = sched.submit(Request("long", prompts((3 * CHUNK,))[0], SamplingParams(max_tokens=4, ignore_eos=True)))
    drive(sched, [short, long])
    long_chunks = [i for i, c in enumerate(calls) if c == ("prefill", 1)]
    assert len(long_chunks) == 3
    between = calls[long_chunks[0]:long_chunks[-1]]
    assert sum(c[0] == "step" for c in between) >= 2  # the short request kept decoding


class RecordingPolicy(NoSpeculation):
    def __init__(self):
        self.views: list[BatchView] = []
        self.elapsed: list[float] = []
        self.forgotten: list[str] = []

    def choose(self, view):
        self.views.append(view)
        return super().choose(view)

    def observe(self, view, decision, result, elapsed_s):
        self.elapsed.append(elapsed_s)

    def forget(self, request_id):
        self.forgotten.append(request_id)


def test_batch_bucket_follows_arrivals_and_departures(plain):
    policy = RecordingPolicy()
    sched = Scheduler(plain, policy)
    long = sched.submit(Request("a", [5, 6, 7], SamplingParams(max_tokens=30, ignore_eos=True)))
    sched.step_once()
    others = [sched.submit(Request(f"b{i}", [9, 10 + i], SamplingParams(max_tokens=3, ignore_eos=True)))
              for i in range(3)]
    drive(sched, [long, *others])
    buckets = [v.batch_bucket for v in policy.views]
    sizes = [v.batch_size for v in policy.views]
    assert buckets[0] == 1 and 4 in buckets and buckets[-1] == 1
    assert max(sizes) == 4
    assert sorted(policy.forgotten) == ["a", "b0", "b1", "b2"]
    # row_max_k: no more proposals than tokens still wanted (and cache room)
    assert policy.views[-1].row_max_k == (0,)  # 'a' has one token left
    assert policy.views[0].row_max_k == (28,)  # first step: 29 tokens left after the prefill's token


def test_cancellation_frees_the_slot(plain):
    sched = Scheduler(plain)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    handles = [sched.submit(Request(f"c{i}", [4 + i, 5, 6], params)) for i in range(6)]
    for _ in range(3):
        sched.step_once()
    assert sched.cancel("c1") and sched.cancel("c5")  # running, waiting
    sched.step_once()
    assert handles[1].done() and handles[5].done()
    c1, c5 = handles[1].result(), handles[5].result()
    assert c1.finish_reason is FinishReason.CANCELLED and 0 < len(c1.token_ids) < 40
    assert c5.finish_reason is FinishReason.CANCELLED and c5.token_ids == () and c5.timings.queued_s is None
    assert sched._slots[1].request_id == "c4"  # the freed slot went to the next waiting request
    results = drive(sched, handles)
    assert [r.finish_reason for r in results] == [FinishReason.LENGTH, FinishReason.CANCELLED, *[FinishReason.LENGTH] * 3,
                                                  FinishReason.CANCELLED]
    assert not sched.cancel("c0")  # already finished


def test_stop_strings_stop_ids_and_eos(ngram):
    tok = ascii_tokenizer()
    base = Request("s", prompts((9,))[0], SamplingParams(max_tokens=24, ignore_eos=True))
    sched = Scheduler(ngram, FixedPolicy(3), tok)
    full = sched.generate_all([base])[0]
    text, ids = full.text, list(full.token_ids)
    assert len(text) >= 8
    stop = text[4:7]
    cut = text.find(stop)
    n = next(i for i in range(1, len(ids) + 1) if stop in tok.decode(ids[:i]))
    stopped = sched.generate_all([Request("s", base.prompt_token_ids,
                                          SamplingParams(max_tokens=24, ignore_eos=True, stop_strings=("zzzz", stop)))])[0]
    assert stopped.finish_reason is FinishReason.STOP
    assert stopped.text == text[:cut] and stopped.token_ids == tuple(ids[:n])

    stop_id = ids[5]
    j = ids.index(stop_id)
    by_id = sched.generate_all([Request("s", base.prompt_token_ids,
                                        SamplingParams(max_tokens=24, ignore_eos=True, stop_token_ids=(stop_id,)))])[0]
    assert by_id.finish_reason is FinishReason.STOP and by_id.token_ids == tuple(ids[:j + 1])

    eos_at = [i for i, t in enumerate(ids) if t == EOS]
    with_eos = sched.generate_all([Request("s", base.prompt_token_ids, SamplingParams(max_tokens=24))])[0]
    if eos_at:
        assert with_eos.finish_reason is FinishReason.EOS and with_eos.token_ids == tuple(ids[:eos_at[0] + 1])
    else:
        assert with_eos.token_ids == full.token_ids


def test_utf8_streaming_never_splits_a_character(plain):
    tok = multibyte_tokenizer()
    sched = Scheduler(plain, tokenizer=tok)
    handles = [sched.submit(Request(f"u{i}", p, SamplingParams(max_tokens=20, ignore_eos=True)))
               for i, p in enumerate(prompts((3, 7, 11, 5), seed=3))]
    results = drive(sched, handles)
    held = 0
    for h, res in zip(handles, results):
        events = list(h)
        assert "".join(e.text for e in events) == res.text == tok.decode(res.token_ids)
        held += sum(1 for e in events if e.token_ids and not e.text)
    assert held > 0  # some tokens ended mid-character and their text waited


def test_failed_prefill_fails_only_that_request(plain, monkeypatch, reference):
    real = plain.prefill_chunk
    bad = requests()[2]

    def prefill_chunk(slot, tokens, start, *a, **kw):
        if start == 0 and list(tokens[:3]) == list(bad.prompt_token_ids[:3]):
            raise RuntimeError("injected")
        return real(slot, tokens, start, *a, **kw)

    monkeypatch.setattr(plain, "prefill_chunk", prefill_chunk)
    sched = Scheduler(plain)
    results = sched.generate_all(requests())
    failed = {r.request_id: r for r in results if r.finish_reason is FinishReason.ERROR}
    assert list(failed) == [bad.request_id] and "injected" in failed[bad.request_id].error
    same_outputs([r for r in results if r.request_id != bad.request_id], reference)
    assert sched.engine_resets == 0


def test_failed_step_fails_its_requests_and_resets_the_engine(plain, monkeypatch, reference):
    real, calls = plain.step, []

    def step(slot_ids, k, row_k=None):
        calls.append(1)
        if len(calls) == 3:  # lose the donated state, as a failure inside the compiled call would
            for leaf in jax.tree.leaves(plain.state):
                leaf.delete()
            raise RuntimeError("injected step failure")
        return real(slot_ids, k, row_k)

    monkeypatch.setattr(plain, "step", step)
    sched = Scheduler(plain, config=SchedulerConfig(prefill_token_budget=CHUNK))
    reqs = requests()
    results = {r.request_id: r for r in sched.generate_all(reqs)}
    failed = [r for r in results.values() if r.finish_reason is FinishReason.ERROR]
    assert failed and all("injected step failure" in r.error for r in failed)
    assert sched.engine_resets == 1
    same_outputs([r for r in results.values() if r.finish_reason is not FinishReason.ERROR], reference)
    assert len(failed) < len(reqs)  # requests that were waiting or prefilling ran after the reset


def test_invalid_requests_are_rejected_alone(plain, reference):
    sched = Scheduler(plain)
    good = requests()[:2]
    bad = [
        Request("empty", [], SamplingParams()),
        Request("too-long", [5] * MAX_LEN, SamplingParams()),
        Request("bad-token", [5, 999], SamplingParams()),
        Request("bad-temp", [5, 6], SamplingParams(temperature=-1.0)),
        Request("stop-no-tok", [5, 6], SamplingParams(stop_strings=("x",))),
    ]
    results = sched.generate_all([good[0], *bad, good[1]])
    reasons = {r.request_id: r.error for r in results if r.finish_reason is FinishReason.ERROR}
    assert set(reasons) == {r.request_id for r in bad}
    assert "empty prompt" in reasons["empty"] and "max_len" in reasons["too-long"]
    assert "999" in reasons["bad-token"] and "temperature" in reasons["bad-temp"]
    assert "tokenizer" in reasons["stop-no-tok"]
    same_outputs([results[0], results[-1]], reference)
    with pytest.raises(InvalidRequestError, match="empty prompt"):
        sched.submit(bad[0])
    sched.submit(good[0])
    with pytest.raises(InvalidRequestError, match="already running"):
        sched.submit(good[0])


def test_bad_policy_decision_fails_loudly(plain):
    class Bad(NoSpeculation):
        def choose(self, view):
            return Decision(k=5)

    result = Scheduler(plain, Bad()).generate_all([Request("x", [5, 6], SamplingParams(max_tokens=4))])[0]
    assert result.finish_reason is FinishReason.ERROR and "not in the compiled menu" in result.error


def test_bounded_queue(plain, reference):
    sched = Scheduler(plain, config=SchedulerConfig(max_queue=2))
    sched.submit(Request("q0", [5], SamplingParams(max_tokens=1)))
    sched.submit(Request("q1", [5], SamplingParams(max_tokens=1)))
    with pytest.raises(QueueFullError, match="full"):
        sched.submit(Request("q2", [5], SamplingParams(max_tokens=1)))
    sched.stop()  # not running: only refuses new work
    with pytest.raises(SchedulerClosedError):
        sched.submit(Request("q3", [5], SamplingParams(max_tokens=1)))
    # generate_all feeds a long list through a short queue
    small = Scheduler(plain, config=SchedulerConfig(max_queue=1))
    same_outputs(small.generate_all(requests()), reference)


def test_loop_thread_blocks_when_idle_and_stops_cleanly(plain):
    sched = Scheduler(plain)
    sched.start()
    results, errors = [], []

    def client(i):
        try:
            results.append(sched.submit(Request(f"t{i}", [5, 6 + i], SamplingParams(max_tokens=5))).result(timeout=60))
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(results) == 6
    idle_from = sched.iterations
    time.sleep(0.3)
    assert sched.iterations == idle_from  # asleep on the condition, not spinning
    running = sched.submit(Request("late", [5, 6], SamplingParams(max_tokens=50, ignore_eos=True)))
    sched.stop()
    assert not sched._thread.is_alive()
    assert running.result(timeout=1).finish_reason in (FinishReason.CANCELLED, FinishReason.LENGTH)
    with pytest.raises(SchedulerClosedError):
        sched.submit(Request("after", [5], SamplingParams()))


def test_stop_with_drain_finishes_live_requests(plain):
    sched = Scheduler(plain)
    sched.start()
    handles = [sched.submit(Request(f"d{i}", [5, 6 + i], SamplingParams(max_tokens=8, ignore_eos=True)))
               for i in range(5)]
    sched.stop(drain=True, timeout=60)
    assert [h.result(timeout=0).finish_reason for h in handles] == [FinishReason.LENGTH] * 5


def test_timings_on_an_injected_clock(plain):
    now = [100.0]
    policy = RecordingPolicy()
    sched = Scheduler(plain, policy, clock=lambda: now[0])
    h = sched.submit(Request("t", [5, 6], SamplingParams(max_tokens=4, ignore_eos=True)))
    now[0] = 101.0
    sched.step_once()  # admitted, prefilled (first token) and one decode step at t=101
    while not h.done():
        now[0] += 0.5
        sched.step_once()
    t = h.result().timings
    assert (t.queued_s, t.ttft_s) == (1.0, 1.0)
    assert t.total_s == 2.0 and t.tpot_s == pytest.approx(1.0 / 3)
    assert policy.elapsed and all(e == 0.0 for e in policy.elapsed)


def test_seeds_sampled_requests(plain):
    sched = Scheduler(plain, seed_source=lambda: 1234)
    params = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    alone = sched.generate_all([Request("x", [5, 6, 7], params)])[0]
    assert alone.seed == 1234
    mixed = sched.generate_all([Request("y", [9, 9], params), Request("x", [5, 6, 7], params)])[1]
    assert mixed.token_ids == alone.token_ids  # per-request keys: the batch mix does not matter
    greedy = sched.generate_all([Request("g", [5], SamplingParams(max_tokens=2))])[0]
    assert greedy.seed == 0


def test_max_running_caps_concurrency(plain, reference):
    policy = RecordingPolicy()
    sched = Scheduler(plain, policy, config=SchedulerConfig(max_running=1))
    same_outputs(sched.generate_all(requests()[:3]), reference)
    assert {v.batch_size for v in policy.views} == {1}
    with pytest.raises(ValueError, match="exceeds the largest batch bucket"):
        Scheduler(plain, config=SchedulerConfig(max_running=5))


def test_abandoned_iteration_cancels_and_frees_slots(plain):
    sched = Scheduler(plain)
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    gen = sched.iter_completed([Request(f"a{i}", [5, 6 + i], params) for i in range(8)])
    first = next(gen)
    assert first.finish_reason is FinishReason.LENGTH
    gen.close()
    assert sched.num_live == 0 and not sched._slots and not plain.lengths.any()
