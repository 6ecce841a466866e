"""The continuous-batching loop: request lifecycle, admission, streaming, stop (DESIGN.md §3).

One engine thread runs the loop (`run_forever()`, or `generate_all` / `iter_completed` in the
caller's thread); any thread may `submit`, `cancel` and read a request's events. Every loop iteration:

    cancellations  ->  admission: waiting requests take free slots (FIFO)
                   ->  prefill: at most `prefill_token_budget` prompt tokens (≥ one chunk), so a long
                       prompt never stalls running requests for its whole prefill
                   ->  decode: BatchView -> policy.choose -> engine.step -> policy.observe
                   ->  per request: truncate at eos / stop ids / stop strings / max tokens, stream the
                       new tokens and text, retire finished requests and free their slots

Failure isolation: a bad request is rejected alone (`InvalidRequestError`); a failure in one
request's prefill or post-processing fails that request; a failure in a step fails the step's
requests, and if the engine's donated state may be lost the engine is reset (requests still
prefilling restart from scratch). The loop itself goes on.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import logging
import queue
import secrets
import threading
import time
from typing import Callable, Iterable, Iterator

import jax
import numpy as np

from jaxspec.detokenizer import ByteTokenizer, IncrementalDetokenizer
from jaxspec.engine import Engine, smallest_at_least
from jaxspec.policy.base import BatchView, Decision, Policy
from jaxspec.policy.fixed import NoSpeculation
from jaxspec.types import SamplingParams, StepResult

log = logging.getLogger(__name__)

Clock = Callable[[], float]


# --- errors ----------------------------------------------------------------------------


class SchedulerError(Exception):
    """Base class of the scheduler's own errors."""


class InvalidRequestError(SchedulerError, ValueError):
    """The request cannot run (empty or over-long prompt, bad parameters, duplicate id)."""


class QueueFullError(SchedulerError):
    """The waiting queue is at `SchedulerConfig.max_queue`; retry later."""


class SchedulerClosedError(SchedulerError, RuntimeError):
    """`submit` after `stop()`."""


class PolicyDecisionError(SchedulerError):
    """The policy chose a k outside the menu or beyond what the cache allows."""


# --- values ----------------------------------------------------------------------------


class FinishReason(str, enum.Enum):
    EOS = "eos"  # an end-of-sequence token (kept as the last token id, not in the text)
    LENGTH = "length"  # max_tokens, or the cache is full (max_tokens is capped to fit it)
    STOP = "stop"  # a stop token id (kept as the last id) or a stop string (cut from the text)
    CANCELLED = "cancelled"  # cancel(), or the scheduler stopped first
    ERROR = "error"  # rejected, or failed while running (`RequestResult.error` says why)


@dataclasses.dataclass(frozen=True)
class Request:
    """One generation request; `prompt_token_ids` is already tokenised (and chat-templated)."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams = SamplingParams()

    def __post_init__(self):
        object.__setattr__(self, "prompt_token_ids", tuple(int(t) for t in self.prompt_token_ids))


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """max_queue:            waiting (not yet admitted) requests beyond which `submit` raises QueueFullError.
    prefill_token_budget: prompt tokens prefilled per loop iteration between decode steps (at least
                          one chunk always runs); None = the engine's largest prefill bucket.
    max_running:          requests admitted at once; None = the engine's largest batch bucket.
    """

    max_queue: int = 1024
    prefill_token_budget: int | None = None
    max_running: int | None = None

    def __post_init__(self):
        if self.max_running is not None and self.max_running < 1:
            raise ValueError(f"max_running must be >= 1, got {self.max_running}")
        if self.max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {self.max_queue}")
        if self.prefill_token_budget is not None and self.prefill_token_budget < 1:
            raise ValueError(f"prefill_token_budget must be >= 1, got {self.prefill_token_budget}")


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """One decode step of one request: the row's k, proposals verified, proposals accepted."""

    k: int
    proposed: int
    accepted: int


@dataclasses.dataclass(frozen=True)
class RequestTimings:
    """Seconds, on the scheduler's clock.

    queued_s: submit -> admitted into a slot (prefill starts).
    ttft_s:   submit -> first token emitted (time to first token).
    tpot_s:   (finish - first token) / (tokens - 1): mean time per output token after the first;
              None with fewer than two tokens.
    total_s:  submit -> finished.
    """

    queued_s: float | None
    ttft_s: float | None
    tpot_s: float | None
    total_s: float


@dataclasses.dataclass(frozen=True)
class RequestResult:
    """The final state of a request.

    token_ids: generated ids; an eos / stop id that ended the request is the last one.
    text:      detokenised output (None without a tokenizer); a stop string and what follows are cut.
    seed:      the sampling seed used (drawn from the host for unseeded sampled requests).
    steps:     per decode step (k, proposed, accepted); the prefill's first token has no step.
    """

    request_id: str
    token_ids: tuple[int, ...]
    text: str | None
    finish_reason: FinishReason
    error: str | None
    prompt_len: int
    seed: int
    steps: tuple[StepRecord, ...]
    timings: RequestTimings

    @property
    def proposed(self) -> int:
        return sum(s.proposed for s in self.steps)

    @property
    def accepted(self) -> int:
        return sum(s.accepted for s in self.steps)

    @property
    def acceptance_rate(self) -> float | None:
        """accepted / proposed over the request's steps; None if nothing was proposed."""
        return self.accepted / self.proposed if self.proposed else None

    def stats(self) -> dict:
        """JSON-ready statistics (what `--json` and batch output lines carry)."""
        t = self.timings
        return {
            "prompt_tokens": self.prompt_len, "completion_tokens": len(self.token_ids),
            "steps": len(self.steps), "k": [s.k for s in self.steps],
            "proposed": self.proposed, "accepted": self.accepted, "acceptance": self.acceptance_rate,
            "seed": self.seed, "queued_s": t.queued_s, "ttft_s": t.ttft_s, "tpot_s": t.tpot_s,
            "total_s": t.total_s,
        }


@dataclasses.dataclass(frozen=True)
class RequestOutput:
    """A streamed event: the tokens and text a request gained; the last one has `finished` and `result`."""

    request_id: str
    token_ids: tuple[int, ...]
    text: str
    finished: bool = False
    result: RequestResult | None = None


class RequestHandle:
    """The caller's side of one request; safe to use from any thread."""

    def __init__(self, request_id: str, scheduler: "Scheduler"):
        self.request_id = request_id
        self._scheduler = scheduler
        self._events: queue.Queue[RequestOutput] = queue.Queue()
        self._done = threading.Event()
        self._result: RequestResult | None = None

    def __iter__(self) -> Iterator[RequestOutput]:
        """Blocking iteration over events until the final one (inclusive)."""
        while not (self._done.is_set() and self._events.empty()):  # the final event not yet taken
            event = self._events.get()
            yield event
            if event.finished:
                return

    def get(self, timeout: float | None = None) -> RequestOutput:
        """The next event; raises queue.Empty after `timeout` seconds."""
        return self._events.get(timeout=timeout)

    def result(self, timeout: float | None = None) -> RequestResult:
        """Wait for the request to finish; TimeoutError after `timeout` seconds."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.request_id!r} did not finish within {timeout} s")
        assert self._result is not None
        return self._result

    def done(self) -> bool:
        return self._done.is_set()

    def cancel(self) -> bool:
        return self._scheduler.cancel(self.request_id)

    def _emit(self, event: RequestOutput, stream: bool) -> None:
        if event.finished:
            self._result = event.result
        if stream or event.finished:
            self._events.put(event)
        if event.finished:
            self._done.set()


@dataclasses.dataclass(eq=False)
class _Live:
    """Mutable bookkeeping of one admitted-or-waiting request (engine thread only, after submit)."""

    request: Request
    handle: RequestHandle
    stream: bool
    seed: int
    max_new: int
    arrival: float
    detok: IncrementalDetokenizer | None
    admitted: float | None = None
    first_token_at: float | None = None
    slot: int | None = None
    prefilled: int = 0  # prompt tokens in the cache
    running: bool = False  # prefill done, decoding
    tokens: list[int] = dataclasses.field(default_factory=list)
    steps: list[StepRecord] = dataclasses.field(default_factory=list)

    @property
    def request_id(self) -> str:
        return self.request.request_id


# --- the scheduler -----------------------------------------------------------------------


class Scheduler:
    """Continuous batching over one `Engine`.

    tokenizer:     gives text and stop strings (needs `token_bytes`, see jaxspec.detokenizer);
                   None = token ids only (stop strings are then rejected).
    eos_token_ids: None = the model config's and the tokenizer's together.
    clock:         injectable, for timings and the step time the policy observes.
    seed_source:   draws the seed of unseeded sampled requests (default: the OS's randomness).
    """

    def __init__(self, engine: Engine, policy: Policy | None = None, tokenizer: ByteTokenizer | None = None,
                 config: SchedulerConfig = SchedulerConfig(), *, eos_token_ids: Iterable[int] | None = None,
                 clock: Clock = time.monotonic, seed_source: Callable[[], int] | None = None):
        self.engine = engine
        self.policy = policy or NoSpeculation()
        self.tokenizer = tokenizer
        self.config = config
        if eos_token_ids is None:
            eos_token_ids = {*engine.model_config.eos_token_ids, *(tokenizer.eos_token_ids if tokenizer else ())}
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.clock = clock
        self._seed_source = seed_source or (lambda: secrets.randbelow(2**31))
        ec = engine.config
        # slots used: every running request fits one step
        self.capacity = ec.batch_buckets[-1]
        if config.max_running is not None:
            if config.max_running > self.capacity:
                raise ValueError(f"max_running={config.max_running} exceeds the largest batch bucket {self.capacity}")
            self.capacity = config.max_running
        self._prefill_budget = config.prefill_token_budget or ec.prefill_buckets[-1]

        self._lock = threading.Lock()
        self._wakeup = threading.Condition(self._lock)
        # shared with submitting threads (under _lock)
        self._waiting: collections.deque[_Live] = collections.deque()
        self._live: dict[str, _Live] = {}
        self._cancel_ids: set[str] = set()
        self._closed = False
        self._stop_now = False
        self._loop_active = False
        self._thread: threading.Thread | None = None
        # engine thread only
        self._slots: dict[int, _Live] = {}  # slot -> request being prefilled or decoded
        self.iterations = 0  # loop iterations (idle waits excluded)
        self.steps_run = 0  # decode steps
        self.engine_resets = 0

    # --- the public contract (any thread) ----------------------------------------------

    def submit(self, request: Request, stream: bool = True) -> RequestHandle:
        """Queue a request. Raises InvalidRequestError (with the reason), QueueFullError or
        SchedulerClosedError. With stream=False only the final event is queued on the handle."""
        max_new = self._validate(request)
        p = request.params
        detok = IncrementalDetokenizer(self.tokenizer, p.stop_strings) if self.tokenizer is not None else None
        seed = p.seed if p.seed is not None else (self._seed_source() if p.temperature > 0 else 0)
        with self._lock:
            if self._closed:
                raise SchedulerClosedError("the scheduler is stopped")
            if request.request_id in self._live:
                raise InvalidRequestError(f"request id {request.request_id!r} is already running")
            if len(self._waiting) >= self.config.max_queue:
                raise QueueFullError(f"the waiting queue is full ({self.config.max_queue} requests)")
            live = _Live(request=request, handle=RequestHandle(request.request_id, self), stream=stream,
                         seed=seed, max_new=max_new, arrival=self.clock(), detok=detok)
            self._waiting.append(live)
            self._live[request.request_id] = live
            self._wakeup.notify_all()
        return live.handle

    def cancel(self, request_id: str) -> bool:
        """Ask for a request to finish with 'cancelled'. False if it is not live."""
        with self._lock:
            if request_id not in self._live:
                return False
            self._cancel_ids.add(request_id)
            self._wakeup.notify_all()
            return True

    def run_forever(self) -> None:
        """Run the loop in this thread until `stop()`; blocks (no spinning) while idle."""
        self._claim_loop()
        try:
            while True:
                with self._wakeup:
                    while not self._stop_now and not self._has_work_locked() and not self._closed:
                        self._wakeup.wait()
                    if self._stop_now or (self._closed and not self._has_work_locked()):
                        break
                self.step_once()
        finally:
            self._abort_all(FinishReason.CANCELLED, "the scheduler stopped")
            with self._lock:
                self._loop_active = False

    def start(self) -> threading.Thread:
        """Run `run_forever` in a new daemon thread."""
        thread = threading.Thread(target=self.run_forever, name="jaxspec-scheduler", daemon=True)
        self._thread = thread
        thread.start()
        return thread

    def stop(self, drain: bool = False, timeout: float | None = None) -> None:
        """Refuse new requests and end the loop: at once (live requests finish 'cancelled') or,
        with drain=True, once every live request has finished. Joins the thread of `start()`."""
        with self._wakeup:
            self._closed = True
            self._stop_now = self._stop_now or not drain
            self._wakeup.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def iter_completed(self, requests: Iterable[Request]) -> Iterator[RequestResult]:
        """Run `requests` to completion in this thread (it is the loop thread meanwhile), yielding
        results as they finish. Requests are submitted as queue room allows; a rejected one yields
        an 'error' result. Closing the iterator early cancels whatever is still live."""
        self._claim_loop()
        handles: dict[str, RequestHandle] = {}
        pending = iter(requests)
        exhausted = False
        try:
            while True:
                while not exhausted and self.num_waiting < self.config.max_queue:
                    request = next(pending, None)
                    if request is None:
                        exhausted = True
                        break
                    try:
                        handles[request.request_id] = self.submit(request, stream=False)
                    except InvalidRequestError as exc:
                        yield self._rejected(request, str(exc))
                if exhausted and not handles:
                    return
                if not self.step_once() and not any(h.done() for h in handles.values()):
                    raise RuntimeError(f"scheduler made no progress with {len(handles)} live requests")
                for request_id in [r for r, h in handles.items() if h.done()]:
                    yield handles.pop(request_id).result()
        finally:  # abandoned (or failed): nothing may stay in a slot
            self._abort_all(FinishReason.CANCELLED, "generation was abandoned")
            with self._lock:
                self._loop_active = False

    def generate_all(self, requests: Iterable[Request]) -> list[RequestResult]:
        """Run every request to completion; results in input order."""
        requests = list(requests)
        ids = [r.request_id for r in requests]
        if len(set(ids)) != len(ids):
            raise ValueError("request ids must be unique")
        done = {r.request_id: r for r in self.iter_completed(requests)}
        return [done[i] for i in ids]

    @property
    def num_waiting(self) -> int:
        with self._lock:
            return len(self._waiting)

    @property
    def num_live(self) -> int:
        with self._lock:
            return len(self._live)

    @property
    def num_running(self) -> int:
        """Slots holding a request (prefilling or decoding); a snapshot, safe from any thread."""
        return len(self._slots)

    # --- validation ----------------------------------------------------------------------

    def _validate(self, request: Request) -> int:
        """Raise InvalidRequestError with the reason; return the capped max new tokens."""
        rid, prompt, p = request.request_id, request.prompt_token_ids, request.params
        max_len, vocab = self.engine.config.max_len, self.engine.model_config.vocab_size
        if not isinstance(rid, str) or not rid:
            raise InvalidRequestError(f"request_id must be a non-empty string, got {rid!r}")
        if not prompt:
            raise InvalidRequestError(f"request {rid!r}: empty prompt")
        if len(prompt) + 1 > max_len:
            raise InvalidRequestError(f"request {rid!r}: prompt of {len(prompt)} tokens leaves no room to generate "
                                      f"(max_len {max_len})")
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"request {rid!r}: token ids outside [0, {vocab}): {bad[:5]}")
        try:
            p.validate()
        except ValueError as exc:
            raise InvalidRequestError(f"request {rid!r}: {exc}") from None
        if p.stop_strings and self.tokenizer is None:
            raise InvalidRequestError(f"request {rid!r}: stop strings need a tokenizer")
        if any(not isinstance(s, str) or not s for s in p.stop_strings):
            raise InvalidRequestError(f"request {rid!r}: stop strings must be non-empty strings")
        return min(p.max_tokens, max_len - len(prompt))

    # --- the loop (engine thread) --------------------------------------------------------

    def _claim_loop(self) -> None:
        with self._lock:
            if self._loop_active:
                raise RuntimeError("the scheduler loop is already running in another thread")
            self._loop_active = True

    def _has_work_locked(self) -> bool:
        return bool(self._waiting or self._cancel_ids or self._slots)

    def step_once(self) -> bool:
        """One loop iteration. Returns whether anything happened."""
        self.iterations += 1
        did = self._process_cancellations()
        self._admit()
        did |= self._prefill()
        did |= self._decode()
        return did

    def _process_cancellations(self) -> bool:
        with self._lock:
            ids, self._cancel_ids = self._cancel_ids, set()
            waiting = [l for l in self._waiting if l.request_id in ids]
            for live in waiting:
                self._waiting.remove(live)
        for live in waiting:
            self._finish(live, FinishReason.CANCELLED)
        for live in [l for l in self._slots.values() if l.request_id in ids]:
            self._finish(live, FinishReason.CANCELLED)
        return bool(ids)

    def _admit(self) -> None:
        free = [s for s in range(self.capacity) if s not in self._slots]
        with self._lock:
            admitted = [self._waiting.popleft() for _ in range(min(len(free), len(self._waiting)))]
        now = self.clock()
        for slot, live in zip(free, admitted):
            live.slot, live.admitted = slot, now
            self._slots[slot] = live

    def _prefill(self) -> bool:
        """Prefill prompt chunks of admitted requests (oldest first) within the token budget."""
        budget, did = self._prefill_budget, False
        largest = self.engine.config.prefill_buckets[-1]
        for live in [l for l in self._slots.values() if not l.running]:  # admission order
            while not live.running:
                prompt = live.request.prompt_token_ids
                n = min(len(prompt) - live.prefilled, largest)
                if did and n > budget:
                    return did
                self._prefill_chunk(live, n)
                budget -= n
                did = True
                if live.slot is None:  # failed
                    break
        return did

    def _prefill_chunk(self, live: _Live, n: int) -> None:
        prompt, p = live.request.prompt_token_ids, live.request.params
        start = live.prefilled
        is_last = start + n == len(prompt)
        try:
            first = self.engine.prefill_chunk(live.slot, np.asarray(prompt[start:start + n], np.int32), start,
                                              is_last, p, live.seed)
        except Exception as exc:  # noqa: BLE001 - the request fails, the loop goes on
            log.exception("prefill of request %r failed", live.request_id)
            if self._engine_state_lost():
                self._recover_engine(f"engine state lost in a failed prefill: {exc!r}", spare=live)
            self._finish(live, FinishReason.ERROR, f"prefill failed: {exc!r}")
            return
        live.prefilled = start + n
        if is_last:
            live.running = True
            live.first_token_at = self.clock()
            self._deliver(live, [first])

    def _decode(self) -> bool:
        rows = sorted((l for l in self._slots.values() if l.running), key=lambda l: l.slot)
        if not rows:
            return False
        engine = self.engine
        slot_ids = [l.slot for l in rows]
        lengths = [int(engine.lengths[s]) for s in slot_ids]
        max_len = engine.config.max_len
        view = BatchView(
            request_ids=tuple(l.request_id for l in rows),
            context_lens=tuple(lengths),
            # room in the cache for k proposals + 1, and no more proposals than tokens still wanted
            row_max_k=tuple(max(0, min(max_len - 1 - n, l.max_new - len(l.tokens) - 1)) for l, n in zip(rows, lengths)),
            k_menu=tuple(engine.config.k_menu),
            batch_bucket=smallest_at_least(engine.config.batch_buckets, len(rows), "batch"),
            catch_up_calls=tuple(len(engine.catch_up_plan(s)) for s in slot_ids),
        )
        try:
            decision = self.policy.choose(view)
            self._check_decision(decision, view, [max_len - 1 - n for n in lengths])
        except Exception as exc:  # noqa: BLE001
            log.exception("policy.choose failed")
            self._fail_all(rows, f"policy {self.policy.name!r} failed: {exc!r}")
            return True
        t0 = self.clock()
        try:
            result = engine.step(slot_ids, decision.k, list(decision.row_k) if decision.row_k is not None else None)
        except Exception as exc:  # noqa: BLE001
            log.exception("engine step failed")
            self._recover_engine(f"engine step failed: {exc!r}")
            return True
        elapsed = self.clock() - t0
        self.steps_run += 1
        try:  # the policy's cost model times the step executable: lazy catch-up is not part of it
            self.policy.observe(view, decision, result, max(0.0, elapsed - result.catch_up_s))
        except Exception as exc:  # noqa: BLE001
            log.exception("policy.observe failed")
            self._fail_all(rows, f"policy {self.policy.name!r} failed to observe a step: {exc!r}")
            return True
        self._deliver_step(rows, decision, result)
        return True

    @staticmethod
    def _check_decision(decision: Decision, view: BatchView, cache_room: list[int]) -> None:
        """The decision must be in the menu and each row's effective k must fit its cache room."""
        k = decision.k
        if k not in view.k_menu:
            raise PolicyDecisionError(f"k={k} is not in the compiled menu {view.k_menu}")
        if decision.row_k is not None:
            if len(decision.row_k) != view.batch_size or any(not 0 <= r <= k for r in decision.row_k):
                raise PolicyDecisionError(f"row_k={decision.row_k} must give each of {view.batch_size} rows 0..{k}")
        effective = decision.row_k if decision.row_k is not None else (k,) * view.batch_size
        for row_k, room in zip(effective, cache_room):
            if row_k > room:
                raise PolicyDecisionError(f"k={row_k} does not fit the cache (room for k <= {room})")

    def _deliver_step(self, rows: list[_Live], decision: Decision, result: StepResult) -> None:
        for i, live in enumerate(rows):
            row_k = decision.k if decision.row_k is None else decision.row_k[i]
            live.steps.append(StepRecord(k=row_k, proposed=int(result.proposed[i]), accepted=int(result.accepted[i])))
            self._deliver(live, result.row_tokens(i))

    def _deliver(self, live: _Live, tokens: list[int]) -> None:
        """Append a row's new tokens up to the first finishing one, stream them, retire if finished."""
        try:
            p = live.request.params
            new, text, reason = [], [], None
            for token in tokens:
                new.append(token)
                if token in self.eos_token_ids and not p.ignore_eos:
                    reason = FinishReason.EOS
                elif token in p.stop_token_ids:
                    reason = FinishReason.STOP
                elif live.detok is not None:
                    text.append(live.detok.push(token))
                    if live.detok.stopped:
                        reason = FinishReason.STOP
                if reason is None and len(live.tokens) + len(new) >= live.max_new:
                    reason = FinishReason.LENGTH
                if reason is not None:
                    break  # tokens after a stop in the same step are dropped
            live.tokens.extend(new)
        except Exception as exc:  # noqa: BLE001 - e.g. a tokenizer error: only this request fails
            log.exception("post-processing request %r failed", live.request_id)
            self._finish(live, FinishReason.ERROR, f"post-processing failed: {exc!r}")
            return
        if reason is None:
            live.handle._emit(RequestOutput(live.request_id, tuple(new), "".join(text)), live.stream)
        else:
            self._finish(live, reason, new_tokens=new, new_text="".join(text))

    # --- retiring and failures -------------------------------------------------------------

    def _finish(self, live: _Live, reason: FinishReason, error: str | None = None,
                new_tokens: list[int] = (), new_text: str = "") -> None:
        now = self.clock()
        if live.detok is not None:
            try:
                new_text += live.detok.finish()
            except Exception as exc:  # noqa: BLE001
                reason, error = FinishReason.ERROR, error or f"detokenisation failed: {exc!r}"
        if live.slot is not None:
            del self._slots[live.slot]
            self.engine.free(live.slot)
            live.slot = None
            try:
                self.policy.forget(live.request_id)
            except Exception:  # noqa: BLE001 - a policy bug must not leak the request
                log.exception("policy.forget(%r) failed", live.request_id)
        n, first = len(live.tokens), live.first_token_at
        timings = RequestTimings(
            queued_s=None if live.admitted is None else live.admitted - live.arrival,
            ttft_s=None if first is None else first - live.arrival,
            tpot_s=(now - first) / (n - 1) if first is not None and n > 1 else None,
            total_s=now - live.arrival,
        )
        result = RequestResult(
            request_id=live.request_id, token_ids=tuple(live.tokens),
            text=live.detok.text if live.detok is not None else None, finish_reason=reason, error=error,
            prompt_len=len(live.request.prompt_token_ids), seed=live.seed, steps=tuple(live.steps), timings=timings)
        with self._lock:
            self._live.pop(live.request_id, None)
            self._cancel_ids.discard(live.request_id)
        live.handle._emit(RequestOutput(live.request_id, tuple(new_tokens), new_text, True, result), live.stream)

    def _fail_all(self, lives: Iterable[_Live], error: str) -> None:
        for live in list(lives):
            self._finish(live, FinishReason.ERROR, error)

    def _engine_state_lost(self) -> bool:
        """True if a failed call consumed (donated) the engine's device state."""
        return any(getattr(x, "is_deleted", lambda: False)() for x in jax.tree.leaves(self.engine.state))

    def _recover_engine(self, error: str, spare: _Live | None = None) -> None:
        """Reset the engine: running requests fail; requests still prefilling start over."""
        self.engine.reset()
        self.engine_resets += 1
        for live in list(self._slots.values()):
            if live is spare:
                continue
            if live.running:
                self._finish(live, FinishReason.ERROR, error)
            else:
                live.prefilled = 0

    def _abort_all(self, reason: FinishReason, error: str) -> None:
        with self._lock:
            waiting, self._waiting = list(self._waiting), collections.deque()
        for live in [*waiting, *self._slots.values()]:
            self._finish(live, reason, error)

    def _rejected(self, request: Request, reason: str) -> RequestResult:
        return RequestResult(request_id=request.request_id, token_ids=(), text=None, finish_reason=FinishReason.ERROR,
                             error=reason, prompt_len=len(request.prompt_token_ids), seed=0, steps=(),
                             timings=RequestTimings(queued_s=None, ttft_s=None, tpot_s=None, total_s=0.0))
