"""Continuous batching: outputs, streaming, stops, cancellation, failure isolation, queue limits,
threads, timings and step listeners.

Most tests run on the fake engine (jaxspec.engine.fake: token after t is t + 1 mod V), so every
output is known by hand and no XLA compile runs. A few end-to-end tests at the end use the real
tiny engine: batched greedy == one at a time for every proposer, and a failed step's reset.
"""

from __future__ import annotations

import dataclasses
import threading
import time

import jax
import numpy as np
import pytest

from jaxspec.engine.engine import Engine
from jaxspec.engine.fake import FakeEngine
from jaxspec.menu import Menu
from jaxspec.policy.base import BatchView, Decision
from jaxspec.policy.fixed import FixedPolicy, NoSpeculation
from jaxspec.scheduling.requests import (
    FinishReason,
    InvalidRequestError,
    QueueFullError,
    Request,
    RequestResult,
    SchedulerClosedError,
)
from jaxspec.scheduling.scheduler import Scheduler, SchedulerConfig, StepStats
from jaxspec.speculation.proposers.draft_model import DraftModelProposer
from jaxspec.speculation.proposers.prompt_lookup import PromptLookupProposer
from jaxspec.types import SamplingParams
from tests.conftest import wait_until
from tests.fake_tokenizer import ASCII_ALPHABET, EOS, ascii_tokenizer, multibyte_tokenizer

MAX_LEN = 64
CHUNK = 16
VOCAB = 64
LENGTHS = (3, 9, 16, 17, 40, 5)  # 40 > CHUNK: prefilled in three chunks


def _menu(batch_buckets=(1, 4), k_menu=(0, 3)) -> Menu:
    return Menu(num_slots=4, max_len=MAX_LEN, batch_buckets=batch_buckets, k_menu=k_menu,
                window_buckets=(MAX_LEN,), prefill_buckets=(CHUNK,))


def fake(accept=0, **kwargs) -> FakeEngine:
    engine = FakeEngine(_menu(), vocab_size=VOCAB, eos_token_ids=(EOS,), accept=accept, **kwargs)
    engine.warmup()
    return engine


def prompts(lengths=LENGTHS, seed=0, high=40) -> list[list[int]]:
    """Token ids in [3, high): counting from the last one stays clear of EOS (1) for a while."""
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(3, high, size=n)] for n in lengths]


def requests(max_tokens=12, high=40) -> list[Request]:
    out = [Request(f"r{i}", p, SamplingParams(max_tokens=max_tokens, ignore_eos=i % 2 == 0))
           for i, p in enumerate(prompts(high=high))]
    # the cache caps this one at MAX_LEN - 60 = 4 tokens
    out.append(Request("long", prompts((60,), seed=1, high=high)[0], SamplingParams(max_tokens=30, ignore_eos=True)))
    return out


def expected(engine: FakeEngine, request: Request) -> tuple[int, ...]:
    """The counting output of a request that ends by length (max_tokens or the cache)."""
    prompt = request.prompt_token_ids
    return tuple(engine.expected_output(prompt, min(request.params.max_tokens, MAX_LEN - len(prompt))))


def check_counting(engine: FakeEngine, results: list[RequestResult], reqs: list[Request]) -> None:
    for req, res in zip(reqs, results, strict=True):
        assert res.request_id == req.request_id
        assert (res.token_ids, res.finish_reason, res.error) == (expected(engine, req), FinishReason.LENGTH, None)


def drive(sched: Scheduler, handles, limit=1000):
    for _ in range(limit):
        if all(h.done() for h in handles):
            return [h.result() for h in handles]
        sched.step_once()
    raise AssertionError("requests did not finish")


class RecordingPolicy(NoSpeculation):
    """k = 0 (or a fixed k through `choice`), recording what it sees."""

    def __init__(self, choice=None):
        self.choice = choice
        self.views: list[BatchView] = []
        self.elapsed: list[float] = []
        self.forgotten: list[str] = []

    def choose(self, view):
        self.views.append(view)
        return self.choice(view) if self.choice else super().choose(view)

    def observe(self, view, decision, result, elapsed_s):
        self.elapsed.append(elapsed_s)

    def forget(self, request_id):
        self.forgotten.append(request_id)


# --- outputs and speculation accounting (fake engine) ----------------------------------------


@pytest.mark.parametrize("accept", [0, 1, 3, 5])
@pytest.mark.parametrize("k", [0, 3])
def test_outputs_count_on_for_every_k_and_acceptance(k, accept):
    engine = fake(accept)
    reqs = requests()
    results = Scheduler(engine, FixedPolicy(k)).generate_all(reqs)
    check_counting(engine, results, reqs)
    assert results[-1].token_ids and len(results[-1].token_ids) == 4  # capped by the cache
    for r in results:
        # each step: the row's k is capped by the tokens still wanted, and min(accept, k) are accepted
        assert all(s.proposed == s.k <= k and s.accepted == min(accept, s.k) for s in r.steps)
        assert len(r.token_ids) == 1 + sum(s.accepted + 1 for s in r.steps)  # prefill token + each step's
    if k and accept:
        assert sum(r.accepted for r in results) > 0


def test_staggered_arrivals_in_a_loop_thread():
    engine = fake(accept=2)
    sched = Scheduler(engine, FixedPolicy(3))
    sched.start()
    try:
        handles = []
        for req in requests():
            handles.append(sched.submit(req))
            next(iter(handles[-1]))  # wait for this request's first event before the next arrives
        results = [h.result(timeout=60) for h in handles]
        events = list(handles[0])  # the first handle still holds its later events
    finally:
        sched.stop()
    check_counting(engine, results, requests())
    assert not sched._thread.is_alive()
    assert events and events[-1].finished  # streamed pieces arrived after the first


def test_streamed_events_add_up_to_the_result():
    engine = fake(accept=2)
    tok = ascii_tokenizer()
    sched = Scheduler(engine, FixedPolicy(3), tok)
    handles = [sched.submit(r) for r in requests()]
    results = drive(sched, handles)
    for h, res in zip(handles, results):
        events = list(h)
        assert events[-1].finished and events[-1].result is res
        assert sum((e.token_ids for e in events), ()) == res.token_ids
        assert "".join(e.text for e in events) == res.text == tok.decode(res.token_ids)
        assert len(events) == 1 + len(res.steps)  # the prefill's token, then one event per step
    check_counting(engine, results, requests())


def test_long_prompt_prefill_is_interleaved_with_decode_steps():
    engine = fake()
    sched = Scheduler(engine)
    short = sched.submit(Request("short", prompts((4,))[0], SamplingParams(max_tokens=20, ignore_eos=True)))
    sched.step_once()
    long = sched.submit(Request("long", prompts((3 * CHUNK,))[0], SamplingParams(max_tokens=4, ignore_eos=True)))
    drive(sched, [short, long])
    calls = [(c.kind, c.slots) for c in engine.calls]
    long_chunks = [i for i, c in enumerate(calls) if c == ("prefill", (1,))]
    assert len(long_chunks) == 3
    between = calls[long_chunks[0]:long_chunks[-1]]
    assert sum(kind == "step" for kind, _ in between) >= 2  # the short request kept decoding


def test_batch_bucket_follows_arrivals_and_departures():
    policy = RecordingPolicy()
    sched = Scheduler(fake(), policy)
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
    # context_lens: committed tokens (prompt + generated but the pending one)
    assert policy.views[0].context_lens == (3,)
    # row_max_k: no more proposals than tokens still wanted (and cache room)
    assert policy.views[-1].row_max_k == (0,)  # 'a' has one token left
    assert policy.views[0].row_max_k == (28,)  # first step: 29 tokens left after the prefill's token


def test_row_max_k_is_capped_by_the_cache_room():
    policy = RecordingPolicy()
    sched = Scheduler(fake(), policy)
    sched.generate_all([Request("x", prompts((60,))[0], SamplingParams(max_tokens=30, ignore_eos=True))])
    # 60 committed of 64: the pending token and k proposals must fit positions 60..63
    assert [v.row_max_k for v in policy.views] == [(2,), (1,), (0,)]
    assert [v.context_lens for v in policy.views] == [(60,), (61,), (62,)]


def test_per_row_caps_reach_the_engine_and_the_step_records():
    engine = fake(accept=3)
    policy = RecordingPolicy(lambda view: Decision(k=3, row_k=tuple(3 if i == 0 else 0
                                                                   for i in range(view.batch_size))))
    reqs = requests()[:2]
    results = Scheduler(engine, policy).generate_all(reqs)
    check_counting(engine, results, reqs)
    first_step = results[0].steps[0], results[1].steps[0]
    assert [(s.k, s.proposed, s.accepted) for s in first_step] == [(3, 3, 3), (0, 0, 0)]


def test_pending_catch_up_is_shown_to_the_policy():
    k_after = iter([0, 0, 3, 3, 3, 3])
    policy = RecordingPolicy(lambda view: Decision(k=next(k_after, 0)))
    engine = fake(accept=1, tracks_context=True, in_step_catch_up=2)
    Scheduler(engine, policy).generate_all([Request("x", [5, 6], SamplingParams(max_tokens=8, ignore_eos=True))])
    # the draft has not seen the prompt (prefill leaves it alone), and two k = 0 steps leave it further
    # behind: the first k = 3 step catches up first, in one call of the smallest chunk (8 tokens); after it
    # nothing is pending
    assert [v.catch_up_calls for v in policy.views[:4]] == [(1,), (1,), (1,), (0,)]
    assert [v.catch_up_tokens for v in policy.views[:4]] == [(8,), (8,), (8,), (0,)]
    assert [c.key.chunk for c in engine.calls if c.kind == "catch_up"] == [8]


# --- stops -----------------------------------------------------------------------------------


@pytest.mark.parametrize("accept", [0, 3])
def test_eos_is_kept_as_the_last_id(accept):
    engine = fake(accept)
    sched = Scheduler(engine, FixedPolicy(3))
    got = sched.generate_all([Request("e", [5, 61], SamplingParams(max_tokens=10)),
                              Request("i", [5, 61], SamplingParams(max_tokens=10, ignore_eos=True))])
    assert got[0].finish_reason is FinishReason.EOS and got[0].token_ids == (62, 63, 0, EOS)
    assert got[1].finish_reason is FinishReason.LENGTH and got[1].token_ids == tuple(engine.expected_output([61], 10))


def test_eos_ids_of_the_tokenizer_count_and_can_be_overridden():
    engine = FakeEngine(_menu(), vocab_size=VOCAB, eos_token_ids=())  # the model knows no eos
    engine.warmup()
    request = Request("e", [5, 61], SamplingParams(max_tokens=10))
    assert Scheduler(engine, tokenizer=ascii_tokenizer()).generate_all([request])[0].token_ids == (62, 63, 0, EOS)
    assert len(Scheduler(engine).generate_all([request])[0].token_ids) == 10
    assert Scheduler(engine, eos_token_ids=[63]).generate_all([request])[0].token_ids == (62, 63)


@pytest.mark.parametrize("accept", [0, 3])
def test_stop_token_id_is_kept_and_later_tokens_dropped(accept):
    sched = Scheduler(fake(accept), FixedPolicy(3))
    got = sched.generate_all([Request("s", [5, 6], SamplingParams(max_tokens=20, stop_token_ids=(10, 12)))])[0]
    assert got.finish_reason is FinishReason.STOP and got.token_ids == (7, 8, 9, 10)


@pytest.mark.parametrize("accept", [0, 3])  # the stop string spans two steps / lies inside one step
def test_stop_string_cuts_the_text_and_ends_at_its_token(accept):
    tok = ascii_tokenizer()
    assert tok.decode([4, 5, 6, 7, 8]) == "bcdef" == ASCII_ALPHABET[1:6]
    sched = Scheduler(fake(accept), FixedPolicy(3), tok)
    handle = sched.submit(Request("s", [3], SamplingParams(max_tokens=20, stop_strings=("zz", "de"))))
    got = drive(sched, [handle])[0]
    assert got.finish_reason is FinishReason.STOP
    assert got.text == "bc" and got.token_ids == (4, 5, 6, 7)  # 7 ('e') completed "de"; nothing after it
    assert "".join(e.text for e in handle) == "bc"


def test_utf8_streaming_never_splits_a_character():
    tok = multibyte_tokenizer()
    sched = Scheduler(fake(accept=1), FixedPolicy(3), tokenizer=tok)
    handles = [sched.submit(Request(f"u{i}", p, SamplingParams(max_tokens=20, ignore_eos=True)))
               for i, p in enumerate(prompts((3, 7, 11, 5), seed=3))]
    results = drive(sched, handles)
    held = 0
    for h, res in zip(handles, results):
        events = list(h)
        assert "".join(e.text for e in events) == res.text == tok.decode(res.token_ids)
        held += sum(1 for e in events if e.token_ids and not e.text)
    assert held > 0  # some tokens ended mid-character and their text waited


# --- cancellation, failures, validation ------------------------------------------------------------


def test_cancellation_frees_the_slot():
    engine = fake()
    sched = Scheduler(engine, config=SchedulerConfig(overlap=False))  # one step read per iteration
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    handles = [sched.submit(Request(f"c{i}", [4 + i, 5, 6], params)) for i in range(6)]
    for _ in range(3):
        sched.step_once()
    assert sched.cancel("c1") and handles[5].cancel()  # running, waiting
    sched.step_once()
    assert handles[1].done() and handles[5].done()
    c1, c5 = handles[1].result(), handles[5].result()
    assert c1.finish_reason is FinishReason.CANCELLED and c1.token_ids == tuple(engine.expected_output([6], 4))
    assert c5.finish_reason is FinishReason.CANCELLED and c5.token_ids == () and c5.timings.queued_s is None
    assert sched._slots[1].request_id == "c4"  # the freed slot went to the next waiting request
    results = drive(sched, handles)
    length, cancelled = FinishReason.LENGTH, FinishReason.CANCELLED
    assert [r.finish_reason for r in results] == [length, cancelled, length, length, length, cancelled]
    assert not sched.cancel("c0")  # already finished


def test_failed_prefill_fails_only_that_request():
    engine = fake(accept=1)
    real = engine.prefill_chunk
    reqs = requests()
    bad = reqs[2]

    def prefill_chunk(slot, tokens, start, *a, **kw):
        if start == 0 and list(tokens[:3]) == list(bad.prompt_token_ids[:3]):
            raise RuntimeError("injected")
        return real(slot, tokens, start, *a, **kw)

    engine.prefill_chunk = prefill_chunk
    sched = Scheduler(engine, FixedPolicy(3))
    results = sched.generate_all(reqs)
    failed = {r.request_id: r for r in results if r.finish_reason is FinishReason.ERROR}
    assert list(failed) == [bad.request_id] and "injected" in failed[bad.request_id].error
    check_counting(engine, [r for r in results if r is not failed[bad.request_id]], [r for r in reqs if r is not bad])
    assert sched.engine_resets == 0


def test_prefill_that_loses_the_state_resets_the_engine():
    engine = fake()
    real = engine.prefill_chunk

    def prefill_chunk(slot, tokens, start, is_last, *a, **kw):
        if slot == 1 and start == CHUNK:  # the second chunk of the second request
            engine.lost = True
            raise RuntimeError("injected prefill failure")
        return real(slot, tokens, start, is_last, *a, **kw)

    engine.prefill_chunk = prefill_chunk
    sched = Scheduler(engine, config=SchedulerConfig(prefill_token_budget=CHUNK))
    running = sched.submit(Request("running", [5, 6], SamplingParams(max_tokens=20, ignore_eos=True)))
    sched.step_once()
    bad = sched.submit(Request("bad", prompts((40,))[0], SamplingParams(max_tokens=4)))
    waiting = Request("prefilling", prompts((20,), seed=2)[0], SamplingParams(max_tokens=4, ignore_eos=True))
    late = sched.submit(waiting)
    results = drive(sched, [running, bad, late])
    assert sched.engine_resets == 1
    assert [r.finish_reason for r in results[:2]] == [FinishReason.ERROR, FinishReason.ERROR]
    assert "state lost" in results[0].error and "injected prefill failure" in results[1].error
    assert results[2].token_ids == expected(engine, waiting)  # prefilled after the reset, unharmed


def test_failed_step_fails_its_requests_and_resets_the_engine():
    engine = fake(accept=1)
    real, calls = engine.dispatch_step, []

    def step(slot_ids, k, row_k=None):
        calls.append(1)
        if len(calls) == 3:
            engine.lost = True
            raise RuntimeError("injected step failure")
        return real(slot_ids, k, row_k)

    engine.dispatch_step = step
    sched = Scheduler(engine, FixedPolicy(3), config=SchedulerConfig(prefill_token_budget=CHUNK))
    reqs = requests()
    results = sched.generate_all(reqs)
    failed = [r for r in results if r.finish_reason is FinishReason.ERROR]
    assert failed and all("injected step failure" in r.error for r in failed)
    assert sched.engine_resets == 1 and not engine.lost
    good = [(q, r) for q, r in zip(reqs, results) if r.finish_reason is not FinishReason.ERROR]
    check_counting(engine, [r for _, r in good], [q for q, _ in good])
    assert len(failed) < len(reqs)  # requests that were waiting or prefilling ran after the reset


def test_failing_output_processing_fails_only_that_request():
    class Flaky:
        def __init__(self, inner):
            self.inner, self.special_token_ids, self.eos_token_ids = inner, inner.special_token_ids, ()

        def token_bytes(self, token_id):
            if token_id == 20:
                raise RuntimeError("no bytes for 20")
            return self.inner.token_bytes(token_id)

    sched = Scheduler(fake(), tokenizer=Flaky(ascii_tokenizer()))
    got = sched.generate_all([Request("bad", [17], SamplingParams(max_tokens=6)),
                              Request("good", [30], SamplingParams(max_tokens=6))])
    assert got[0].finish_reason is FinishReason.ERROR and "no bytes for 20" in got[0].error
    assert got[0].token_ids == (18, 19)  # what was delivered before the failure
    assert got[1].finish_reason is FinishReason.LENGTH and got[1].token_ids == (31, 32, 33, 34, 35, 36)


def test_invalid_requests_are_rejected_alone():
    engine = fake()
    sched = Scheduler(engine)
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
    check_counting(engine, [results[0], results[-1]], good)
    with pytest.raises(InvalidRequestError, match="empty prompt"):
        sched.submit(bad[0])
    sched.submit(good[0])
    with pytest.raises(InvalidRequestError, match="already running"):
        sched.submit(good[0])


@pytest.mark.parametrize("decision, error", [
    (Decision(k=5), "not in the compiled menu"),
    (Decision(k=3, row_k=(4,)), "must give each of 1 rows 0..3"),
    (Decision(k=3, row_k=(1, 1)), "must give each of 1 rows 0..3"),
    (Decision(k=3), "does not fit the cache"),
])
def test_bad_policy_decision_fails_loudly(decision, error):
    policy = RecordingPolicy(lambda view: decision)
    engine = fake()
    prompt = prompts((61,))[0]  # room for k <= 2
    result = Scheduler(engine, policy).generate_all([Request("x", prompt, SamplingParams(max_tokens=3))])[0]
    assert result.finish_reason is FinishReason.ERROR and error in result.error
    assert not [c for c in engine.calls if c.kind == "step"]


def test_bounded_queue():
    engine = fake()
    sched = Scheduler(engine, config=SchedulerConfig(max_queue=2))
    sched.submit(Request("q0", [5], SamplingParams(max_tokens=1)))
    sched.submit(Request("q1", [5], SamplingParams(max_tokens=1)))
    with pytest.raises(QueueFullError, match="full"):
        sched.submit(Request("q2", [5], SamplingParams(max_tokens=1)))
    sched.stop()  # not running: only refuses new work
    with pytest.raises(SchedulerClosedError):
        sched.submit(Request("q3", [5], SamplingParams(max_tokens=1)))
    # generate_all feeds a long list through a short queue
    small = Scheduler(engine, config=SchedulerConfig(max_queue=1))
    check_counting(engine, small.generate_all(requests()), requests())


# --- threads, timings, seeds, limits -----------------------------------------------------------------


def test_loop_thread_blocks_when_idle_and_stops_cleanly():
    sched = Scheduler(fake())
    sched.start()
    results, errors = [], []

    def client(i):
        try:
            results.append(sched.submit(Request(f"t{i}", [5, 6 + i], SamplingParams(max_tokens=5))).result(timeout=60))
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and sorted(r.token_ids for r in results) == [tuple(range(7 + i, 12 + i)) for i in range(6)]
    # every slot freed and nothing queued: the loop's next wait is the idle one (its iteration already counted)
    wait_until(lambda: sched.num_running == 0 and sched.num_live == 0, what="the scheduler to go idle")
    idle_from = sched.iterations
    time.sleep(0.3)  # an observation window: an idle loop must not iterate in it
    assert sched.iterations == idle_from  # asleep on the condition, not spinning
    running = sched.submit(Request("late", [5, 6], SamplingParams(max_tokens=50, ignore_eos=True)))
    sched.stop()
    assert not sched._thread.is_alive()
    assert running.result(timeout=1).finish_reason in (FinishReason.CANCELLED, FinishReason.LENGTH)
    with pytest.raises(SchedulerClosedError):
        sched.submit(Request("after", [5], SamplingParams()))


def test_stop_with_drain_finishes_live_requests():
    sched = Scheduler(fake())
    sched.start()
    handles = [sched.submit(Request(f"d{i}", [5, 6 + i], SamplingParams(max_tokens=8, ignore_eos=True)))
               for i in range(5)]
    sched.stop(drain=True, timeout=60)
    assert [h.result(timeout=0).finish_reason for h in handles] == [FinishReason.LENGTH] * 5


def test_timings_on_an_injected_clock():
    now = [100.0]
    policy = RecordingPolicy()
    sched = Scheduler(fake(), policy, clock=lambda: now[0], config=SchedulerConfig(overlap=False))
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


@pytest.mark.parametrize("overlap", [False, True])
def test_draft_catch_up_is_taken_out_of_the_step_period_it_ran_in(overlap):
    """A draft's lazy catch-up runs when the next speculating step is dispatched. Overlapped, that dispatch comes
    before the step in flight is read, so the catch-up lies in that step's period, not its own. A dispatch here
    takes 0.25 s plus 0.1 s per catch-up call (k alternates 0 and 3, so k = 3 steps after k = 0 steps catch up):
    what the policy observes must be whole dispatches, never a neighbour's catch-up added (0.45 s) or taken away
    (0.05 s). Synchronous, every step is observed at exactly 0.25 s."""
    now = [0.0]
    engine = fake(accept=1, tracks_context=True)
    real_step = engine.dispatch_step

    def step(*args, **kwargs):
        pending = real_step(*args, **kwargs)
        calls = pending.computed.catch_up_calls
        pending.computed = dataclasses.replace(pending.computed, catch_up_s=0.1 * calls)
        now[0] += 0.25 + 0.1 * calls
        return pending

    engine.dispatch_step = step
    policy = RecordingPolicy(choice=lambda view: FixedPolicy(3 * (len(policy.views) % 2)).choose(view))
    seen: list[StepStats] = []
    sched = Scheduler(engine, policy, clock=lambda: now[0], step_listeners=[seen.append],
                      config=SchedulerConfig(overlap=overlap))
    reqs = requests()
    check_counting(engine, sched.generate_all(reqs), reqs)
    caught_up = [s for s in seen if s.result.catch_up_calls]
    assert len(caught_up) >= 3 and len(seen) == sched.steps_run
    if overlap:  # a period holds the dispatches made in it: whole steps once the catch-up in it is out
        assert all(abs(e / 0.25 - round(e / 0.25)) < 1e-9 for e in policy.elapsed), policy.elapsed
        assert any(s.catch_up_s > 0 and s.decision.k == 0 for s in seen)  # the next step's catch-up, taken out
    else:
        assert all(e == pytest.approx(0.25) for e in policy.elapsed)
    placed, ran = sum(s.catch_up_s for s in seen), sum(0.1 * s.result.catch_up_calls for s in seen)
    # overlapped, a catch-up after a prompt chunk waited for the step in flight lies in no step's period
    assert placed == pytest.approx(ran) if not overlap else 0 < placed <= ran + 1e-9
    assert sched.seconds.decode_s == pytest.approx(sum(s.elapsed_s for s in seen))


def test_step_listeners_see_every_step_and_cannot_fail_requests():
    now = [0.0]
    engine = fake(accept=2)
    real_step = engine.dispatch_step

    def step(*args, **kwargs):
        now[0] += 0.25
        return real_step(*args, **kwargs)

    engine.dispatch_step = step
    seen: list[StepStats] = []

    def broken(stats):
        raise RuntimeError("listener bug")

    # synchronous: each step's time is its own, and every step's rows are delivered (no discarded extra step)
    sched = Scheduler(engine, FixedPolicy(3), clock=lambda: now[0], step_listeners=[seen.append],
                      config=SchedulerConfig(overlap=False))
    sched.add_step_listener(broken)
    reqs = requests()
    results = sched.generate_all(reqs)
    check_counting(engine, results, reqs)
    assert len(seen) == sched.steps_run > 0
    assert all(s.elapsed_s == 0.25 == s.executable_s for s in seen)
    # the loop's accounts: every step's time, every prompt's chunks (this clock moves only in steps)
    assert sched.seconds.decode_steps == sched.steps_run and sched.seconds.decode_s == 0.25 * sched.steps_run
    assert sched.seconds.prefill_chunks >= len(reqs) and sched.seconds.prefill_s == 0.0
    assert sum(int(s.result.accepted[:s.view.batch_size].sum()) for s in seen) == sum(r.accepted for r in results)
    assert all(s.decision.k == 3 and s.view.batch_size == len(s.result.proposed) for s in seen)


class _DeviceTimeline:
    """A device that runs what it is given in order, on the scheduler's clock: dispatching a step costs the host
    nothing, a step takes `step_s` of the device and a prompt chunk `chunk_s`; the host's clock moves only when it
    blocks, to when what it waits for is done (a step's `result()`; a chunk, which returns once it has run)."""

    def __init__(self, engine, step_s=0.25, chunk_s=1.0):
        self.now, self.free_at, self.step_s, self.chunk_s = 0.0, 0.0, step_s, chunk_s
        self.steps = 0
        real_step, real_prefill = engine.dispatch_step, engine.prefill_chunk

        def dispatch_step(*args, **kwargs):
            done_at = self.free_at = max(self.now, self.free_at) + self.step_s
            self.steps += 1
            return _TimedStep(self, real_step(*args, **kwargs), done_at)

        def prefill_chunk(*args, **kwargs):
            self.now = self.free_at = max(self.now, self.free_at) + self.chunk_s
            return real_prefill(*args, **kwargs)

        engine.dispatch_step, engine.prefill_chunk = dispatch_step, prefill_chunk

    def clock(self):
        return self.now


@dataclasses.dataclass
class _TimedStep:
    timeline: _DeviceTimeline
    inner: object
    done_at: float

    @property
    def catch_up_s(self) -> float:
        return self.inner.catch_up_s

    def result(self):
        self.timeline.now = max(self.timeline.now, self.done_at)
        return self.inner.result()


@pytest.mark.parametrize("overlap", [True, False])
def test_a_step_time_is_its_own_when_prompt_chunks_run_meanwhile(overlap):
    """On a device that runs steps (0.25 s) and prompt chunks (1 s) in order, with requests joining while others
    decode (so the overlapped loop runs chunks while a step is in flight), the policy observes every step at
    exactly its 0.25 s in both loops: a chunk neither absorbs the step's remaining time (which made steps look
    nearly free) nor adds its own; the loop's accounts split the time the same way."""
    engine = fake(accept=1)
    device = _DeviceTimeline(engine)
    policy = RecordingPolicy()
    sched = Scheduler(engine, policy, clock=device.clock, config=SchedulerConfig(max_running=2, overlap=overlap))
    reqs = requests()
    check_counting(engine, sched.generate_all(reqs), reqs)
    assert len(reqs) > 2 and len(policy.elapsed) == sched.steps_run == device.steps > 0
    assert policy.elapsed == pytest.approx([0.25] * device.steps)
    assert sched.seconds.decode_s == pytest.approx(0.25 * device.steps)
    assert sched.seconds.prefill_s == pytest.approx(1.0 * sched.seconds.prefill_chunks)


@pytest.mark.parametrize("overlap", [True, False])
def test_the_loop_accounts_the_policys_own_time(overlap):
    """`LoopSeconds.policy_s` is the time spent in the policy's calls, whichever loop: a policy whose `choose`
    takes 0.01 s and `observe` 0.02 s on the clock is accounted 0.03 s a step, and nothing else is."""
    engine = fake(accept=1)
    device = _DeviceTimeline(engine)

    class Slow(RecordingPolicy):
        def choose(self, view):
            device.now += 0.01
            return super().choose(view)

        def observe(self, view, decision, result, elapsed_s):
            device.now += 0.02
            super().observe(view, decision, result, elapsed_s)

    sched = Scheduler(engine, Slow(), clock=device.clock, config=SchedulerConfig(max_running=2, overlap=overlap))
    reqs = requests()
    check_counting(engine, sched.generate_all(reqs), reqs)
    assert sched.steps_run > 0
    assert sched.seconds.policy_s == pytest.approx(0.03 * sched.steps_run)


def test_seeds_of_sampled_requests():
    engine = fake()
    seeds = {}
    real = engine.prefill_chunk

    def prefill_chunk(slot, tokens, start, is_last, params, seed, **kw):
        seeds[slot] = seed
        return real(slot, tokens, start, is_last, params, seed, **kw)

    engine.prefill_chunk = prefill_chunk
    sched = Scheduler(engine, seed_source=lambda: 1234)
    sampled = SamplingParams(temperature=1.0, max_tokens=2)
    got = sched.generate_all([Request("drawn", [5], sampled), Request("given", [5], SamplingParams(seed=7)),
                              Request("greedy", [5], SamplingParams(max_tokens=2))])
    assert [r.seed for r in got] == [1234, 7, 0]
    assert seeds == {0: 1234, 1: 7, 2: 0}  # the engine got them


def test_max_running_caps_concurrency():
    engine = fake()
    policy = RecordingPolicy()
    sched = Scheduler(engine, policy, config=SchedulerConfig(max_running=1))
    check_counting(engine, sched.generate_all(requests()[:3]), requests()[:3])
    assert {v.batch_size for v in policy.views} == {1}
    with pytest.raises(ValueError, match="exceeds the largest batch bucket"):
        Scheduler(engine, config=SchedulerConfig(max_running=5))


def test_abandoned_iteration_cancels_and_frees_slots():
    engine = fake()
    sched = Scheduler(engine)
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    gen = sched.iter_completed([Request(f"a{i}", [5, 6 + i], params) for i in range(8)])
    first = next(gen)
    assert first.finish_reason is FinishReason.LENGTH
    gen.close()
    assert sched.num_live == 0 and not sched._slots
    assert not any(engine.length(s) for s in range(engine.menu.num_slots))


# --- end to end on the real tiny engine --------------------------------------------------------------


def _engine(model, proposer, batch_buckets, k_menu) -> Engine:
    engine = Engine(model, proposer, _menu(batch_buckets, k_menu))
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


def real_requests() -> list[Request]:
    return requests(high=64)


@pytest.fixture(scope="module")
def reference(plain) -> dict[str, RequestResult]:
    """One request at a time, plain decoding."""
    sched = Scheduler(plain)
    return {r.request_id: sched.generate_all([r])[0] for r in real_requests()}


def same_outputs(results, reference):
    for r in results:
        ref = reference[r.request_id]
        assert (r.token_ids, r.finish_reason) == (ref.token_ids, ref.finish_reason), r.request_id


def test_reference_is_sane(reference):
    assert reference["long"].token_ids and len(reference["long"].token_ids) == 4
    assert reference["long"].finish_reason is FinishReason.LENGTH
    reasons = {r.finish_reason for r in reference.values()}
    assert reasons <= {FinishReason.LENGTH, FinishReason.EOS}


@pytest.mark.parametrize("which", ["plain", "ngram", "draft"])
def test_batched_greedy_matches_one_at_a_time(which, request, reference):
    engine = request.getfixturevalue(which)
    policy = NoSpeculation() if which == "plain" else FixedPolicy(3)
    results = Scheduler(engine, policy).generate_all(real_requests())
    same_outputs(results, reference)
    if which != "plain":
        assert sum(r.accepted for r in results) > 0
        assert any(s.k == 3 for r in results for s in r.steps)
    for r in results:
        assert all(s.accepted <= s.proposed <= s.k for s in r.steps)


def test_real_failed_step_loses_the_state_and_resets_the_engine(plain, monkeypatch, reference):
    real, calls = plain.dispatch_step, []

    def step(slot_ids, k, row_k=None):
        calls.append(1)
        if len(calls) == 3:  # lose the donated state, as a failure inside the compiled call would
            for leaf in jax.tree.leaves(plain.state):
                leaf.delete()
            raise RuntimeError("injected step failure")
        return real(slot_ids, k, row_k)

    monkeypatch.setattr(plain, "dispatch_step", step)
    sched = Scheduler(plain, config=SchedulerConfig(prefill_token_budget=CHUNK))
    reqs = real_requests()
    results = {r.request_id: r for r in sched.generate_all(reqs)}
    failed = [r for r in results.values() if r.finish_reason is FinishReason.ERROR]
    assert failed and all("injected step failure" in r.error for r in failed)
    assert sched.engine_resets == 1 and not plain.state_lost()
    same_outputs([r for r in results.values() if r.finish_reason is not FinishReason.ERROR], reference)
    assert len(failed) < len(reqs)  # requests that were waiting or prefilling ran after the reset
