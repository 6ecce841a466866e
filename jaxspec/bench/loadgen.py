"""Load drivers over `jaxspec.scheduling.scheduler.Scheduler` on a wall clock: Poisson open loop, closed loop.

Both drive the scheduler from the caller's thread (`step_once`), so no thread competes with the
engine for the 2 CPU cores. Clock and sleep are injectable (tests).

Interleaved (`run_interleaved`): several runs (one scheduler and engine each, a policy each in the bench) take
turns of a fraction of a second, round robin, each on its own `SliceClock` that runs only during its turns. Two
runs measured one after the other see different moments of a shared machine (the same prompt chunks took up to
14 % longer in one policy's cell than in another's of the same run); taking turns, they see the same ones.

Open loop (`run_open_loop`): request i arrives at a_i = Σ_{j≤i} g_j, g_j ~ Exp(rate) (seeded). Between
steps the driver submits every request whose arrival time has passed; when the scheduler is idle it
sleeps until the next arrival. A request that arrives during a step is submitted after the step, so
its measured times are corrected back to its scheduled arrival:

    latency_s = finish − a_i            (the scheduler's total_s + (submit − a_i))
    ttft_s    = first token − a_i       time to first token
    tpot_s    = (finish − first token) / (tokens − 1)   time per output token after the first

Closed loop (`run_closed_loop`): `concurrency` clients keep one request in flight each; a finished one is
replaced at once by the next, until all have run. latency_s = finish − submit. With sessions (an agent's related
requests, the agentic workload), a client runs a whole session in order (its next request once the one before
finished, as an agent that reads each answer) before it takes the next session; without, every request is a
session of its own.

Summary (`summarize`): mean / p50 / p99 latency, mean / p99 ttft, mean tpot, tokens_per_s = output
tokens / (last finish − first arrival), acceptance = accepted / proposed proposals, k_hist = how many
(request, step) pairs ran at each k (per-row k), mean_k over those.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable, Hashable, Iterator, Sequence

import numpy as np

from jaxspec.scheduling.requests import FinishReason, Request
from jaxspec.scheduling.scheduler import Scheduler


@dataclasses.dataclass(frozen=True)
class Sample:
    """One finished request, times in seconds from the run's start."""

    request_id: str
    arrival_s: float
    finish_s: float
    latency_s: float
    ttft_s: float | None
    tpot_s: float | None
    tokens: int
    proposed: int
    accepted: int
    ks: tuple[int, ...]
    error: str | None = None


def poisson_arrivals(rate: float, n: int, seed: int = 0) -> np.ndarray:
    """Arrival times (s) of `n` requests of a Poisson process with `rate` requests/s."""
    if rate <= 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=n)
    return np.cumsum(gaps)


def _sample(result, arrival: float, submitted: float) -> Sample:
    t = result.timings
    lag = submitted - arrival  # >= 0: the step that was running when the request arrived
    error = result.error if result.finish_reason in (FinishReason.ERROR, FinishReason.CANCELLED) else None
    return Sample(request_id=result.request_id, arrival_s=arrival, finish_s=submitted + t.total_s,
                  latency_s=t.total_s + lag, ttft_s=None if t.ttft_s is None else t.ttft_s + lag,
                  tpot_s=t.tpot_s, tokens=len(result.token_ids), proposed=result.proposed,
                  accepted=result.accepted, ks=tuple(s.k for s in result.steps), error=error)


def run_open_loop(scheduler: Scheduler, requests: Sequence[Request], arrivals: Sequence[float], *,
                  clock: Callable[[], float] = time.perf_counter, sleep: Callable[[float], None] = time.sleep,
                  on_done: Callable[[Sample], None] | None = None) -> list[Sample]:
    """Submit request i at arrivals[i] seconds after the start; run until all finish.
    `scheduler` must use the same `clock`."""
    samples: list[Sample] = []
    for _ in open_loop(scheduler, requests, arrivals, samples, clock=clock, sleep=sleep, on_done=on_done):
        pass
    return samples


def open_loop(scheduler: Scheduler, requests: Sequence[Request], arrivals: Sequence[float], samples: list[Sample],
              *, clock: Callable[[], float] = time.perf_counter, sleep: Callable[[float], None] = time.sleep,
              on_done: Callable[[Sample], None] | None = None) -> Iterator[None]:
    """`run_open_loop` as a driver that yields after every scheduler step and every wait, appending each finished
    request to `samples` (`run_interleaved` runs several at once)."""
    if len(requests) != len(arrivals):
        raise ValueError("one arrival time per request")
    order = np.argsort(arrivals, kind="stable")
    t0 = clock()
    handles, nxt = {}, 0
    while nxt < len(order) or handles:
        now = clock() - t0
        while nxt < len(order) and arrivals[order[nxt]] <= now:
            i = int(order[nxt])
            handle = scheduler.submit(requests[i], stream=False)
            handles[requests[i].request_id] = (handle, float(arrivals[i]), clock() - t0)
            nxt += 1
        if not handles:  # idle: wait for the next arrival
            sleep(max(0.0, float(arrivals[order[nxt]]) - (clock() - t0)))
            yield
            continue
        scheduler.step_once()
        for rid in [r for r, (h, _, _) in handles.items() if h.done()]:
            handle, arrival, submitted = handles.pop(rid)
            samples.append(_sample(handle.result(), arrival, submitted))
            if on_done:
                on_done(samples[-1])
        yield


def run_closed_loop(scheduler: Scheduler, requests: Sequence[Request], concurrency: int, *,
                    sessions: Sequence[Hashable] | None = None, clock: Callable[[], float] = time.perf_counter,
                    on_done: Callable[[Sample], None] | None = None) -> list[Sample]:
    """Keep `concurrency` clients' requests in flight until every request has run. `sessions`: each request's
    session (None: one each); a client runs its session's requests in order, then takes the next session."""
    samples: list[Sample] = []
    for _ in closed_loop(scheduler, requests, concurrency, samples, sessions=sessions, clock=clock,
                         on_done=on_done):
        pass
    return samples


def closed_loop(scheduler: Scheduler, requests: Sequence[Request], concurrency: int, samples: list[Sample], *,
                sessions: Sequence[Hashable] | None = None, clock: Callable[[], float] = time.perf_counter,
                on_done: Callable[[Sample], None] | None = None) -> Iterator[None]:
    """`run_closed_loop` as a driver that yields after every scheduler step, appending each finished request to
    `samples` (`run_interleaved` runs several at once)."""
    if concurrency < 1:
        raise ValueError("concurrency must be >= 1")
    if sessions is not None and len(sessions) != len(requests):
        raise ValueError(f"{len(sessions)} session ids for {len(requests)} requests")
    queues: dict[Hashable, collections.deque[Request]] = {}  # session -> its requests not yet submitted, in order
    for i, r in enumerate(requests):
        queues.setdefault(i if sessions is None else sessions[i], collections.deque()).append(r)
    waiting = collections.deque(queues.values())  # sessions no client has taken yet
    t0 = clock()
    handles: dict[Hashable, tuple] = {}  # request id -> (handle, submitted, its session's queue)

    def submit(queue: collections.deque[Request]) -> None:
        r = queue.popleft()
        handles[r.request_id] = (scheduler.submit(r, stream=False), clock() - t0, queue)

    while waiting or handles:
        while waiting and len(handles) < concurrency:
            submit(waiting.popleft())
        if not scheduler.step_once() and not any(h.done() for h, _, _ in handles.values()):
            raise RuntimeError(f"scheduler made no progress with {len(handles)} live requests")
        for rid in [r for r, (h, _, _) in handles.items() if h.done()]:
            handle, submitted, queue = handles.pop(rid)
            samples.append(_sample(handle.result(), submitted, submitted))
            if queue:  # the client goes on with its session
                submit(queue)
            if on_done:
                on_done(samples[-1])
        yield


class SliceClock:
    """A clock that runs only during its holder's slices of an interleave (`run_interleaved`): the seconds of
    `base` while resumed, plus the idle waits `advance` skips (an open loop waiting for an arrival does nothing,
    so its wait costs no wall time). Paused at creation."""

    def __init__(self, base: Callable[[], float] = time.perf_counter):
        self._base, self._elapsed, self._since = base, 0.0, None

    def __call__(self) -> float:
        return self._elapsed + (self._base() - self._since if self._since is not None else 0.0)

    def resume(self) -> None:
        if self._since is None:
            self._since = self._base()

    def pause(self) -> None:
        self._elapsed, self._since = self(), None

    def advance(self, seconds: float) -> None:
        """Skip `seconds` of idle time (the `sleep` of an interleaved open loop)."""
        self._elapsed += max(0.0, seconds)


@dataclasses.dataclass
class Interleaved:
    """One run of an interleave: its scheduler (on `clock`), its driver (`open_loop` or `closed_loop` on the same
    clock, not started) and its clock."""

    scheduler: Scheduler
    driver: Iterator[None]
    clock: SliceClock


def run_interleaved(runs: Sequence[Interleaved], slice_s: float) -> None:
    """Run several drivers to the end in turns of `slice_s` seconds of their own clocks, round robin: the runs
    share the machine's moments (a slow second of the machine falls on all of them, not on one run's cell), and
    each one's clock counts only its own turns. A turn ends at a step boundary, with the step in flight read
    (`Scheduler.settle`), so no run's device work spills into another's turn; the overlapped loop loses its
    overlap once per turn, in every run alike."""
    if slice_s <= 0:
        raise ValueError(f"slice_s must be > 0, got {slice_s}")
    live = list(runs)
    while live:
        for run in list(live):
            run.clock.resume()
            began = run.clock()
            try:
                while run.clock() - began < slice_s:
                    next(run.driver)
            except StopIteration:
                live.remove(run)
            run.scheduler.settle()
            run.clock.pause()


def summarize(samples: Sequence[Sample]) -> dict:
    """The metrics of the module doc over the requests that finished without error."""
    ok = [s for s in samples if s.error is None]
    if not ok:
        return {"requests": len(samples), "errors": len(samples)}
    lat = np.array([s.latency_s for s in ok])
    ttft = np.array([s.ttft_s for s in ok if s.ttft_s is not None])
    tpot = np.array([s.tpot_s for s in ok if s.tpot_s is not None])
    tokens = sum(s.tokens for s in ok)
    span = max(s.finish_s for s in ok) - min(s.arrival_s for s in ok)
    proposed, accepted = sum(s.proposed for s in ok), sum(s.accepted for s in ok)
    ks = [k for s in ok for k in s.ks]
    hist = {str(k): int(c) for k, c in zip(*np.unique(ks, return_counts=True))} if ks else {}
    return {
        "requests": len(samples), "errors": len(samples) - len(ok), "output_tokens": tokens,
        "mean_latency_s": float(lat.mean()), "p50_latency_s": float(np.percentile(lat, 50)),
        "p99_latency_s": float(np.percentile(lat, 99)),
        "mean_ttft_s": float(ttft.mean()) if ttft.size else None,
        "p99_ttft_s": float(np.percentile(ttft, 99)) if ttft.size else None,
        "mean_tpot_s": float(tpot.mean()) if tpot.size else None,
        "tokens_per_s": tokens / span if span > 0 else None,
        "acceptance": accepted / proposed if proposed else None,
        "proposed": proposed, "accepted": accepted,
        "k_hist": hist, "mean_k": float(np.mean(ks)) if ks else 0.0, "span_s": span,
        # each decode step emits its accepted proposals plus one token
        "steps": len(ks), "tokens_per_step": (accepted + len(ks)) / len(ks) if ks else None,
    }
