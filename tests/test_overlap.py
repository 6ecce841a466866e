"""The overlapped loop (docs/design.md, "The overlapped loop"): step n+1 is dispatched before step n is read,
and the output is the synchronous loop's, token for token, with nothing left behind in the engine.

Checked on the fake engine (counting arithmetic, every acceptance) and on the tiny model (greedy and seeded
sampling, stop strings and stop ids, max_tokens, the cache limit, a cancel)."""

from __future__ import annotations

import pytest

from jaxspec.engine.engine import Engine
from jaxspec.engine.fake import FakeEngine
from jaxspec.menu import Menu
from jaxspec.policy.base import Decision, Policy, row_caps
from jaxspec.policy.fixed import FixedPolicy, NoSpeculation
from jaxspec.scheduling.requests import FinishReason, Request
from jaxspec.scheduling.scheduler import Scheduler, SchedulerConfig
from jaxspec.speculation.proposers.draft_model import DraftModelProposer
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


@pytest.mark.parametrize("k, accept", [(0, 0), (3, 2)])
def test_settle_leaves_nothing_in_flight_and_the_output_unchanged(k, accept):
    """`Scheduler.settle` between steps (the bench's interleave pauses a scheduler so) reads the step in flight
    and dispatches nothing; the next step starts from read counts, and the tokens are the synchronous loop's."""
    outputs = {}
    for settle_every in (None, 3):
        engine = FakeEngine(MENU, vocab_size=64, eos_token_ids=(1,), accept=accept)
        engine.warmup()
        sched = Scheduler(engine, FixedPolicy(k), config=SYNC if settle_every is None else OVERLAP)
        handles = [sched.submit(r, stream=False) for r in fake_requests()]
        settled = steps = 0
        while not all(h.done() for h in handles):
            sched.step_once()
            steps += 1
            if settle_every and steps % settle_every == 0:
                settled += sched.settle()
                assert engine.in_flight() == 0 and sched.settle() is False  # nothing left to read
        outputs[settle_every] = [(h.result().token_ids, h.result().finish_reason) for h in handles]
        assert settle_every is None or settled >= 1  # it read a step in flight (at k = 0, most turns)
        no_leaks(engine, sched)
    assert outputs[3] == outputs[None]


class BatchProbe:
    """Records each dispatched step's slots and per-row caps."""

    def __init__(self, engine):
        self.steps: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
        real = engine.dispatch_step

        def dispatch_step(slots, k, row_k=None, **kwargs):
            self.steps.append((tuple(slots), tuple(row_k) if row_k is not None else (k,) * len(slots)))
            return real(slots, k, row_k, **kwargs)

        engine.dispatch_step = dispatch_step

    @property
    def rows(self) -> list[int]:
        return [len(slots) for slots, _ in self.steps]


class BatchDependentFixed(FixedPolicy):
    """fixed:K standing in for a policy whose choice depends on the live batch (goodput): no exact caps."""

    def exact_caps_k(self, k_menu: tuple[int, ...]) -> int:
        return 0


# a 10-token request (slot 0) beside a 24-token one (slot 1), k = 3, every proposal accepted
SYNC_STEPS = [((0, 1), (3, 3)), ((0, 1), (3, 3)), ((0, 1), (0, 3)), ((1,), (3,)), ((1,), (3,)), ((1,), (2,))]


@pytest.mark.parametrize("policy, overlapped_steps", [
    # fixed:K keeps the synchronous loop's caps: the short row sits out the step its bound would lower
    (FixedPolicy(3), SYNC_STEPS[:2] + [((1,), (3,)), ((0, 1), (0, 3))] + SYNC_STEPS[4:]),
    # a batch-dependent policy: the short row joins it with its cap from the bound (1 + 4 + 4 of 10 committed)
    (BatchDependentFixed(3), SYNC_STEPS),
])
def test_a_row_in_flight_is_capped_by_what_the_step_in_flight_may_commit(policy, overlapped_steps):
    """Every proposal accepted: no row ever verifies more proposals than the tokens it may still want after its
    bonus token, whatever the step in flight commits, and the output is the synchronous loop's. Overlapped, every
    step but the first and the last is dispatched with the one before it unread; the last waits for it, because
    its one row's cap would be lowered by the bound (it reads the counts instead)."""
    requests = [Request("short", [4], SamplingParams(max_tokens=10, ignore_eos=True)),
                Request("long", [5], SamplingParams(max_tokens=24, ignore_eos=True))]
    outputs = {}
    for config in (SYNC, OVERLAP):
        engine = FakeEngine(MENU, vocab_size=64, accept=5)
        engine.warmup()
        in_flight, batches = InFlightProbe(engine), BatchProbe(engine)
        outputs[config.overlap] = Scheduler(engine, policy, config=config).generate_all(requests)
        committed, wanted = {0: 1, 1: 1}, {0: 10, 1: 24}  # the prefill's token each
        for slots, caps in batches.steps:
            for slot, cap in zip(slots, caps):
                assert cap <= max(0, wanted[slot] - committed[slot] - 1)
                committed[slot] += cap + 1  # every proposal accepted
        assert committed == wanted
        assert batches.steps == (overlapped_steps if config.overlap else SYNC_STEPS)
        assert in_flight.seen == ([0, 1, 1, 1, 1, 0] if config.overlap else [0] * 6)
    assert [r.token_ids for r in outputs[True]] == [r.token_ids for r in outputs[False]]


@pytest.mark.parametrize("policy", [FixedPolicy(0), BatchDependentFixed(0)])
def test_a_policy_at_k0_keeps_its_overlap_to_the_requests_ends(policy):
    """On a menu up to k = 3, rows a few tokens from their end would have caps below 3 under the bound; a policy
    running k = 0 loses nothing by that, so every step but the first is dispatched with the one before it unread
    (holding them back lost the overlap near every request's end, as `none`, on a menu of k = 0 alone, never
    did), and the tokens are the synchronous loop's."""
    requests = [Request("a", [4], SamplingParams(max_tokens=6, ignore_eos=True)),
                Request("b", [5], SamplingParams(max_tokens=9, ignore_eos=True))]
    outputs = {}
    for config in (SYNC, OVERLAP):
        engine = FakeEngine(MENU, vocab_size=64, accept=5)
        engine.warmup()
        probe = InFlightProbe(engine)
        outputs[config.overlap] = Scheduler(engine, policy, config=config).generate_all(requests)
        assert probe.seen == ([0] + [1] * (len(probe.seen) - 1) if config.overlap else [0] * len(probe.seen))
    assert [r.token_ids for r in outputs[True]] == [r.token_ids for r in outputs[False]]


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


class Alternating(Policy):
    """Runs of k = 3 and stretches of k = 0 in a fixed pattern of its calls (as goodput alternates), each row
    capped by its room."""

    name = "alternating"
    PATTERN = (3, 3, 0, 3, 3, 3, 0, 0, 3, 0)

    def __init__(self):
        self.calls = 0

    def choose(self, view):
        k = self.PATTERN[self.calls % len(self.PATTERN)]
        self.calls += 1
        return Decision(k=k, row_k=row_caps(k, view))


@pytest.mark.parametrize("make_policy", [lambda: FixedPolicy(3), Alternating], ids=["fixed:3", "alternating"])
def test_a_draft_speculates_behind_a_speculating_step_without_reading_it(tiny_model, make_policy):
    """With the target as its own draft at temperature 0 every proposal is accepted when the draft is in step
    with the context, so one rejected proposal would show a catch-up skipped or run on a guessed length. In
    the overlapped loop a speculating step behind one that ran the draft reads nothing first (the engine reads
    the steps in flight only when a row's last step ran k = 0 or a catch-up is to run), the tokens are plain
    decoding's, and every proposal is accepted, across runs of k = 3 and stretches of k = 0."""
    engine = Engine(tiny_model, DraftModelProposer(tiny_model), MENU)
    engine.warmup(progress=False)
    reads = []
    real_settle = engine.settle
    engine.settle = lambda: (reads.append(1), real_settle())[1]  # a read of the steps in flight before a step
    steps = []
    reqs = [Request(f"r{i}", [3 + i, 14, 15, 9, 26, 5 + i], SamplingParams(max_tokens=30 + 2 * i, ignore_eos=True))
            for i in range(8)]  # 4 at a time: the others join as they finish (their prompts caught up)
    plain = Scheduler(engine, NoSpeculation(), config=SYNC).generate_all(reqs)
    sched = Scheduler(engine, make_policy(), config=SchedulerConfig(max_running=4, overlap=True),
                      step_listeners=[steps.append])
    results = sched.generate_all(reqs)
    assert [r.token_ids for r in results] == [r.token_ids for r in plain]
    speculating = [s for s in steps if int(s.result.proposed.sum()) > 0]
    assert len(speculating) > 5
    assert all((s.result.accepted == s.result.proposed).all() for s in speculating)
    # a read before a speculating step only where a row's draft had fallen behind or a prompt was caught up
    assert len(reads) < len(speculating) / 2
    # behind a step that ran the draft (k_run > 0) over all its rows, the policy is shown no pending catch-up
    # (not one guessed from the length bound of the step in flight)
    behind = [b for a, b in zip(steps, steps[1:])
              if a.result.tokens.shape[1] > 1 and set(b.view.request_ids) <= set(a.view.request_ids)]
    assert len(behind) > 10 and all(not any(b.view.catch_up_calls) for b in behind)
    no_leaks(engine, sched)


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
