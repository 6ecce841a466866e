"""Request and result values, the caller's handle, the scheduler's errors and the one request validator.

Everything here is plain host-side data: a `Request` goes in, `RequestOutput` events stream out through
a `RequestHandle`, and the last one carries the `RequestResult`. `validate_request` is the single place
that decides whether a request can run (the scheduler, the batch job, the gRPC server and the CLI all
call it), against the `RequestLimits` of an engine and tokenizer.
"""

from __future__ import annotations

import dataclasses
import enum
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

from jaxspec.types import SamplingParams, TokenLogprobs

# --- errors ----------------------------------------------------------------------------


class SchedulerError(Exception):
    """Base class of the scheduler's own errors."""


class InvalidRequestError(SchedulerError, ValueError):
    """The request cannot run (empty or over-long prompt, bad parameters, duplicate id).

    reason: why, without the request id (the message is "request <id>: <reason>" when the id is known).
    """

    def __init__(self, reason: str, request_id: str | None = None):
        super().__init__(reason if request_id is None else f"request {request_id!r}: {reason}")
        self.reason = reason
        self.request_id = request_id


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
    """One generation request; `prompt_token_ids` is already tokenised (and chat-templated). `tenant`: the API key
    or tenant it runs for (suffix decoding's 'tenant' scope shares outputs only within one)."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams = SamplingParams()
    tenant: str | None = None

    def __post_init__(self):
        object.__setattr__(self, "prompt_token_ids", tuple(int(t) for t in self.prompt_token_ids))


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
    logprobs:  one per token id when the request asked for them (params.logprobs), else ().
    cached_prompt_tokens: prompt tokens served from the prefix cache (not computed) at its admission.
    preemptions: times the request gave back its pages to others and had its context recomputed.
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
    logprobs: tuple[TokenLogprobs, ...] = ()
    cached_prompt_tokens: int = 0
    preemptions: int = 0

    @classmethod
    def rejected(cls, request: Request, reason: str) -> RequestResult:
        """The result of a request that never ran (e.g. it failed validation)."""
        return cls(request_id=request.request_id, token_ids=(), text=None, finish_reason=FinishReason.ERROR,
                   error=reason, prompt_len=len(request.prompt_token_ids), seed=0, steps=(),
                   timings=RequestTimings(queued_s=None, ttft_s=None, tpot_s=None, total_s=0.0))

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
            "cached_prompt_tokens": self.cached_prompt_tokens, "preemptions": self.preemptions,
            "steps": len(self.steps), "k": [s.k for s in self.steps],
            "proposed": self.proposed, "accepted": self.accepted, "acceptance": self.acceptance_rate,
            "seed": self.seed, "queued_s": t.queued_s, "ttft_s": t.ttft_s, "tpot_s": t.tpot_s,
            "total_s": t.total_s,
        }


@dataclasses.dataclass(frozen=True)
class RequestOutput:
    """A streamed event: the tokens and text a request gained (and the tokens' log-probabilities when the request
    asked for them); the last one has `finished` and `result`."""

    request_id: str
    token_ids: tuple[int, ...]
    text: str
    finished: bool = False
    result: RequestResult | None = None
    logprobs: tuple[TokenLogprobs, ...] = ()


class RequestHandle:
    """The caller's side of one request; safe to use from any thread.

    cancel: asks the owner (the scheduler) to cancel this request id; returns whether it was live.
    """

    def __init__(self, request_id: str, cancel: Callable[[str], bool]):
        self.request_id = request_id
        self._cancel = cancel
        self._events: queue.Queue[RequestOutput] = queue.Queue()
        self._done = threading.Event()
        self._result: RequestResult | None = None
        self._listener: Callable[[RequestOutput], None] | None = None
        self._listener_lock = threading.Lock()

    def listen(self, listener: Callable[[RequestOutput], None]) -> None:
        """Have the owner's thread call `listener(event)` for every event from now on, instead of queueing
        it (events queued before are passed at once, in order); `get` and iteration then see nothing. The
        listener must be quick and must not raise: e.g. `loop.call_soon_threadsafe` into an event loop, so
        events reach it without a thread of their own."""
        with self._listener_lock:
            if self._listener is not None:
                raise RuntimeError(f"request {self.request_id!r} already has a listener")
            while not self._events.empty():
                listener(self._events.get_nowait())
            self._listener = listener

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
        return self._cancel(self.request_id)

    def publish(self, event: RequestOutput, stream: bool) -> None:
        """The owner's side: queue an event (only the final one unless `stream`); the final one
        sets the result and wakes `result()`."""
        if event.finished:
            self._result = event.result
        if stream or event.finished:
            with self._listener_lock:
                if self._listener is None:
                    self._events.put(event)
                else:
                    self._listener(event)
        if event.finished:
            self._done.set()


# --- validation --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RequestLimits:
    """What a request must fit.

    max_len:               cache positions per slot: prompt + generated tokens ≤ max_len.
    vocab_size:            prompt token ids must be in [0, vocab_size).
    stop_strings_allowed:  a tokenizer exists (stop strings are matched on text).
    max_tokens_limit:      the largest max_tokens a request may ask for; None = no limit (it is
                           capped to the cache room either way).
    logprobs:              the engine's logprobs option: the most top alternatives a request may ask for; 0 = the
                           engine returns no log-probabilities.
    """

    max_len: int
    vocab_size: int
    stop_strings_allowed: bool
    max_tokens_limit: int | None = None
    logprobs: int = 0

    def __post_init__(self):
        if self.max_len < 2:
            raise ValueError(f"max_len must be >= 2, got {self.max_len}")
        if self.vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {self.vocab_size}")
        if self.max_tokens_limit is not None and self.max_tokens_limit < 1:
            raise ValueError(f"max_tokens_limit must be >= 1, got {self.max_tokens_limit}")

    @classmethod
    def for_engine(cls, engine: Any, tokenizer: Any, max_tokens_limit: int | None = None) -> RequestLimits:
        """The limits of an engine (`jaxspec.engine.api.EngineAPI`) with `tokenizer` (None: ids only)."""
        return cls(max_len=engine.menu.max_len, vocab_size=engine.vocab_size,
                   stop_strings_allowed=tokenizer is not None, max_tokens_limit=max_tokens_limit,
                   logprobs=engine.logprobs)


def validate_request(request: Request, limits: RequestLimits) -> int:
    """Raise InvalidRequestError (`reason` says why) unless `request` can run within `limits`;
    return its max new tokens, capped to the room the cache leaves."""
    rid, prompt, p = request.request_id, request.prompt_token_ids, request.params
    if not isinstance(rid, str) or not rid:
        raise InvalidRequestError(f"request_id must be a non-empty string, got {rid!r}")
    if not prompt:
        raise InvalidRequestError("empty prompt", rid)
    if len(prompt) >= limits.max_len:
        raise InvalidRequestError(f"prompt of {len(prompt)} tokens leaves no room to generate "
                                  f"(max_len {limits.max_len})", rid)
    bad = [t for t in prompt if not 0 <= t < limits.vocab_size]
    if bad:
        raise InvalidRequestError(f"token ids outside [0, {limits.vocab_size}): {bad[:5]}", rid)
    try:
        p.validate(max_tokens_limit=limits.max_tokens_limit)
    except ValueError as exc:
        raise InvalidRequestError(str(exc), rid) from None
    if any(not isinstance(s, str) or not s for s in p.stop_strings):
        raise InvalidRequestError("stop strings must be non-empty strings", rid)
    if p.stop_strings and not limits.stop_strings_allowed:
        raise InvalidRequestError("stop strings need a tokenizer", rid)
    if p.logprobs is not None and not limits.logprobs:
        raise InvalidRequestError("logprobs are off on this engine (serve with --logprobs N to allow them)", rid)
    if p.logprobs is not None and p.logprobs > limits.logprobs:
        raise InvalidRequestError(f"logprobs must be <= {limits.logprobs} on this engine (--logprobs), "
                                  f"got {p.logprobs}", rid)
    return min(p.max_tokens, limits.max_len - len(prompt))
