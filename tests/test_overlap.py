"""The overlapped loop (docs/design.md, "The overlapped loop"): step n+1 is dispatched before step n is read,
and the output is the synchronous loop's, token for token, with nothing left behind in the engine.

Checked on the fake engine (counting arithmetic, every acceptance) and on the tiny model (greedy and seeded
sampling, stop strings and stop ids, max_tokens, the cache limit, a cancel)."""

from __future__ import annotations

import pytest

from jaxspec.engine.engine import Engine
from jaxspec.engine.fake import FakeEngine
from jaxspec.menu import Menu
from jaxspec.policy.fixed import FixedPolicy, NoSpeculation
from jaxspec.scheduling.requests import FinishReason, Request
from jaxspec.scheduling.scheduler import Scheduler, SchedulerConfig
from jaxspec.speculation.proposers.prompt_lookup import PromptLookupProposer
from jaxspec.types import SamplingParams
from tests.fake_tokenizer import ascii_tokenizer

MAX_LEN = 64
MENU = Menu(num_slots=4, max_len=MAX_LEN, batch_buckets=(1, 4), k_menu=(0, 3), window_buckets=(32, MAX_LEN),
            prefill_buckets=(16,))
SYNC, OVERLAP = SchedulerConfig(overlap=False), SchedulerConfig(overlap=True)


class InFlightProbe:
    """Wraps an engine's dispatch_step to record how many steps were in flight (dispatched, not read) at each
    dispatch, from the steps' own results: a step is in flight until its `result()` was called."""

    def __init__(self, engine):
        self.unread: list[object] = []
        self.seen: list[int] = []
        real = engine.dispatch_step

        def dispatch_step(*args, **kwargs):
            self.unread = [p for p in self.unread if not p.read]
            self.seen.append(len(self.unread))
            pending = Probed(real(*args, **kwargs))
            self.unread.append(pending)
            return pending

        engine.dispatch_step = dispatch_step


class Probed:
    def __init__(self, pending):
        self.pending, self.read = pending, False
        self.catch_up_s = pending.catch_up_s

    def result(self):
        self.read = True
        return self.pending.result()


def no_leaks(engine, sched: Scheduler) -> None:
    assert sched.num_running == 0 and sched.num_live == 0
    assert all(engine.length(slot) == 0 for slot in range(engine.menu.num_slots))  # freed, no unread bound


# --- the fake engine ---------------------------------------------------------------------------------------


def fake_requests() -> list[Request]:
    """Ends by max_tokens, by EOS (id 1: 62 -> 63 -> 0 -> 1), by a stop id, and by the cache."""
    return [
        Request("max", [5, 6, 7], SamplingParams(max_tokens=13, ignore_eos=True)),
        Request("eos", [9, 60], SamplingParams(max_tokens=40)),
        Request("stop", [20] * 5, SamplingParams(max_tokens=40, stop_token_ids=(29,))),
        Request("cache", [30] * 58, SamplingParams(max_tokens=30, ignore_eos=True)),
        Request("late", [11, 12], SamplingParams(max_tokens=7, ignore_eos=True)),  # waits for a freed slot
        Request("one", [40], SamplingParams(max_tokens=1, ignore_eos=True)),
    ]


@pytest.mark.parametrize("k, accept", [(0, 0), (3, 0), (3, 2), (3, 5)])
def test_fake_engine_overlapped_equals_synchronous(k, accept):
    outputs = {}
    for config in (SYNC, OVERLAP):
        engine = FakeEngine(MENU, vocab_size=64, eos_token_ids=(1,), accept=accept)
        engine.warmup()
        probe = InFlightProbe(engine)
        sched = Scheduler(engine, FixedPolicy(k), config=config)
        results = sched.generate_all(fake_requests())
        outputs[config.overlap] = [(r.token_ids, r.finish_reason) for r in results]
        if config.overlap:  # dispatched with the step before it unread, unless a prompt chunk waited for that one
            # first (Scheduler._await_in_flight); at k = 0 no row sits a step out, so steps between chunks overlap
            assert max(probe.seen) <= 1 and (k > 0 or max(probe.seen) == 1)
        else:
            assert max(probe.seen) == 0
        no_leaks(engine, sched)
        assert engine.in_flight() == 0
    assert outputs[True] == outputs[False]
    reasons = [reason for _, reason in outputs[True]]
    assert reasons == [FinishReason.LENGTH, FinishReason.EOS, FinishReason.STOP, FinishReason.LENGTH,
                       FinishReason.LENGTH, FinishReason.LENGTH]


class BatchProbe:
    """Records each dispatched step's rows and per-row caps."""

    def __init__(self, engine):
        self.rows: list[int] = []
        self.caps: list[tuple[int, ...]] = []
        real = engine.dispatch_step

        def dispatch_step(slots, k, row_k=None, **kwargs):
            self.rows.append(len(slots))
            self.caps.append(tuple(row_k) if row_k is not None else (k,) * len(slots))
            return real(slots, k, row_k, **kwargs)

        engine.dispatch_step = dispatch_step


def test_a_row_near_its_end_joins_every_step_whatever_the_menu():
    """Overlapped, a row in the step in flight joins the next step while it still wants a token after that step's
    most tokens: at k = 0 a menu compiled up to k = 3 runs the same steps, each holding every running row, as a
    menu of k = 0 alone (no row sits out a step for the menu's largest k)."""
    lengths = (12, 18, 24, 30)  # staggered ends: the others still run while one nears its end
    requests = [Request(f"r{i}", [4 + i], SamplingParams(max_tokens=n, ignore_eos=True))
                for i, n in enumerate(lengths)]
    runs = {}
    for k_menu in ((0,), (0, 3)):
        engine = FakeEngine(MENU.with_k_menu(k_menu), vocab_size=64)
        engine.warmup()
        probe = BatchProbe(engine)
        sched = Scheduler(engine, FixedPolicy(0), config=OVERLAP)
        results = sched.generate_all(requests)
        assert [r.token_ids for r in results] == [tuple(engine.expected_output(r.prompt_token_ids, n))
                                                  for r, n in zip(requests, lengths)]
        runs[k_menu] = probe.rows
    # one step per token after the prefill's, each holding every request not yet finished
    assert runs[(0,)] == [4] * 11 + [3] * 6 + [2] * 6 + [1] * 6
    assert runs[(0, 3)] == runs[(0,)]


class BatchDependentFixed(FixedPolicy):
    """fixed:K standing in for a policy whose choice depends on the live batch (goodput): no exact caps."""

    def exact_caps_k(self, k_menu: tuple[int, ...]) -> int:
        return 0


@pytest.mark.parametrize("policy, in_flight_at_dispatch", [(FixedPolicy(3), [0, 1, 0]),
                                                           (BatchDependentFixed(3), [0, 1, 1])])
def test_a_row_in_flight_is_capped_by_what_the_step_in_flight_may_commit(policy, in_flight_at_dispatch):
    """At k = 3 with every proposal accepted, a 10-token request: no row ever verifies more proposals than the
    tokens it may still want after its bonus token, whatever the step in flight commits, and the output is the
    synchronous loop's. Under fixed:K (exact caps) the row sits out the step whose cap the step in flight could
    lower, as the synchronous loop runs it; under a batch-dependent policy it joins it with its cap from the
    bound (0: 1 + 4 + 4 tokens may be committed by then)."""
    request = Request("r", [4], SamplingParams(max_tokens=10, ignore_eos=True))
    outputs = {}
    for config in (SYNC, OVERLAP):
        engine = FakeEngine(MENU, vocab_size=64, accept=5)
        engine.warmup()
        in_flight, batches = InFlightProbe(engine), BatchProbe(engine)
        outputs[config.overlap] = Scheduler(engine, policy, config=config).generate_all([request])[0]
        caps = [c[0] for c in batches.caps]
        committed = 1  # the prefill's token
        for cap in caps:  # every proposal accepted: a step commits cap + 1
            assert cap <= max(0, 10 - committed - 1)
            committed += cap + 1
        assert caps == [3, 3, 0]
        assert in_flight.seen == (in_flight_at_dispatch if config.overlap else [0, 0, 0])
    assert outputs[True].token_ids == outputs[False].token_ids
    assert len(outputs[True].token_ids) == 10


def test_a_row_finishing_in_step_n_has_its_step_n1_tokens_discarded():
    """EOS in step n: step n+1 (dispatched already) ran for the row too; none of its tokens reach the request,
    the policy forgets the request, and the slot serves the next request from scratch."""
    engine = FakeEngine(MENU.with_k_menu((0,)), vocab_size=64, eos_token_ids=(1,))
    engine.warmup()
    forgotten = []

    class Recording(NoSpeculation):
        def forget(self, request_id):
            forgotten.append(request_id)

    sched = Scheduler(engine, Recording(), config=SchedulerConfig(max_running=1))
    first, second = sched.generate_all([Request("a", [62], SamplingParams(max_tokens=20)),
                                        Request("b", [10], SamplingParams(max_tokens=4))])
    assert first.token_ids == (63, 0, 1) and first.finish_reason is FinishReason.EOS
    assert second.token_ids == (11, 12, 13, 14)
    assert sched.steps_run == 2 + 1 + 3  # a's two steps, the extra one dispatched before its EOS was read, b's
    assert forgotten.count("a") == 2  # when it finished, and again after the extra step was observed
    no_leaks(engine, sched)


def test_cancel_with_a_step_in_flight_frees_the_slot():
    engine = FakeEngine(MENU, vocab_size=64, accept=1)
    engine.warmup()
    sched = Scheduler(engine, FixedPolicy(3), config=SchedulerConfig(max_running=2))
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    handles = [sched.submit(Request(f"c{i}", [4 + i], params)) for i in range(3)]
    for _ in range(3):
        sched.step_once()
    assert engine.in_flight() == 1
    assert sched.cancel("c0")
    for _ in range(200):
        if all(h.done() for h in handles):
            break
        sched.step_once()
    c0, c1, c2 = (h.result() for h in handles)
    assert c0.finish_reason is FinishReason.CANCELLED
    assert c0.token_ids == tuple(engine.expected_output([4], len(c0.token_ids)))  # a prefix, nothing after it
    assert c1.token_ids == tuple(engine.expected_output([5], 30))
    assert c2.token_ids == tuple(engine.expected_output([6], 30))  # took c0's slot after the cancel
    sched.step_once()  # reads the step still in flight, if any
    no_leaks(engine, sched)
    assert engine.in_flight() == 0


# --- the tiny model ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ngram_engine(tiny_model):
    engine = Engine(tiny_model, PromptLookupProposer(), MENU)
    engine.warmup(progress=False)
    return engine


def tiny_requests(stop_text: str | None = None, stop_id: int | None = None) -> list[Request]:
    """Greedy and seeded-sampling rows, max_tokens and the cache limit; stops where given."""
    repetitive = [7, 8, 9, 10, 11, 12] * 4
    return [
        Request("greedy", repetitive, SamplingParams(max_tokens=20, ignore_eos=True)),
        Request("seeded", [3, 14, 15, 9, 26], SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_tokens=18,
                                                            ignore_eos=True)),
        Request("stop-text", repetitive[:10], SamplingParams(max_tokens=24, ignore_eos=True,
                                                            stop_strings=(stop_text,) if stop_text else ())),
        Request("stop-id", [21, 22, 23, 21, 22], SamplingParams(temperature=1.0, seed=3, max_tokens=24,
                                                               ignore_eos=True,
                                                               stop_token_ids=(stop_id,) if stop_id else ())),
        Request("cache", [5] * 56, SamplingParams(max_tokens=30, ignore_eos=True)),  # capped at 8 by the cache
        Request("late", repetitive[:7], SamplingParams(temperature=0.7, seed=11, max_tokens=9, ignore_eos=True)),
    ]


@pytest.mark.parametrize("policy", ["none", "fixed:3"])
def test_tiny_model_overlapped_equals_synchronous(ngram_engine, policy):
    tokenizer = ascii_tokenizer()
    make = (lambda: NoSpeculation()) if policy == "none" else (lambda: FixedPolicy(3))
    plain = Scheduler(ngram_engine, make(), tokenizer, SYNC).generate_all(tiny_requests())
    # stops that cut two of the requests short, taken from their unstopped output
    stop_text = tokenizer.decode(list(plain[2].token_ids[5:7]))
    stop_id = plain[3].token_ids[6]
    reqs = tiny_requests(stop_text, stop_id)
    outputs = {}
    for config in (SYNC, OVERLAP):
        sched = Scheduler(ngram_engine, make(), tokenizer, config)
        results = sched.generate_all(reqs)
        outputs[config.overlap] = [(r.token_ids, r.text, r.finish_reason) for r in results]
        no_leaks(ngram_engine, sched)
    assert outputs[True] == outputs[False]
    assert outputs[True][2][2] is FinishReason.STOP and outputs[True][3][2] is FinishReason.STOP
    assert len(outputs[True][4][0]) == MAX_LEN - 56


def test_tiny_model_cancel_leaves_the_others_unchanged(ngram_engine):
    reqs = tiny_requests()
    reference = Scheduler(ngram_engine, FixedPolicy(3), config=SYNC).generate_all(reqs)
    sched = Scheduler(ngram_engine, FixedPolicy(3), config=OVERLAP)
    handles = [sched.submit(r, stream=False) for r in reqs]
    while sched.steps_run < 2:
        sched.step_once()
    assert sched.cancel("greedy")  # mid-decode, a step in flight
    for _ in range(500):
        if all(h.done() for h in handles):
            break
        sched.step_once()
    results = [h.result() for h in handles]
    cancelled = results[0]
    assert cancelled.finish_reason is FinishReason.CANCELLED
    assert reference[0].token_ids[:len(cancelled.token_ids)] == cancelled.token_ids
    assert [r.token_ids for r in results[1:]] == [r.token_ids for r in reference[1:]]
    sched.step_once()
    no_leaks(ngram_engine, sched)


def test_no_overlap_flag_reaches_every_engine_command():
    import argparse

    from jaxspec.engine.args import EngineArgs
    from jaxspec.serving.serve_config import ServeConfig

    parser = argparse.ArgumentParser()
    EngineArgs.add_arguments(parser)
    assert EngineArgs.from_namespace(parser.parse_args([])).no_overlap is False
    assert EngineArgs.from_namespace(parser.parse_args(["--no-overlap"])).no_overlap is True
    serve = argparse.ArgumentParser()
    EngineArgs.add_arguments(serve, overrides=True)  # serve: an unset flag leaves the config file's value
    assert EngineArgs.given(serve.parse_args([])) == {}
    assert EngineArgs.given(serve.parse_args(["--no-overlap"])) == {"no_overlap": True}
    assert ServeConfig(no_overlap=True).engine_args().no_overlap is True
