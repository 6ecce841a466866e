"""Poisson arrivals and the open-loop driver's latency accounting (fake clock, stub scheduler)."""

import types

import numpy as np
import pytest

from jaxspec.bench.loadgen import poisson_arrivals, run_closed_loop, run_open_loop, summarize
from jaxspec.scheduling.requests import FinishReason


def test_poisson_arrival_statistics():
    rate, n = 5.0, 20000
    t = poisson_arrivals(rate, n, seed=3)
    gaps = np.diff(np.concatenate([[0.0], t]))
    assert np.all(gaps > 0) and np.all(np.diff(t) > 0)
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)  # exponential: CV = 1
    assert np.mean(gaps < 1 / rate) == pytest.approx(1 - np.exp(-1), abs=0.015)
    counts = np.histogram(t, bins=np.arange(0, t[-1], 1.0))[0]  # Poisson counts: var = mean = rate
    assert counts.mean() == pytest.approx(rate, rel=0.05) and counts.var() == pytest.approx(rate, rel=0.15)
    assert np.array_equal(poisson_arrivals(rate, 10, seed=3), t[:10])
    with pytest.raises(ValueError):
        poisson_arrivals(0.0, 3)


class FakeClock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t

    def sleep(self, s):
        self.t += s


class StubScheduler:
    """Serves one request at a time; each step takes 0.1 s and emits one token; 3 tokens/request."""

    def __init__(self, clock):
        self.clock, self.queue, self.num_running = clock, [], 0

    def submit(self, request, stream=False):
        h = types.SimpleNamespace(request=request, arrival=self.clock(), left=3, first=None, res=None)
        h.done = lambda h=h: h.res is not None
        h.result = lambda h=h: h.res
        self.queue.append(h)
        return h

    def work(self, seconds):
        self.clock.sleep(seconds)

    def step_once(self):
        if not self.queue:
            return False
        self.work(0.1)
        h = self.queue[0]
        h.left -= 1
        h.first = h.first or self.clock()
        if h.left == 0:
            self.queue.pop(0)
            now = self.clock()
            h.res = types.SimpleNamespace(
                request_id=h.request.request_id, token_ids=(1, 2, 3), steps=(), proposed=0, accepted=0,
                finish_reason=FinishReason.LENGTH, error=None,
                timings=types.SimpleNamespace(total_s=now - h.arrival, ttft_s=h.first - h.arrival,
                                              tpot_s=(now - h.first) / 2))
        return True


def test_open_loop_latency_counts_from_the_scheduled_arrival():
    clock = FakeClock()
    reqs = [types.SimpleNamespace(request_id=f"r{i}") for i in range(3)]
    # r1 arrives at 0.05 while r0's first step (0..0.1) runs: it is submitted at 0.1, queued behind r0
    samples = run_open_loop(StubScheduler(clock), reqs, [0.0, 0.05, 10.0], clock=clock, sleep=clock.sleep)
    lat = {s.request_id: s.latency_s for s in samples}
    assert lat["r0"] == pytest.approx(0.3)
    assert lat["r1"] == pytest.approx(0.6 - 0.05)  # finishes at 0.6, arrived at 0.05 (not 0.1)
    assert lat["r2"] == pytest.approx(0.3)  # the driver slept until 10.0, no queueing
    summary = summarize(samples)
    assert summary["requests"] == 3 and summary["output_tokens"] == 9
    assert summary["mean_latency_s"] == pytest.approx((0.3 + 0.55 + 0.3) / 3)
    assert summary["tokens_per_s"] == pytest.approx(9 / 10.3)


def test_closed_loop_keeps_concurrency():
    clock = FakeClock()
    sched = StubScheduler(clock)
    reqs = [types.SimpleNamespace(request_id=f"r{i}") for i in range(4)]
    samples = run_closed_loop(sched, reqs, concurrency=2, clock=clock)
    assert sorted(s.request_id for s in samples) == ["r0", "r1", "r2", "r3"]
    assert max(s.finish_s for s in samples) == pytest.approx(1.2)  # 12 single-token steps


def test_closed_loop_runs_each_session_in_order_on_one_client():
    """Sessions [a, a, b, b] at concurrency 2: a's second request is submitted when its first finished (not
    alongside it, as without sessions), and each session keeps its order."""
    reqs = [types.SimpleNamespace(request_id=f"r{i}") for i in range(4)]
    clock = FakeClock()
    by_id = {s.request_id: s for s in run_closed_loop(StubScheduler(clock), reqs, concurrency=2,
                                                      sessions=["a", "a", "b", "b"], clock=clock)}
    assert by_id["r0"].arrival_s == by_id["r2"].arrival_s == 0.0  # the two clients' first requests
    assert by_id["r1"].arrival_s == pytest.approx(by_id["r0"].finish_s)
    assert by_id["r3"].arrival_s == pytest.approx(by_id["r2"].finish_s)
    clock = FakeClock()
    plain = {s.request_id: s for s in run_closed_loop(StubScheduler(clock), reqs, concurrency=2, clock=clock)}
    assert plain["r1"].arrival_s == 0.0  # without sessions r1 is the second client's first request
    with pytest.raises(ValueError, match="session ids"):
        run_closed_loop(StubScheduler(FakeClock()), reqs, concurrency=2, sessions=["a"])


def test_k0_pricing_counts_decisions_that_overpriced_plain_decoding():
    from benchmarks.goodput_pricing import k0_pricing

    steps = [{"bucket": 1, "batch": 1, "k": 0, "seconds": 0.03, "predicted_goodput": {"0": 1 / 0.03}}] * 3
    steps += [{"bucket": 4, "batch": 2, "k": 0, "seconds": 0.05, "predicted_goodput": {"0": 2 / 0.05}}]
    steps += [{"bucket": 1, "batch": 1, "k": 4, "seconds": 0.06, "predicted_goodput": {"0": 1 / 0.09, "4": 30.0}}]
    got = k0_pricing(steps, over=1.5)
    assert got == {"decisions": 5, "mispriced": 1, "worst": 3.0}  # 0.09 s priced against 0.03 s observed


class MachineClock(FakeClock):
    """A wall clock whose machine runs a step `slow` times slower between `slow_from` and `slow_to` (a neighbour's
    job); `work(s)` advances it by s seconds of work at the current speed."""

    def __init__(self, slow_from=float("inf"), slow_to=float("inf"), slow=1.0):
        super().__init__()
        self.slow_from, self.slow_to, self.slow = slow_from, slow_to, slow

    def work(self, s):
        self.t += s * (self.slow if self.slow_from <= self.t < self.slow_to else 1.0)


class SliceStub(StubScheduler):
    """StubScheduler on a run's own clock, its steps costing `step_s` of the machine's time; logs its steps and
    settles under `name`."""

    def __init__(self, clock, machine, name, log, step_s=0.1):
        super().__init__(clock)
        self.machine, self.name, self.log, self.step_s = machine, name, log, step_s

    def work(self, seconds):  # StubScheduler's step is 0.1 s of work: here step_s of the machine's
        self.machine.work(seconds / 0.1 * self.step_s)

    def step_once(self):
        if self.queue:
            self.log.append(self.name)
        return super().step_once()

    def settle(self):
        self.log.append(f"settle {self.name}")
        return False


def _interleave(machine, slice_s, step_s=(0.1, 0.1), arrivals=None, n=4):
    from jaxspec.bench.loadgen import Interleaved, SliceClock, closed_loop, open_loop, run_interleaved

    log, runs, samples = [], [], []
    for name, step in zip("ab", step_s, strict=True):
        clock, out = SliceClock(base=machine), []
        sched = SliceStub(clock, machine, name, log, step)
        reqs = [types.SimpleNamespace(request_id=f"{name}{i}") for i in range(n)]
        driver = (closed_loop(sched, reqs, 1, out, clock=clock) if arrivals is None
                  else open_loop(sched, reqs, arrivals, out, clock=clock, sleep=clock.advance))
        runs.append(Interleaved(sched, driver, clock))
        samples.append(out)
    run_interleaved(runs, slice_s)
    return samples, log, runs


def test_interleaved_runs_take_turns_and_each_clock_counts_its_own_steps():
    machine = MachineClock()
    (a, b), log, runs = _interleave(machine, slice_s=0.25, step_s=(0.1, 0.2))
    # alone, run a's requests take 3 steps of 0.1 s each, one after another (c = 1); run b's 3 of 0.2 s
    assert [s.latency_s for s in a] == pytest.approx([0.3] * 4)
    assert [s.latency_s for s in b] == pytest.approx([0.6] * 4)
    assert machine.t - 100.0 == pytest.approx(12 * 0.1 + 12 * 0.2)  # the machine did each step once
    assert runs[0].clock() == pytest.approx(1.2) and runs[1].clock() == pytest.approx(2.4)
    turns = [x for x in log if not x.startswith("settle")]
    assert turns[:9] == list("aaabbaaab")  # a turn lasts until its clock passed 0.25 s: 3 steps of a, 2 of b
    assert log[3] == "settle a" and log[6] == "settle b"  # every turn ends settled (no step left in flight)


def test_a_slow_moment_of_the_machine_falls_on_interleaved_runs_alike():
    """Two identical runs; the machine is 3× slower for a while. One after the other, the second takes the slow
    moment alone; taking turns, they share it."""
    def ratio(slice_s):
        machine = MachineClock(slow_from=102.4, slow_to=104.0, slow=3.0)
        if slice_s is None:  # one after the other, each on the machine's clock
            mean = []
            for name in "ab":
                reqs = [types.SimpleNamespace(request_id=f"{name}{i}") for i in range(8)]
                sched = SliceStub(machine, machine, name, [], 0.1)
                mean.append(np.mean([s.latency_s for s in run_closed_loop(sched, reqs, 1, clock=machine)]))
            return mean[1] / mean[0]
        (a, b), _, _ = _interleave(machine, slice_s, n=8)
        return np.mean([s.latency_s for s in b]) / np.mean([s.latency_s for s in a])

    assert ratio(None) == pytest.approx(1.5)  # b ran the whole slow 1.6 s alone: 6 of its 24 steps at 3×
    assert ratio(0.1) == pytest.approx(1.0, abs=0.1) and ratio(0.25) == pytest.approx(1.0, abs=0.1)


def test_interleaved_open_loop_skips_idle_waits_and_keeps_the_arrival_accounting():
    machine = MachineClock()
    arrivals = [0.0, 0.05, 10.0, 10.0]
    (a, b), _, runs = _interleave(machine, slice_s=0.15, arrivals=arrivals)
    for samples in (a, b):
        lat = {s.request_id[1:]: s.latency_s for s in samples}
        assert lat["0"] == pytest.approx(0.3) and lat["1"] == pytest.approx(0.6 - 0.05)  # as alone (above)
        assert lat["2"] == pytest.approx(0.3) and lat["3"] == pytest.approx(0.6)
    assert machine.t - 100.0 == pytest.approx(2 * 12 * 0.1)  # the 9.4 s waits cost no wall time
    assert runs[0].clock() == pytest.approx(10.6)  # ... but count on the run's own clock


def test_slice_clock_runs_only_while_resumed():
    from jaxspec.bench.loadgen import SliceClock

    wall = FakeClock()
    clock = SliceClock(base=wall)
    wall.sleep(5.0)
    assert clock() == 0.0  # paused at creation
    clock.resume()
    wall.sleep(1.0)
    clock.pause()
    wall.sleep(3.0)
    clock.advance(0.5)
    assert clock() == pytest.approx(1.5)
    clock.resume()
    wall.sleep(0.25)
    assert clock() == pytest.approx(1.75)
    with pytest.raises(ValueError, match="slice_s"):
        from jaxspec.bench.loadgen import run_interleaved
        run_interleaved([], 0.0)
