"""Call admission for the gRPC server: no client can hold a worker thread or starve health.

`CallGuard` (a server interceptor) makes every handler request-streaming so it starts before the
request message arrives, awaits that message for at most `request_timeout_s` (`Alarms` cancels
late ones), caps the calls waiting for theirs (in all and per connection), and checks the message's
size, that it deserialises and that a unary call sends only one. Health calls run on their own thread
pool, outside those caps; the oldest waiting health call makes room for a new one.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

import grpc

from jaxspec.serving.auth import HEALTH_PREFIX
from jaxspec.serving.metrics import ServingMetrics
from jaxspec.serving.wire import abort, clip

log = logging.getLogger(__name__)
DEADLINE_SLACK_S = 0.05  # a call that ends this close to its deadline counts as DEADLINE_EXCEEDED


class Alarms:
    """One thread that runs each armed callback at its deadline, unless it was disarmed first."""

    def __init__(self):
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, list]] = []  # (deadline, tie-break, [callback or None])
        self._ids = itertools.count()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="jaxspec-alarms", daemon=True)
        self._thread.start()

    def arm(self, delay_s: float, callback: Callable[[], None]) -> list:
        entry = [callback]
        with self._cond:
            heapq.heappush(self._heap, (time.monotonic() + delay_s, next(self._ids), entry))
            self._cond.notify()
        return entry

    def disarm(self, entry: list) -> None:
        with self._cond:
            entry[0] = None

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join()

    def _run(self) -> None:
        while True:
            with self._cond:
                while True:
                    while self._heap and self._heap[0][2][0] is None:  # disarmed
                        heapq.heappop(self._heap)
                    if self._closed:
                        return
                    if not self._heap:
                        self._cond.wait()
                        continue
                    wait = self._heap[0][0] - time.monotonic()
                    if wait <= 0:
                        break
                    self._cond.wait(wait)
                entry = heapq.heappop(self._heap)[2]
                callback, entry[0] = entry[0], None
            try:
                callback()
            except Exception:  # noqa: BLE001 - one failed callback must not stop the others
                log.exception("an alarm callback failed")


CANCEL_SETTLE_S = 0.2  # after a request stream ends without a message, how long to wait for the call's end
#                        (a client's cancel can end the stream a moment before it ends the call)
# a connection past max_pending_per_peer waiting calls is refused once its oldest has waited this long (a
# client that sends its messages has each answered in milliseconds; a half-open call ages)
PEER_GRACE_S = 0.5


class CallGuard(grpc.ServerInterceptor):
    """Rewrites every method's handler so that no client can hold a thread or starve health.

    The rewritten handler is request-streaming (the wire format of a unary request is the same), so
    gRPC starts it before the request message and does not deserialise it. The handler then awaits
    each request message for at most `timeout_s` (else it cancels the call: the client sees
    CANCELLED), refuses a message over `max_bytes` or one that does not deserialise
    (INVALID_ARGUMENT), refuses a second message to a unary method (INVALID_ARGUMENT), and only
    then calls the method's own behaviour. Calls other than health that wait for a message are
    capped: `max_pending` in all; per connection, at most half of those, and past `max_pending_per_peer`
    only while the connection's oldest waiting call is younger than PEER_GRACE_S (a client that sends its
    messages, however many calls it opens at once, is not refused; one that leaves calls half-open holds
    `max_pending_per_peer` places once they age). More: RESOURCE_EXHAUSTED at once, with a retry pushback.
    Health calls run on `health_pool`, outside those caps; at most
    `max_health_waiting` of them wait for a message at once, and a new one cancels the oldest
    waiting one, so the pool always has threads free to answer. Runs after the auth interceptor,
    which refuses calls without the token before any of this.
    """

    def __init__(self, *, timeout_s: float, max_pending: int, max_pending_per_peer: int, max_bytes: int,
                 health_pool: futures.ThreadPoolExecutor, max_health_waiting: int, metrics: ServingMetrics):
        self._timeout_s = timeout_s
        self._max_pending = max_pending
        self._max_per_peer = max_pending_per_peer
        self._max_bytes = max_bytes
        self._health_pool = health_pool
        self._max_health_waiting = max_health_waiting
        self._metrics = metrics
        self._lock = threading.Lock()
        self._pending = 0
        self._waiting_by_peer: dict[str, dict[int, float]] = {}  # peer -> call key -> when it started waiting
        self._health_waiting: dict[int, grpc.ServicerContext] = {}  # insertion order = oldest first
        self._ids = itertools.count()
        self._alarms = Alarms()

    @property
    def pending(self) -> int:
        """Calls (health excluded) now waiting for a request message."""
        with self._lock:
            return self._pending

    def close(self) -> None:
        self._alarms.close()

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None  # gRPC answers UNIMPLEMENTED itself, without a worker thread
        method = handler_call_details.method
        health = method.startswith(HEALTH_PREFIX)
        return self._rewrite(handler, method, self._health_pool if health else None, counted=not health)

    def _rewrite(self, handler: grpc.RpcMethodHandler, method: str, pool: futures.ThreadPoolExecutor | None,
                 counted: bool) -> grpc.RpcMethodHandler:
        decode = handler.request_deserializer
        if handler.request_streaming:
            inner = handler.stream_stream if handler.response_streaming else handler.stream_unary

            def behaviour(requests, context, *callback):
                return inner(self._messages(requests, context, method, decode, counted), context, *callback)
        else:
            inner = handler.unary_stream if handler.response_streaming else handler.unary_unary

            def behaviour(requests, context, *callback):
                data = self._receive(requests, context, method, counted, unary=True)
                return inner(self._decode(data, context, method, decode, counted), context, *callback)

        for name in ("experimental_non_blocking", "experimental_thread_pool"):  # health's Watch sets these
            if hasattr(inner, name):
                setattr(behaviour, name, getattr(inner, name))
        if pool is not None:
            behaviour.experimental_thread_pool = pool
        make = grpc.stream_stream_rpc_method_handler if handler.response_streaming else \
            grpc.stream_unary_rpc_method_handler
        return make(behaviour, request_deserializer=None, response_serializer=handler.response_serializer)

    def _messages(self, requests, context, method, decode, counted) -> Iterator[Any]:
        while (data := self._receive(requests, context, method, counted, unary=False)) is not None:
            yield self._decode(data, context, method, decode, counted)

    def _receive(self, requests, context: grpc.ServicerContext, method: str, counted: bool,
                 unary: bool) -> bytes | None:
        """The next request message (None: the client sent no more; unary: the only one, refused
        unless the stream then ends), awaited for at most timeout_s. A call that ends meanwhile
        (the client cancelled, its deadline, the timeout) is counted here and re-raises."""
        with self._waiting(context, method, counted):
            alarm = self._alarms.arm(self._timeout_s, lambda: self._expire(context, method))
            try:
                data = next(requests, None)  # raises grpc.RpcError once the call is cancelled
                if unary and data is not None and next(requests, None) is not None:
                    self._refuse(context, method, counted, grpc.StatusCode.INVALID_ARGUMENT,
                                 "a unary method takes exactly one request message; the client sent more")
            except grpc.RpcError:
                self._count_ended(context, method, counted)
                raise
            finally:
                self._alarms.disarm(alarm)
        if unary and data is None:
            if _ends_soon(context):  # a cancel that closed the stream first
                self._count_ended(context, method, counted)
                abort(context, grpc.StatusCode.CANCELLED, "the call was cancelled")
            self._refuse(context, method, counted, grpc.StatusCode.INVALID_ARGUMENT,
                         "the call ended without a request message")
        return data

    @contextlib.contextmanager
    def _waiting(self, context: grpc.ServicerContext, method: str, counted: bool):
        """Hold one of the places of calls awaiting a message (refused when the caps are reached);
        for health, a place among the waiting health calls (the oldest one is cancelled to make room)."""
        if not counted:
            key = next(self._ids)
            with self._lock:
                self._health_waiting[key] = context
                evicted = []
                while len(self._health_waiting) > self._max_health_waiting:
                    evicted.append(self._health_waiting.pop(next(iter(self._health_waiting))))
            for old in evicted:
                log.debug("health: %d calls await their request message: the oldest is cancelled",
                          self._max_health_waiting)
                old.cancel()
            try:
                yield
            finally:
                with self._lock:
                    self._health_waiting.pop(key, None)
            return
        peer = context.peer()
        key = next(self._ids)
        with self._lock:
            refusal = None
            waiting = self._waiting_by_peer.setdefault(peer, {})  # insertion order = oldest first
            now = time.monotonic()
            if self._pending >= self._max_pending:
                refusal = f"{self._max_pending} calls are already waiting for their request message " \
                          f"(max_pending_calls); retry later"
            elif len(waiting) >= max(self._max_per_peer, self._max_pending // 2):
                refusal = f"{len(waiting)} calls of this connection are already waiting for their request " \
                          f"message (half of max_pending_calls, per connection); retry later"
            elif len(waiting) >= self._max_per_peer and now - next(iter(waiting.values())) > PEER_GRACE_S:
                refusal = f"{len(waiting)} calls of this connection are waiting for their request message, the " \
                          f"oldest for over {PEER_GRACE_S} s (max_pending_calls_per_peer); retry later"
            else:
                self._pending += 1
                waiting[key] = now
            if not waiting:
                del self._waiting_by_peer[peer]
        if refusal is not None:
            self._metrics.record_rpc(method, grpc.StatusCode.RESOURCE_EXHAUSTED.name)
            abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED, refusal, retry_later=True)
        try:
            yield
        finally:
            with self._lock:
                self._pending -= 1
                waiting = self._waiting_by_peer[peer]
                del waiting[key]
                if not waiting:
                    del self._waiting_by_peer[peer]

    def _expire(self, context: grpc.ServicerContext, method: str) -> None:
        if context.is_active():
            log.debug("%s: no request message within %.1f s: cancelled", clip(method), self._timeout_s)
            self._metrics.record_request_timeout()
            context.cancel()  # the waiting thread counts it (CANCELLED)

    def _count_ended(self, context: grpc.ServicerContext, method: str, counted: bool) -> None:
        """Count a call that ended while awaiting its message: DEADLINE_EXCEEDED at its deadline,
        else CANCELLED (the client cancelled or left, or the request timeout cancelled it)."""
        if counted:
            remaining = context.time_remaining()
            expired = remaining is not None and remaining <= DEADLINE_SLACK_S
            self._metrics.record_rpc(method, "DEADLINE_EXCEEDED" if expired else "CANCELLED")

    def _decode(self, data: bytes, context, method: str, decode, counted: bool) -> Any:
        if len(data) > self._max_bytes:
            self._refuse(context, method, counted, grpc.StatusCode.INVALID_ARGUMENT,
                         f"the request is {len(data)} bytes; at most {self._max_bytes} bytes are accepted "
                         f"(max_message_bytes)")
        if decode is None:
            return data
        try:
            return decode(data)
        except Exception as exc:  # noqa: BLE001 - any deserialiser failure is the client's bad bytes
            self._refuse(context, method, counted, grpc.StatusCode.INVALID_ARGUMENT,
                         f"malformed request message: {clip(str(exc))}")

    def _refuse(self, context, method: str, counted: bool, code: grpc.StatusCode, message: str):
        if counted:
            self._metrics.record_rpc(method, code.name)
        abort(context, code, message)


def _ends_soon(context: grpc.ServicerContext) -> bool:
    """Whether the call ends within CANCEL_SETTLE_S (it was cancelled, and the stream closed first)."""
    deadline = time.monotonic() + CANCEL_SETTLE_S
    while context.is_active():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


__all__ = ["Alarms", "CallGuard"]
