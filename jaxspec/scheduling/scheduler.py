"""The continuous-batching loop: admission, prefill, decode steps, retiring (docs/design.md, "The scheduler").

One engine thread runs the loop (`run_forever()`, or `generate_all` / `iter_completed` in the
caller's thread); any thread may `submit`, `cancel` and read a request's events. Every loop iteration:

    cancellations  ->  admission: waiting requests take free slots and their prompts' pages (FIFO), a cached
                       prompt prefix served from the engine's prefix cache
                   ->  prefill: at most `prefill_token_budget` prompt tokens (≥ one chunk), so a long
                       prompt never stalls running requests for its whole prefill
                   ->  decode: BatchView -> policy.choose -> engine.dispatch_step (when the page pool is full,
                       the youngest request is preempted: its pages freed, it waits again at the queue's head
                       and its prompt and output so far are recomputed; nothing it streamed repeats); then the
                       step dispatched before (overlapped) or this one (synchronous) is read -> policy.observe
                   ->  per request: output processing (jaxspec.scheduling.output) streams the new tokens and text;
                       finished requests retire and free their slots

Overlapped (the default; docs/design.md, "The overlapped loop"): step n+1 is dispatched from the device-resident
state before step n's tokens are read, so the policy, output processing and streaming of step n run while the
device computes n+1. A row joins step n+1 only when no outcome of step n can change what the policy sees of it
(its cap); a row that finishes in step n has its step n+1 tokens discarded (its slot was freed).

The loop talks to the engine only through the engine contract (`jaxspec.engine.api.EngineAPI`).
Request values, the handle and the validator are in `jaxspec.scheduling.requests`.

Failure isolation: a bad request is rejected alone (`InvalidRequestError`); a failure in one
request's prefill or post-processing fails that request; a failure in a step fails the step's
requests, and if the engine's device state was lost the engine is reset (requests still
prefilling restart from scratch). The loop itself goes on.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Iterator

import numpy as np

from jaxspec.engine.api import EngineAPI, PagesExhaustedError, PendingStep
from jaxspec.policy.base import BatchView, Decision, Policy
from jaxspec.policy.fixed import NoSpeculation
from jaxspec.scheduling.detokenizer import ByteTokenizer
from jaxspec.scheduling.output import OutputProcessor
from jaxspec.scheduling.requests import (
    FinishReason,
    InvalidRequestError,
    PolicyDecisionError,
    QueueFullError,
    Request,
    RequestHandle,
    RequestLimits,
    RequestOutput,
    RequestResult,
    RequestTimings,
    SchedulerClosedError,
    StepRecord,
    validate_request,
)
from jaxspec.speculation.proposers.suffix import host_proposals
from jaxspec.speculation.suffix_tree import SuffixProposal
from jaxspec.types import HostProposals, StepResult, TokenLogprobs

log = logging.getLogger(__name__)

Clock = Callable[[], float]
KEPT_OUTPUTS = (FinishReason.EOS, FinishReason.LENGTH, FinishReason.STOP)  # outputs suffix decoding reuses


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """max_queue:            waiting (not yet admitted) requests beyond which `submit` raises QueueFullError.
    prefill_token_budget: prompt tokens prefilled per loop iteration between decode steps (at least
                          one chunk always runs); None = the engine's largest prefill bucket.
    max_running:          requests admitted at once; None = the engine's largest batch bucket.
    overlap:              dispatch step n+1 before reading step n (False: the synchronous loop, `--no-overlap`).
    """

    max_queue: int = 1024
    prefill_token_budget: int | None = None
    max_running: int | None = None
    overlap: bool = True

    def __post_init__(self):
        if self.max_running is not None and self.max_running < 1:
            raise ValueError(f"max_running must be >= 1, got {self.max_running}")
        if self.max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {self.max_queue}")
        if self.prefill_token_budget is not None and self.prefill_token_budget < 1:
            raise ValueError(f"prefill_token_budget must be >= 1, got {self.prefill_token_budget}")


@dataclasses.dataclass(frozen=True)
class StepStats:
    """One decode step as the scheduler saw it (what step listeners receive).

    view:      what the policy saw.   decision: what it chose.   result: what the engine returned.
    elapsed_s: wall seconds from the step's dispatch, or from the previous step's read if later, to its read,
               on the scheduler's clock; overlapped, to when it finished if a prompt chunk waited for it
               (`Scheduler._await_in_flight`: the chunk's time is the prompt's cost, not the step's).
               Synchronous: the step's own time; overlapped: the loop's period per step (what the step costs
               the loop).
    catch_up_s: the lazy draft catch-up that ran inside that period. A dispatch runs its step's catch-up
               first, and overlapped the next step is dispatched before this one is read, so the catch-up a
               step reports (`result.catch_up_s`) lies in the period of the step read before it.
    """

    view: BatchView
    decision: Decision
    result: StepResult
    elapsed_s: float
    catch_up_s: float = 0.0

    @property
    def executable_s(self) -> float:
        """The step executable's seconds (its period less the catch-up in it): what the policy observes."""
        return max(0.0, self.elapsed_s - self.catch_up_s)


StepListener = Callable[[StepStats], None]


@dataclasses.dataclass
class LoopSeconds:
    """Where the loop's time went (running sums, engine thread): decode steps (`StepStats.elapsed_s`, draft
    catch-up included), prefill chunks, and the policy's own host calls (`choose`, `observe`, `forget`; in the
    overlapped loop they run while a step is in flight, so on an accelerator they are hidden behind it, and a
    decode period can hold them too). The rest of a span is admission, output processing, streaming and waiting
    for work."""

    decode_steps: int = 0
    decode_s: float = 0.0
    prefill_chunks: int = 0
    prefill_s: float = 0.0
    policy_s: float = 0.0


@dataclasses.dataclass(frozen=True)
class _Guess:
    """Tokens a row's suffix chain takes as committed after the first `at` tokens of its context: the proposals of
    its step in flight, all accepted, and the trie's next token as that step's bonus token."""

    at: int
    tokens: tuple[int, ...]


@dataclasses.dataclass(eq=False)
class _InFlight:
    """A dispatched decode step not read yet: its rows (the requests as dispatched), what the policy saw and
    chose, the engine's pending step, and when it was dispatched."""

    rows: list[_Live]
    slots: list[int]
    view: BatchView
    decision: Decision
    pending: PendingStep
    dispatched_at: float
    chains: list[SuffixProposal] = dataclasses.field(default_factory=list)  # suffix decoding: each row's chain
    guesses: list[_Guess | None] = dataclasses.field(default_factory=list)  # ... and what it assumed committed
    ready_at: float | None = None  # when a prompt chunk waited for it to finish (overlapped), else None

    def cap(self, i: int) -> int:
        """Row i's effective k in this step."""
        return self.decision.k if self.decision.row_k is None else self.decision.row_k[i]

    def row_of(self, live: _Live) -> int | None:
        """Which row of this step `live` is, or None if it is not in it."""
        return self._row_index.get(id(live))

    @functools.cached_property
    def _row_index(self) -> dict[int, int]:
        return {id(live): i for i, live in enumerate(self.rows)}

    def wanted(self, live: _Live) -> int:
        """Tokens `live` still wants after this step commits its most tokens (cap + 1 if it is a row of it)."""
        i = self.row_of(live)
        return live.output.remaining - (0 if i is None else self.cap(i) + 1)


@dataclasses.dataclass(eq=False)
class _Live:
    """Mutable bookkeeping of one admitted-or-waiting request (engine thread only, after submit)."""

    request: Request
    handle: RequestHandle
    stream: bool
    seed: int
    arrival: float
    output: OutputProcessor
    admitted: float | None = None
    first_token_at: float | None = None
    slot: int | None = None
    prefilled: int = 0  # context tokens in the cache
    running: bool = False  # prefill done, decoding
    context: tuple[int, ...] = ()  # what prefill writes: the prompt, and a preempted request's output so far
    cached_prompt_tokens: int | None = None  # served from the prefix cache at the first admission
    age: int = 0  # order of first admission: the youngest (largest) is preempted first
    preemptions: int = 0
    steps: list[StepRecord] = dataclasses.field(default_factory=list)
    logprobs: list[TokenLogprobs] = dataclasses.field(default_factory=list)  # per kept token, when asked

    @property
    def request_id(self) -> str:
        return self.request.request_id


# --- the scheduler -----------------------------------------------------------------------


class Scheduler:
    """Continuous batching over one engine (anything satisfying `EngineAPI`).

    tokenizer:       gives text and stop strings (needs `token_bytes`, see jaxspec.scheduling.detokenizer);
                     None = token ids only (stop strings are then rejected).
    eos_token_ids:   None = the engine's and the tokenizer's together.
    clock:           injectable, for timings and the step time the policy observes.
    seed_source:     draws the seed of unseeded sampled requests (default: the OS's randomness).
    step_listeners:  called with a `StepStats` after every decode step (e.g. metrics); one that
                     raises is logged and fails nothing.
    """

    def __init__(self, engine: EngineAPI, policy: Policy | None = None, tokenizer: ByteTokenizer | None = None,
                 config: SchedulerConfig = SchedulerConfig(), *, eos_token_ids: Iterable[int] | None = None,
                 clock: Clock = time.monotonic, seed_source: Callable[[], int] | None = None,
                 step_listeners: Iterable[StepListener] = ()):
        self.engine = engine
        self.policy = policy or NoSpeculation()
        self.tokenizer = tokenizer
        self.config = config
        if eos_token_ids is None:
            eos_token_ids = {*engine.eos_token_ids, *(tokenizer.eos_token_ids if tokenizer else ())}
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.limits = RequestLimits.for_engine(engine, tokenizer)
        self.clock = clock
        self._seed_source = seed_source or (lambda: secrets.randbelow(2**31))
        menu = engine.menu
        # slots used: every running request fits one step
        self.capacity = menu.largest_batch
        if config.max_running is not None:
            if config.max_running > self.capacity:
                raise ValueError(f"max_running={config.max_running} exceeds the largest batch bucket {self.capacity}")
            self.capacity = config.max_running
        self._prefill_budget = config.prefill_token_budget or menu.largest_chunk
        # suffix decoding's tries (an engine whose proposer proposes on the host has one): fed from here
        self.suffix_index = getattr(engine, "suffix_index", None)
        # suffix chains continue the tokens read, so suffix decoding runs the synchronous loop unless its chains
        # are proposed ahead for the rows in flight (`SuffixConfig.ahead`; never with trees: docs/design.md, "The
        # overlapped loop")
        self._overlap = config.overlap and (self.suffix_index is None or (
            self.suffix_index.config.ahead and not engine.menu.tree_envelopes))

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
        self._step_listeners: tuple[StepListener, ...] = tuple(step_listeners)
        # engine thread only
        self._slots: dict[int, _Live] = {}  # slot -> request being prefilled or decoded
        self._chains: list[SuffixProposal] = []  # the rows' suffix chains of the current step (`_view`)
        self._guesses: list[_Guess | None] = []  # ... and what each assumes its step in flight commits
        self.iterations = 0  # loop iterations (idle waits excluded)
        self.steps_run = 0  # decode steps
        self.engine_resets = 0
        self.preemptions = 0  # requests that gave their pages back to others
        self._admissions = 0
        self._in_flight: _InFlight | None = None  # overlapped: the step dispatched and not read yet
        self._last_read_at = float("-inf")  # when the last step was read (the overlapped step's start)
        self._catch_ups: list[tuple[float, float]] = []  # (when its dispatch returned, seconds) not yet placed
        self.seconds = LoopSeconds()

    # --- the public contract (any thread) ----------------------------------------------

    def submit(self, request: Request, stream: bool = True) -> RequestHandle:
        """Queue a request. Raises InvalidRequestError (with the reason), QueueFullError or
        SchedulerClosedError. With stream=False only the final event is queued on the handle."""
        max_new = validate_request(request, self.limits)
        p = request.params
        output = OutputProcessor(p, self.eos_token_ids, max_new, self.tokenizer)
        seed = p.seed if p.seed is not None else (self._seed_source() if p.temperature > 0 else 0)
        with self._lock:
            if self._closed:
                raise SchedulerClosedError("the scheduler is stopped")
            if request.request_id in self._live:
                raise InvalidRequestError("a request with this id is already running", request.request_id)
            if len(self._waiting) >= self.config.max_queue:
                raise QueueFullError(f"the waiting queue is full ({self.config.max_queue} requests)")
            live = _Live(request=request, handle=RequestHandle(request.request_id, self.cancel), stream=stream,
                         seed=seed, arrival=self.clock(), output=output, context=tuple(request.prompt_token_ids))
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

    def add_step_listener(self, listener: StepListener) -> None:
        """Call `listener(StepStats)` after every decode step from now on."""
        with self._lock:
            self._step_listeners = (*self._step_listeners, listener)

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
                        yield RequestResult.rejected(request, str(exc))
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

    # --- the loop (engine thread) --------------------------------------------------------

    def _claim_loop(self) -> None:
        with self._lock:
            if self._loop_active:
                raise RuntimeError("the scheduler loop is already running in another thread")
            self._loop_active = True

    def _has_work_locked(self) -> bool:
        return bool(self._waiting or self._cancel_ids or self._slots or self._in_flight is not None)

    def step_once(self) -> bool:
        """One loop iteration. Returns whether anything happened."""
        self.iterations += 1
        did = self._process_cancellations()
        self._admit()
        did |= self._prefill()
        did |= self._decode()
        return did

    def settle(self) -> bool:
        """Read the step in flight, if any, without dispatching another, so the loop holds no device work (the
        bench's interleave, `jaxspec.bench.loadgen.run_interleaved`, pauses a scheduler only settled). The next
        `step_once` then dispatches with every row's counts read, as the synchronous loop does. Call it from the
        loop's thread. Returns whether a step was read."""
        step, self._in_flight = self._in_flight, None
        if step is None:
            return False
        self._read(step)
        return True

    def _process_cancellations(self) -> bool:
        with self._lock:
            ids, self._cancel_ids = self._cancel_ids, set()
            waiting = [w for w in self._waiting if w.request_id in ids]
            for live in waiting:
                self._waiting.remove(live)
        for live in waiting:
            self._finish(live, FinishReason.CANCELLED)
        for live in [s for s in self._slots.values() if s.request_id in ids]:
            self._finish(live, FinishReason.CANCELLED)
        return bool(ids)

    def _admit(self) -> None:
        """Waiting requests, in order, take free slots while the engine's page pool holds their prompts."""
        for slot in [s for s in range(self.capacity) if s not in self._slots]:
            with self._lock:
                if not self._waiting:
                    return
                live = self._waiting[0]  # only this thread removes from the queue
            cached = self.engine.admit(slot, live.context)
            if cached is None and self._slots:  # the pool is full now: wait for pages (FIFO)
                return
            with self._lock:
                self._waiting.popleft()
            if cached is None:  # even an empty pool cannot hold it
                pool = f"{self.engine.page_stats().total} pages of {self.engine.menu.page_size}"
                self._finish(live, FinishReason.ERROR,
                             f"a context of {len(live.context)} tokens does not fit the KV page pool ({pool})")
                continue
            live.slot, live.prefilled = slot, cached
            self._slots[slot] = live
            if live.admitted is None:  # a preempted request keeps its first admission
                live.admitted, live.cached_prompt_tokens = self.clock(), cached
                self._admissions += 1
                live.age = self._admissions
                if self.suffix_index is not None:
                    self.suffix_index.start(live.request_id, live.request.prompt_token_ids, live.request.tenant)

    def _prefill(self) -> bool:
        """Prefill prompt chunks of admitted requests (oldest first) within the token budget."""
        budget, did = self._prefill_budget, False
        largest = self.engine.menu.largest_chunk
        for live in [s for s in self._slots.values() if not s.running]:  # admission order
            while not live.running:
                n = min(len(live.context) - live.prefilled, largest)
                if did and n > budget:
                    return did
                self._prefill_chunk(live, n)
                budget -= n
                did = True
                if live.slot is None:  # failed
                    break
        return did

    def _await_in_flight(self) -> None:
        """Overlapped: wait for the step in flight to finish before a prompt chunk runs, and note when. The chunk
        blocks the host until it has run, and the device runs it after the step, so a chunk started first would
        absorb the step's remaining time and the policy would observe a step that cost almost nothing (seen on
        this CPU: 3 ms steps, the cost model's correction driven to its clip). The wait is the step's `result()`
        (its few counts copied to the host early; `_read` still delivers it in turn) and costs the device only the
        chunk's dispatch. A step that fails is left to `_read`, which reads it again and handles the error."""
        step = self._in_flight
        if step is None or step.ready_at is not None:
            return
        try:
            step.pending.result()
        except Exception:  # noqa: BLE001 - surfaced and handled when the step is read (`_read`)
            return
        step.ready_at = self.clock()

    def _prefill_chunk(self, live: _Live, n: int) -> None:
        context, p = live.context, live.request.params
        start = live.prefilled
        is_last = start + n == len(context)
        self._await_in_flight()
        began = self.clock()
        try:
            first = self.engine.prefill_chunk(live.slot, np.asarray(context[start:start + n], np.int32), start,
                                              is_last, p, live.seed, generated=len(live.output.token_ids))
        except Exception as exc:  # noqa: BLE001 - the request fails, the loop goes on
            log.exception("prefill of request %r failed", live.request_id)
            if self.engine.state_lost():
                self._recover_engine(f"engine state lost in a failed prefill: {exc!r}", spare=live)
            self._finish(live, FinishReason.ERROR, f"prefill failed: {exc!r}")
            return
        took = self.clock() - began
        self.seconds.prefill_chunks += 1
        self.seconds.prefill_s += took
        live.prefilled = start + n
        if is_last:
            live.running = True
            if live.first_token_at is None:
                live.first_token_at = self.clock()
            if p.logprobs is None:
                self._deliver(live, [first])
            else:  # the engine's top alternatives, cut to the request's
                entry = self.engine.first_token_logprobs(live.slot)
                self._deliver(live, [first], [dataclasses.replace(entry, top=entry.top[:p.logprobs])])

    def _view(self, rows: list[_Live], previous: _InFlight | None = None) -> tuple[BatchView, list[int]]:
        """What the policy sees of `rows`, and each row's cache room (the largest k it can verify)."""
        engine = self.engine
        slots = [r.slot for r in rows]
        room = [engine.room(s) for s in slots]  # from the length bound: after `previous` commits its most tokens
        plans = [engine.catch_up_plan(s) for s in slots]  # what a speculating step would first feed the draft
        rates, assumed = (), ()
        if self.suffix_index is not None:  # each row's chain, ready for the step, and its confidence
            k_max = max(engine.menu.k_menu)
            self._chains, self._guesses, assumed_rates = [], [], []
            for r in rows:
                i = None if previous is None else previous.row_of(r)
                if i is None:  # its context is read
                    chain, guess, confidences = self.suffix_index.propose(r.request_id, k_max), None, ()
                else:  # its step in flight: proposed ahead (only with SuffixConfig.ahead: `_overlap`)
                    chain, guess, confidences = self._chain_ahead(r, previous, i, k_max)
                self._chains.append(chain)
                self._guesses.append(guess)
                assumed_rates.append(confidences)
            rates = tuple(c.probs for c in self._chains)
            assumed = tuple(assumed_rates) if any(assumed_rates) else ()
        view = BatchView(
            request_ids=tuple(r.request_id for r in rows),
            context_lens=tuple(engine.length(s) for s in slots),
            # no more proposals than the cache holds, nor than tokens still wanted after the bonus one
            row_max_k=tuple(max(0, min(c, (r.output.remaining if previous is None else previous.wanted(r)) - 1))
                            for r, c in zip(rows, room)),
            k_menu=engine.menu.k_menu,
            batch_bucket=engine.menu.batch_bucket(len(rows)),
            catch_up_calls=tuple(len(plan) for plan in plans),
            catch_up_tokens=tuple(sum(call.key.chunk for call in plan) for plan in plans),
            trees=engine.menu.tree_envelopes,
            proposal_rates=rates,
            assumed_rates=assumed,
        )
        return view, room

    def _chain_ahead(self, live: _Live, previous: _InFlight, i: int, k_max: int
                     ) -> tuple[SuffixProposal, _Guess | None, tuple[float, ...]]:
        """A row in flight in `previous` (its i-th row): the chain proposed for the context that step commits if
        it accepts the proposals it verifies and its bonus token is the trie's next one, the guess, and the
        guessed tokens' confidences (docs/design.md, "The overlapped loop"). No chain when nothing continues."""
        index, rid = self.suffix_index, live.request_id
        before = previous.chains[i]
        p = min(previous.cap(i), len(before.tokens))  # the proposals the step in flight verifies
        if not self._guess_held(live, previous.guesses[i]):
            # its own chain was made for a context that never was (the step before it is read): its proposals will
            # fail, so assume it commits its bonus token alone (else every later guess would build on a wrong one)
            before, p = SuffixProposal(), 0
        tokens, confidences = list(before.tokens[:p]), list(before.probs[:p])
        bonus = SuffixProposal(before.tokens[p:p + 1], before.probs[p:p + 1]) if len(before.tokens) > p \
            else index.propose(rid, 1, assumed=tokens)
        if not bonus.tokens:
            return SuffixProposal(), None, ()
        tokens.append(bonus.tokens[0])
        confidences.append(bonus.probs[0])
        chain = index.propose(rid, k_max, assumed=tokens)
        if not chain.tokens:
            return chain, None, ()
        return chain, _Guess(index.context_len(rid), tuple(tokens)), tuple(confidences)

    def _guess_held(self, live: _Live, guess: _Guess | None) -> bool:
        """Whether a row's context holds what its chain assumed (True for a chain made on the context read)."""
        return guess is None or self.suffix_index.context_holds(live.request_id, guess.at, guess.tokens)

    def _observed_view(self, step: _InFlight, live: list[bool]) -> BatchView:
        """The view the policy observes a step with: a row whose chain was proposed ahead keeps its confidences
        only if its guess held (the step before committed the guessed tokens); otherwise its chain was made for
        a context that never was, and says nothing of how the proposer's confidences hold."""
        if not any(g is not None for g in step.guesses):
            return step.view
        rates = list(step.view.proposal_rates)
        for i, (row, guess) in enumerate(zip(step.rows, step.guesses, strict=True)):
            if guess is not None and not (live[i] and self._guess_held(row, guess)):
                rates[i] = ()
        return dataclasses.replace(step.view, proposal_rates=tuple(rates), assumed_rates=())

    def _host_proposals(self, rows: list[_Live]):
        """The engine's callback for the step's host proposals (suffix decoding): the chains `_view` made, or
        trees built for the envelope the step runs."""
        index, chains = self.suffix_index, self._chains

        def proposals(k: int, tree) -> HostProposals:
            if tree is not None:
                return host_proposals(index, [r.request_id for r in rows], k, tree)
            n = len(rows)
            tokens, lens = np.zeros((n, k), np.int32), np.zeros((n,), np.int32)
            for i, chain in enumerate(chains):
                used = chain.tokens[:k]
                tokens[i, :len(used)], lens[i] = used, len(used)
            return HostProposals(token_ids=tokens, lens=lens, parents=np.zeros_like(tokens),
                                 depth=np.zeros_like(tokens))

        return proposals

    def _decode(self) -> bool:
        """Dispatch a step over the rows that may join it, then read the step dispatched before it (overlapped)
        or this one (synchronous)."""
        previous, self._in_flight = self._in_flight, None
        rows = self._dispatchable(previous)
        if rows:
            self._in_flight = self._dispatch(rows, previous)
        if previous is not None:
            self._read(previous)
        if not self._overlap and self._in_flight is not None:
            current, self._in_flight = self._in_flight, None
            self._read(current)
        return bool(rows) or previous is not None

    def _dispatchable(self, previous: _InFlight | None) -> list[_Live]:
        """Running rows, by slot, that may join the next step while `previous` is unread: a row not in it, or one
        that still wants a token after `previous` commits its most tokens, its cap in the step then set from that
        bound (`_view`). A policy whose caps must be the synchronous loop's (`Policy.exact_caps_k`) also needs the
        bound to leave its k; a row that fails either sits this step out and joins the one after, with its counts
        read. When the bound would lower every row's cap below the k `previous` runs, none joins: the loop reads
        `previous` first (the step then runs with the caps the counts give, and only its overlap is lost). Below
        the menu's largest k instead, a policy at k = 0 lost its overlap near every request's end, and
        `fixed:0` on a draft's engine ran 1.03-1.05x the latency of `none` (docs/benchmarks.md, "Right-sized
        draft catch-up")."""
        running = sorted((r for r in self._slots.values() if r.running), key=lambda r: r.slot)
        if previous is None:
            return running
        exact_k = self.policy.exact_caps_k(self.engine.menu.k_menu)
        rows, lowered = [], 0
        for live in running:
            if previous.row_of(live) is None:
                rows.append(live)
                continue
            bound_cap = min(self.engine.room(live.slot), previous.wanted(live) - 1)
            if bound_cap >= exact_k:  # (>= 0: it still wants a token)
                rows.append(live)
                lowered += bound_cap < previous.decision.k
        return rows if lowered < len(rows) else []

    def _dispatch(self, rows: list[_Live], previous: _InFlight | None = None) -> _InFlight | None:
        """policy.choose then engine.dispatch_step for `rows`; when the page pool cannot take the step, the
        youngest request is preempted and the others try again. None when no step ran (the rows failed, or none
        is left)."""
        while rows:
            try:
                return self._dispatch_rows(rows, previous)
            except PagesExhaustedError as exc:
                if len(self._slots) == 1:  # nobody to make room for it
                    self._fail_all(rows, f"the KV page pool cannot hold this request's context: {exc}")
                    return None
                victim = max(self._slots.values(), key=lambda live: live.age)
                self._preempt(victim)
                rows = [r for r in rows if r is not victim]
        return None

    def _preempt(self, live: _Live) -> None:
        """Give back a request's slot and pages; it waits at the head of the queue with its prompt and output so
        far as the context to recompute (a step in flight that holds it delivers nothing to it)."""
        self.engine.free(live.slot)
        del self._slots[live.slot]
        live.slot, live.prefilled, live.running = None, 0, False
        live.context = tuple(live.request.prompt_token_ids) + live.output.token_ids
        live.preemptions += 1
        self.preemptions += 1
        with self._lock:
            self._waiting.appendleft(live)
        log.info("preempted request %r (%d context tokens) for KV pages", live.request_id, len(live.context))

    def _dispatch_rows(self, rows: list[_Live], previous: _InFlight | None = None) -> _InFlight | None:
        """One try of `_dispatch`: raises PagesExhaustedError with nothing started."""
        view, room = self._view(rows, previous)
        began = self.clock()
        try:
            decision = self.policy.choose(view)
            self._check_decision(decision, view, room)
        except Exception as exc:  # noqa: BLE001
            log.exception("policy.choose failed")
            self._fail_all(rows, f"policy {self.policy.name!r} failed: {exc!r}")
            return None
        finally:
            self.seconds.policy_s += self.clock() - began
        slots = [r.slot for r in rows]
        t0 = self.clock()
        try:
            extra = {} if self.suffix_index is None else {"host_proposals": self._host_proposals(rows),
                                                          "proposals_ahead": self._overlap}
            pending = self.engine.dispatch_step(slots, decision.k,
                                                list(decision.row_k) if decision.row_k is not None else None, **extra)
            if pending.catch_up_s > 0:
                self._catch_ups.append((self.clock(), pending.catch_up_s))
        except PagesExhaustedError:
            raise
        except Exception as exc:  # noqa: BLE001
            log.exception("engine step failed")
            self._recover_engine(f"engine step failed: {exc!r}")
            return None
        return _InFlight(rows, slots, view, decision, pending, t0, self._chains, self._guesses)

    def _read(self, step: _InFlight) -> None:
        """Read a dispatched step: publish it, let the policy observe it, deliver the rows still live."""
        live = [self._slots.get(slot) is row for row, slot in zip(step.rows, step.slots)]  # not finished meanwhile
        try:
            result = step.pending.result()
        except Exception as exc:  # noqa: BLE001
            log.exception("engine step failed")
            if any(live) or self.engine.state_lost():
                self._recover_engine(f"engine step failed: {exc!r}")
            return
        now = self.clock()
        start, end = max(step.dispatched_at, self._last_read_at), now if step.ready_at is None else step.ready_at
        catch_up = sum(seconds for at, seconds in self._catch_ups if start <= at <= end)
        self._catch_ups = [(at, seconds) for at, seconds in self._catch_ups if at > now]
        stats = StepStats(step.view, step.decision, result, max(0.0, end - start), catch_up)
        self._last_read_at = now
        self.steps_run += 1
        self.seconds.decode_steps += 1
        self.seconds.decode_s += stats.elapsed_s
        self._publish(stats)
        began = self.clock()
        try:  # the policy's cost model times the step executable: lazy catch-up is not part of it
            self.policy.observe(self._observed_view(step, live), step.decision, result, stats.executable_s)
            for row, alive in zip(step.rows, live):
                if not alive:  # finished after this step was dispatched: observing it must not bring it back
                    self.policy.forget(row.request_id)
        except Exception as exc:  # noqa: BLE001
            log.exception("policy.observe failed")
            self._fail_all([r for r, alive in zip(step.rows, live) if alive],
                           f"policy {self.policy.name!r} failed to observe a step: {exc!r}")
            return
        finally:
            self.seconds.policy_s += self.clock() - began
        for i, (row, alive) in enumerate(zip(step.rows, live)):
            if alive and row.slot is not None:  # (a row before it in this loop cannot free it, but be exact)
                row.steps.append(StepRecord(k=step.cap(i), proposed=int(result.proposed[i]),
                                            accepted=int(result.accepted[i])))
                n_top = row.request.params.logprobs
                self._deliver(row, result.row_tokens(i), None if n_top is None else result.row_logprobs(i, n_top))

    def _publish(self, stats: StepStats) -> None:
        for listener in self._step_listeners:
            try:
                listener(stats)
            except Exception:  # noqa: BLE001 - an observer must not fail requests
                log.exception("step listener %r failed", listener)

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

    def _deliver(self, live: _Live, tokens: list[int], logprobs: list[TokenLogprobs] | None = None) -> None:
        """Pass a row's new tokens (and their log-probabilities) through its output processor, stream them, retire
        it if finished."""
        if self.suffix_index is not None:  # every committed token, as the slot's history holds it
            self.suffix_index.extend(live.request_id, tokens)
        try:
            delta = live.output.push(tokens)
        except Exception as exc:  # noqa: BLE001 - e.g. a tokenizer error: only this request fails
            log.exception("post-processing request %r failed", live.request_id)
            self._finish(live, FinishReason.ERROR, f"post-processing failed: {exc!r}")
            return
        kept = tuple(logprobs[:len(delta.token_ids)]) if logprobs is not None else ()  # the tokens push kept
        live.logprobs.extend(kept)
        if delta.finish_reason is None:
            live.handle.publish(RequestOutput(live.request_id, delta.token_ids, delta.text, logprobs=kept), live.stream)
        else:
            self._finish(live, delta.finish_reason, new_tokens=delta.token_ids, new_text=delta.text, new_logprobs=kept)

    # --- retiring and failures -------------------------------------------------------------

    def _finish(self, live: _Live, reason: FinishReason, error: str | None = None,
                new_tokens: tuple[int, ...] = (), new_text: str = "",
                new_logprobs: tuple[TokenLogprobs, ...] = ()) -> None:
        now = self.clock()
        try:
            new_text += live.output.finish()
        except Exception as exc:  # noqa: BLE001
            reason, error = FinishReason.ERROR, error or f"detokenisation failed: {exc!r}"
        if live.slot is not None:
            del self._slots[live.slot]
            self.engine.free(live.slot)
            live.slot = None
        if live.admitted is not None:  # (a preempted request waiting again holds no slot, but was admitted)
            if self.suffix_index is not None:  # a finished output stays for later requests; a cancelled one goes
                self.suffix_index.finish(live.request_id, keep=reason in KEPT_OUTPUTS)
            try:
                self.policy.forget(live.request_id)
            except Exception:  # noqa: BLE001 - a policy bug must not leak the request
                log.exception("policy.forget(%r) failed", live.request_id)
        tokens, first = live.output.token_ids, live.first_token_at
        n = len(tokens)
        timings = RequestTimings(
            queued_s=None if live.admitted is None else live.admitted - live.arrival,
            ttft_s=None if first is None else first - live.arrival,
            tpot_s=(now - first) / (n - 1) if first is not None and n > 1 else None,
            total_s=now - live.arrival,
        )
        result = RequestResult(
            request_id=live.request_id, token_ids=tokens, text=live.output.text, finish_reason=reason, error=error,
            prompt_len=len(live.request.prompt_token_ids), seed=live.seed, steps=tuple(live.steps), timings=timings,
            logprobs=tuple(live.logprobs), cached_prompt_tokens=live.cached_prompt_tokens or 0,
            preemptions=live.preemptions)
        with self._lock:
            self._live.pop(live.request_id, None)
            self._cancel_ids.discard(live.request_id)
        live.handle.publish(RequestOutput(live.request_id, tuple(new_tokens), new_text, True, result, new_logprobs),
                            live.stream)

    def _fail_all(self, lives: Iterable[_Live], error: str) -> None:
        for live in list(lives):
            self._finish(live, FinishReason.ERROR, error)

    def _recover_engine(self, error: str, spare: _Live | None = None) -> None:
        """Reset the engine: running requests fail; requests still prefilling start over; a step in flight
        is dropped."""
        self.engine.reset()
        self._in_flight = None
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
        step, self._in_flight = self._in_flight, None
        if step is not None:  # its rows are finished: read it only so that the engine holds nothing of it
            try:
                step.pending.result()
            except Exception:  # noqa: BLE001 - nothing is left to fail
                log.exception("reading an abandoned step failed")
