"""`jaxspec serve`: the gRPC endpoint — jaxspec.v1.Generation, health, reflection, Prometheus metrics.

Threads:
    gRPC workers    one per live call: parse, validate and tokenise the request, submit it to the
                    scheduler, then relay its events (a thread-safe queue per request) as messages
    health workers  the health service's own threads: no other call can occupy them
    alarms          one thread that cancels calls whose request message is late (`_Alarms`)
    engine thread   `Scheduler.run_forever`, the only thread that touches the engine
    metrics         prometheus_client's HTTP server (with --metrics-port)

Calls (`_CallGuard`): gRPC hands every handler the call before its request message (they are all
registered request-streaming), so an unauthenticated call is refused from its metadata alone; the
request message must then arrive within `request_timeout_s`, else the call is cancelled; at most
`max_pending_calls` calls (health excluded) wait for theirs at once, more get RESOURCE_EXHAUSTED;
the guard checks the size (`max_message_bytes`: INVALID_ARGUMENT over it; gRPC's own transport limit
is twice that) and deserialises (malformed: INVALID_ARGUMENT). No half-open call holds a thread for
longer than the timeout, and health never shares a limit or a thread with other calls.

Lifecycle: bind (health NOT_SERVING, Generate answers UNAVAILABLE) -> warm up the whole menu (and,
for goodput policies, load or measure the cost profile) -> start the engine thread -> SERVING.
SIGTERM / SIGINT: NOT_SERVING, new calls get UNAVAILABLE, in-flight streams finish, exit 0. A
second signal cancels what is left (as does `drain_timeout_s` passing first): the process then logs
how many in-flight requests were dropped and exits 1. Bad input or configuration exits 2.

A client that cancels, disconnects or runs past its deadline has its request cancelled through
`context.add_callback`, so its slot is free before the engine's next step.
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import itertools
import logging
import queue
import secrets
import signal
import ssl
import sys
import threading
import time
from concurrent import futures
from pathlib import Path
from typing import Any, Callable, Iterator

import grpc
import yaml
from google.protobuf import descriptor as _descriptor
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from jaxspec.build import PROPOSERS
from jaxspec.config_file import check_fields
from jaxspec.engine import Engine
from jaxspec.policy.base import Policy
from jaxspec.scheduler import (FinishReason, InvalidRequestError, QueueFullError, Request, RequestHandle,
                               RequestResult, Scheduler, SchedulerClosedError, SchedulerConfig)
from jaxspec.types import SamplingParams
from serving.auth import HEALTH_PREFIX, TOKEN_ENV, BearerTokenInterceptor, resolve_token
from serving.metrics import MeteredPolicy, ServingMetrics
from serving.proto.jaxspec.v1 import generation_pb2 as pb

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name  # "jaxspec.v1.Generation"
DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "serving.yaml"
POLL_S = 0.25  # how often a relaying worker checks that its client is still there
DEADLINE_SLACK_S = 0.05  # a call that ends this close to its deadline counts as DEADLINE_EXCEEDED (the
#                          client's own timer cancels it a moment before the server's copy expires)
EXTRA_WORKERS = 16  # worker threads beyond queue + slots + pending calls: ListModels, reflection, rejections
HEALTH_WORKERS = 64  # the health service's own threads (made on demand), used by nothing else
TRANSPORT_LIMIT_FACTOR = 2  # gRPC's message limit is this × max_message_bytes: the guard answers in between
ECHO_CHARS = 200  # a client's value echoed in a status message is cut to this many characters
DETAILS_CHARS = 1000  # a status message is cut to this many characters
FINISH_REASONS = {FinishReason.EOS: pb.FINISH_REASON_EOS, FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
                  FinishReason.STOP: pb.FINISH_REASON_STOP}

TokenizerLike = Any  # encode / token_bytes / eos_token_ids / apply_chat_template (TextTokenizer or a toy)
PolicyFactory = Callable[[Engine], Policy]


# --- configuration -----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    """Everything `jaxspec serve` takes; configs/serving.yaml and `--config` files use these keys.

    model / proposer / draft / policy / menu:  as for every engine command (serving.runtime); policy
        None = goodput with a proposer, else none; menu: a configs/engine.yaml name or a YAML path
    tokenizer:          'model' (the model's own), or a toy one for random-weight presets: 'ascii', 'bytes'
    metrics_port:       None = no metrics endpoint; 0 = an ephemeral port
    max_tokens_limit:   the largest max_tokens a request may ask for; default_max_tokens when it asks none
    max_queue:          requests waiting for a slot before calls get RESOURCE_EXHAUSTED
    max_running:        requests in slots at once (None: the largest batch bucket)
    max_stop_strings / max_stop_chars / max_message_bytes:  request size limits (a request message
        over max_message_bytes gets INVALID_ARGUMENT; gRPC itself refuses one over twice that)
    request_timeout_s:  a call's request message must arrive within this many seconds, else the
        call is cancelled (half-open calls must not hold threads)
    max_pending_calls:  calls (health checks excluded) waiting for their request message at once;
        more get RESOURCE_EXHAUSTED at once
    drain_timeout_s:    how long SIGTERM waits for in-flight requests
    tls_cert, tls_key:  PEM files (both or neither); auth_token: required bearer token (None: no auth)
    """

    model: str | None = None
    proposer: str = "none"
    draft: str | None = None
    policy: str | None = None
    menu: str = "default"
    tokenizer: str = "model"
    host: str = "127.0.0.1"
    port: int = 50051
    metrics_port: int | None = None
    max_tokens_limit: int = 1024
    default_max_tokens: int = 128
    max_queue: int = 256
    max_running: int | None = None
    max_stop_strings: int = 8
    max_stop_chars: int = 256
    max_message_bytes: int = 1 << 20
    request_timeout_s: float = 5.0
    max_pending_calls: int = 64
    drain_timeout_s: float = 120.0
    tls_cert: str | None = None
    tls_key: str | None = None
    auth_token: str | None = None

    def __post_init__(self):
        for name in ("port", "metrics_port"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= 65535:
                raise ValueError(f"{name} must be in [0, 65535], got {value}")
        for name in ("max_tokens_limit", "default_max_tokens", "max_queue", "max_stop_chars", "max_message_bytes",
                     "max_pending_calls"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_stop_strings < 0:
            raise ValueError(f"max_stop_strings must be >= 0, got {self.max_stop_strings}")
        if self.max_running is not None and self.max_running < 1:
            raise ValueError(f"max_running must be >= 1, got {self.max_running}")
        if self.default_max_tokens > self.max_tokens_limit:
            raise ValueError(f"default_max_tokens={self.default_max_tokens} exceeds "
                             f"max_tokens_limit={self.max_tokens_limit}")
        for name in ("drain_timeout_s", "request_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("TLS needs both tls_cert and tls_key (or neither)")
        if self.auth_token is not None and not self.auth_token:
            raise ValueError("auth_token must be non-empty when set")
        if self.max_message_bytes * TRANSPORT_LIMIT_FACTOR >= 1 << 31:
            raise ValueError(f"max_message_bytes must be < {(1 << 31) // TRANSPORT_LIMIT_FACTOR}, "
                             f"got {self.max_message_bytes}")


def load_serve_config(path: str | Path | None = None, **overrides) -> ServeConfig:
    """ServeConfig defaults <- the YAML file at `path` <- `overrides` that are not None."""
    values: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"serving config {path} does not exist")
        values.update(check_fields(ServeConfig, yaml.safe_load(path.read_text()) or {}, path))
    values.update({k: v for k, v in overrides.items() if v is not None})
    return ServeConfig(**values)


# --- request handling --------------------------------------------------------------------


class RpcError(Exception):
    """Ends a call with `code` and `message` (the handlers turn it into context.abort)."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


def _invalid(message: str) -> RpcError:
    return RpcError(grpc.StatusCode.INVALID_ARGUMENT, message)


def clip(text: str, limit: int = ECHO_CHARS) -> str:
    """`text`, cut to `limit` characters with an ellipsis."""
    return text if len(text) <= limit else text[:limit] + "…"


def shown(value: object) -> str:
    """How a client's value appears in a status message: its repr, cut to ECHO_CHARS characters."""
    return clip(repr(value))


def _abort(context: grpc.ServicerContext, code: grpc.StatusCode, message: str):
    """End the call (raises); the message is cut to DETAILS_CHARS, whatever it echoes."""
    context.abort(code, clip(message, DETAILS_CHARS))


def parse_generate_request(data: bytes) -> pb.GenerateRequest:
    """Deserialise a GenerateRequest; malformed bytes (e.g. invalid UTF-8 in a string field, which
    protobuf refuses) raise INVALID_ARGUMENT naming the field, not gRPC's generic INTERNAL."""
    try:
        return pb.GenerateRequest.FromString(data)
    except DecodeError as exc:
        field = _bad_utf8_field(data, pb.GenerateRequest.DESCRIPTOR)
        if field is not None:
            raise _invalid(f"field '{field}' is not valid UTF-8") from None
        raise _invalid(f"malformed GenerateRequest: {clip(str(exc))}") from None


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7


def _bad_utf8_field(data: bytes, message: _descriptor.Descriptor, prefix: str = "") -> str | None:
    """The path (e.g. 'messages[0].content') of the first string field whose bytes are not UTF-8."""
    seen: dict[int, int] = {}
    pos = 0
    try:
        while pos < len(data):
            key, pos = _varint(data, pos)
            number, wire = key >> 3, key & 7
            if wire == 0:
                _, pos = _varint(data, pos)
            elif wire in (1, 5):
                pos += 8 if wire == 1 else 4
            elif wire == 2:
                size, pos = _varint(data, pos)
                chunk, pos = data[pos:pos + size], pos + size
                field = message.fields_by_number.get(number)
                if field is None:
                    continue
                index = seen[number] = seen.get(number, -1) + 1
                name = prefix + field.name + (f"[{index}]" if _is_repeated(field) else "")
                if field.type == _descriptor.FieldDescriptor.TYPE_STRING:
                    try:
                        chunk.decode("utf-8")
                    except UnicodeDecodeError:
                        return name
                elif field.type == _descriptor.FieldDescriptor.TYPE_MESSAGE:
                    found = _bad_utf8_field(chunk, field.message_type, name + ".")
                    if found is not None:
                        return found
            else:
                return None
    except IndexError:
        return None
    return None


def _is_repeated(field: _descriptor.FieldDescriptor) -> bool:
    repeated = getattr(field, "is_repeated", None)  # newer protobuf; `label` is deprecated there
    return bool(repeated) if repeated is not None else field.label == field.LABEL_REPEATED


def check_tls_pair(cert: str | Path, key: str | Path) -> None:
    """Raise ValueError unless `key` is the unencrypted PEM private key of the PEM certificate chain
    `cert` (gRPC would only say that it cannot bind); FileNotFoundError for a missing file."""
    for path, marker, what in ((cert, b"-----BEGIN CERTIFICATE-----", "certificate"),
                               (key, b"PRIVATE KEY-----", "private key")):
        if not Path(path).is_file():
            raise FileNotFoundError(f"TLS file {path} does not exist")
        if marker not in Path(path).read_bytes():
            raise ValueError(f"TLS file {path} holds no PEM {what}")

    def encrypted() -> bytes:
        raise ValueError(f"TLS key {key} is encrypted; gRPC needs an unencrypted PEM key")

    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(str(cert), str(key), password=encrypted)
    except ssl.SSLError as exc:
        if exc.reason == "KEY_VALUES_MISMATCH":
            raise ValueError(f"TLS key {key} does not match the certificate {cert}") from None
        raise ValueError(f"cannot load the TLS certificate {cert} with key {key}: {exc.reason or exc}") from None


def _stats(result: RequestResult) -> pb.RequestStats:
    t = result.timings
    stats = pb.RequestStats(prompt_tokens=result.prompt_len, completion_tokens=len(result.token_ids),
                            steps=len(result.steps), proposed_tokens=result.proposed,
                            accepted_tokens=result.accepted, total_s=t.total_s, seed=result.seed)
    for name, value in (("acceptance", result.acceptance_rate), ("time_to_first_token_s", t.ttft_s),
                        ("time_per_output_token_s", t.tpot_s), ("queued_s", t.queued_s)):
        if value is not None:
            setattr(stats, name, value)
    return stats


def _has_chat_template(tokenizer: TokenizerLike) -> bool:
    return hasattr(tokenizer, "apply_chat_template") and getattr(tokenizer, "chat_template", "") is not None


# --- call admission ------------------------------------------------------------------------


class _Alarms:
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


class _CallGuard(grpc.ServerInterceptor):
    """Rewrites every method's handler so that no client can hold a thread or starve health.

    The rewritten handler is request-streaming (the wire format of a unary request is the same), so
    gRPC starts it before the request message and does not deserialise it. The handler then awaits
    each request message for at most `timeout_s` (else it cancels the call: the client sees
    CANCELLED), refuses a message over `max_bytes` or one that does not deserialise
    (INVALID_ARGUMENT), and only then calls the method's own behaviour. At most `max_pending` calls
    other than health wait for a message at once (more: RESOURCE_EXHAUSTED at once). Health calls
    run on `health_pool`, outside that limit. Runs after the auth interceptor, which refuses calls
    without the token before any of this.
    """

    def __init__(self, *, timeout_s: float, max_pending: int, max_bytes: int,
                 health_pool: futures.ThreadPoolExecutor, metrics: ServingMetrics):
        self._timeout_s = timeout_s
        self._max_pending = max_pending
        self._max_bytes = max_bytes
        self._health_pool = health_pool
        self._metrics = metrics
        self._lock = threading.Lock()
        self._pending = 0
        self._alarms = _Alarms()

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
                data = self._receive(requests, context, method, counted)
                if data is None:
                    self._refuse(context, method, counted, grpc.StatusCode.INVALID_ARGUMENT,
                                 "the call ended without a request message")
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
        while (data := self._receive(requests, context, method, counted)) is not None:
            yield self._decode(data, context, method, decode, counted)

    def _receive(self, requests, context: grpc.ServicerContext, method: str, counted: bool) -> bytes | None:
        """The next request message (None: the client sent no more), awaited for at most timeout_s."""
        if counted:
            with self._lock:
                full = self._pending >= self._max_pending
                self._pending += not full
            if full:
                self._refuse(context, method, counted, grpc.StatusCode.RESOURCE_EXHAUSTED,
                             f"{self._max_pending} calls are already waiting for their request message "
                             f"(max_pending_calls); retry later")
        alarm = self._alarms.arm(self._timeout_s, lambda: self._expire(context, method, counted))
        try:
            return next(requests, None)  # raises grpc.RpcError once the call is cancelled
        finally:
            self._alarms.disarm(alarm)
            if counted:
                with self._lock:
                    self._pending -= 1

    def _expire(self, context: grpc.ServicerContext, method: str, counted: bool) -> None:
        if context.is_active():
            log.debug("%s: no request message within %.1f s: cancelled", clip(method), self._timeout_s)
            self._metrics.record_request_timeout()
            if counted:
                self._metrics.record_rpc(method, grpc.StatusCode.CANCELLED.name)
            context.cancel()

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
        _abort(context, code, message)


# --- the server ----------------------------------------------------------------------------


class GenerationServer:
    """One engine behind jaxspec.v1.Generation (+ health, reflection, metrics).

    policy: a Policy, or a factory called with the warmed-up engine (goodput policies profile it).
    `start()` binds, warms up and serves; `shutdown()` drains (or cancels) and stops.
    """

    def __init__(self, engine: Engine, tokenizer: TokenizerLike, policy: Policy | PolicyFactory | None,
                 config: ServeConfig = ServeConfig(), *, model_name: str | None = None,
                 metrics: ServingMetrics | None = None, progress: bool = False):
        if tokenizer is None:
            raise ValueError("the server needs a tokenizer (the Generate API takes text)")
        vocab = engine.model_config.vocab_size
        if getattr(tokenizer, "vocab_size", 0) > vocab:
            raise ValueError(f"the tokenizer has {tokenizer.vocab_size} ids but the model's vocabulary has {vocab}")
        self.engine = engine
        self.tokenizer = tokenizer
        self.config = config
        self.model_name = model_name or engine.model_config.name
        self.metrics = metrics or ServingMetrics(tuple(engine.config.k_menu))
        self._policy_source = policy
        self._progress = progress
        self.policy: Policy | None = None
        self.scheduler: Scheduler | None = None
        self._engine_thread: threading.Thread | None = None
        self._grpc: grpc.Server | None = None
        self._metrics_http = None
        self.port: int | None = None
        self.metrics_port: int | None = None
        self._health_pool = futures.ThreadPoolExecutor(max_workers=HEALTH_WORKERS, thread_name_prefix="jaxspec-health")
        self._health = health.HealthServicer(experimental_non_blocking=True, experimental_thread_pool=self._health_pool)
        self._pool: futures.ThreadPoolExecutor | None = None
        self._guard: _CallGuard | None = None
        self._lock = threading.Condition()
        self._accepting = False
        self._active_calls = 0
        self._dropped = 0  # Generate calls the server ended before their request finished
        self.dropped = 0  # after shutdown(): those, and calls still open when the transport stopped
        self._stopped = False
        largest = engine.config.batch_buckets[-1]
        if config.max_running is not None and config.max_running > largest:
            raise ValueError(f"max_running={config.max_running} exceeds the menu's largest batch bucket {largest}")
        self._capacity = config.max_running or largest

    # --- lifecycle ---------------------------------------------------------------------------

    @property
    def address(self) -> str:
        return f"{self.config.host}:{self.port}"

    @property
    def pending_calls(self) -> int:
        """Calls (health excluded) now waiting for their request message."""
        return self._guard.pending if self._guard is not None else 0

    def start(self) -> "GenerationServer":
        """Bind (NOT_SERVING), warm up the whole menu, start the engine thread, then SERVING."""
        if self._grpc is not None:
            raise RuntimeError("the server was already started")
        cfg = self.config
        if cfg.tls_cert is not None:
            check_tls_pair(cfg.tls_cert, cfg.tls_key)  # before binding: say what is wrong with the files
        # threads other calls can hold: admitted streams (queue + slots), calls awaiting their request
        # message (bounded and timed out by the guard), and a margin for short calls and rejections;
        # health has a pool of its own. No gRPC-wide call cap: health must not share one.
        workers = cfg.max_queue + self._capacity + cfg.max_pending_calls + EXTRA_WORKERS
        self._pool = futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="jaxspec-rpc")
        self._guard = _CallGuard(timeout_s=cfg.request_timeout_s, max_pending=cfg.max_pending_calls,
                                 max_bytes=cfg.max_message_bytes, health_pool=self._health_pool, metrics=self.metrics)
        interceptors: list[grpc.ServerInterceptor] = []
        if cfg.auth_token is not None:
            interceptors.append(BearerTokenInterceptor(
                cfg.auth_token, on_reject=lambda method: self.metrics.record_rpc(method, "UNAUTHENTICATED")))
        interceptors.append(self._guard)
        transport_limit = cfg.max_message_bytes * TRANSPORT_LIMIT_FACTOR
        server = grpc.server(
            self._pool, interceptors=interceptors,
            options=[("grpc.max_receive_message_length", transport_limit),
                     ("grpc.max_send_message_length", cfg.max_message_bytes),
                     ("grpc.so_reuseport", 0)])
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, {
            "Generate": grpc.unary_stream_rpc_method_handler(
                self._generate, request_deserializer=None,  # raw bytes: see parse_generate_request
                response_serializer=pb.GenerateResponse.SerializeToString),
            "ListModels": grpc.unary_unary_rpc_method_handler(
                self._list_models, request_deserializer=pb.ListModelsRequest.FromString,
                response_serializer=pb.ListModelsResponse.SerializeToString),
        }),))
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)  # on _health_pool (see _CallGuard)
        reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
        for service in ("", SERVICE_NAME):
            self._health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        self.port = self._bind(server)
        self._grpc = server
        try:
            if cfg.metrics_port is not None:
                self._metrics_http, self.metrics_port = self.metrics.serve_http(cfg.host, cfg.metrics_port)
            server.start()
            log.info("listening on %s (NOT_SERVING until warm-up ends)", self.address)
            self._warm_up()
        except BaseException:
            self._stop_transport()
            raise
        with self._lock:
            self._accepting = True
        self.metrics.mark_warm()
        for service in ("", SERVICE_NAME):
            self._health.set(service, health_pb2.HealthCheckResponse.SERVING)
        log.info("serving %s on %s", self.model_name, self.address)
        return self

    def _bind(self, server: grpc.Server) -> int:
        cfg, address = self.config, f"{self.config.host}:{self.config.port}"
        try:
            if cfg.tls_cert is not None:
                creds = grpc.ssl_server_credentials([(Path(cfg.tls_key).read_bytes(), Path(cfg.tls_cert).read_bytes())])
                port = server.add_secure_port(address, creds)
            else:
                port = server.add_insecure_port(address)
        except RuntimeError as exc:
            raise OSError(f"cannot bind {address}: {exc}") from None
        if port == 0:
            raise OSError(f"cannot bind {address} (in use, or not a local address)")
        return port

    def _warm_up(self) -> None:
        t0 = time.perf_counter()
        compiled = self.engine.warmup(progress=self._progress)
        source = self._policy_source
        policy = source if source is None or isinstance(source, Policy) else source(self.engine)
        self.policy = MeteredPolicy(policy, self.metrics) if policy is not None else None
        cfg = self.config
        self.scheduler = Scheduler(self.engine, self.policy, self.tokenizer,
                                   SchedulerConfig(max_queue=cfg.max_queue, max_running=self._capacity))
        if self.policy is None:  # the scheduler's default (no speculation), metered too
            self.policy = self.scheduler.policy = MeteredPolicy(self.scheduler.policy, self.metrics)
        self.metrics.bind(self.scheduler)
        self._engine_thread = self.scheduler.start()
        log.info("warm-up: %d shapes compiled in %.1f s", compiled, time.perf_counter() - t0)

    def begin_shutdown(self) -> None:
        """Report NOT_SERVING and refuse new Generate calls; in-flight ones go on."""
        with self._lock:
            self._accepting = False
        self.metrics.ready.set(0)
        self._health.enter_graceful_shutdown()

    def shutdown(self, drain: bool = True, timeout: float | None = None) -> bool:
        """Stop serving. drain=True lets in-flight requests finish (up to `timeout` seconds, default
        `drain_timeout_s`, after which they are cancelled). Returns whether everything drained."""
        with self._lock:
            if self._stopped:
                return True
            self._stopped = True
        self.begin_shutdown()
        timeout = self.config.drain_timeout_s if timeout is None else timeout
        deadline = time.monotonic() + timeout
        clean = True
        if self.scheduler is not None:
            self.scheduler.stop(drain=drain, timeout=timeout)
            if self._engine_thread is not None and self._engine_thread.is_alive():
                log.warning("in-flight requests did not finish within %.0f s: cancelling them", timeout)
                clean = False
                self.scheduler.stop(drain=False, timeout=10.0)
        with self._lock:  # the workers relay the last messages of finished requests
            while self._active_calls and self._lock.wait(max(0.05, deadline - time.monotonic())):
                pass
            self.dropped = self._dropped + self._active_calls  # the open ones end with the transport
        self._stop_transport()
        clean = clean and self.dropped == 0
        if clean:
            log.info("stopped (drained)")
        else:
            log.warning("stopped: %d in-flight requests dropped", self.dropped)
        return clean

    def cancel_inflight(self) -> None:
        """Cancel every live request now (a second SIGTERM); does not wait. Their calls end with
        UNAVAILABLE and count in `dropped`."""
        if self.scheduler is not None:
            self.scheduler.stop(drain=False, timeout=0)

    def _stop_transport(self) -> None:
        if self._grpc is not None:
            self._grpc.stop(grace=1.0).wait()
        if self._guard is not None:
            self._guard.close()
        for pool in (self._pool, self._health_pool):
            if pool is not None:
                pool.shutdown(wait=False)
        if self._metrics_http is not None:
            self._metrics_http.shutdown()
            self._metrics_http.server_close()
            self._metrics_http = None

    # --- handlers ----------------------------------------------------------------------------

    def _generate(self, data: bytes, context: grpc.ServicerContext) -> Iterator[pb.GenerateResponse]:
        started = time.perf_counter()
        code = "OK"
        handle: RequestHandle | None = None
        with self._lock:
            self._active_calls += 1
        try:
            if not self._accepting:
                raise RpcError(grpc.StatusCode.UNAVAILABLE, "the server is shutting down" if self._stopped
                               else "the server is warming up; retry when health reports SERVING")
            request = self._prepare(parse_generate_request(data))
            try:
                handle = self.scheduler.submit(request)
            except InvalidRequestError as exc:
                raise _invalid(str(exc)) from None
            except QueueFullError as exc:
                raise RpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{exc}; retry later") from None
            except SchedulerClosedError:
                raise RpcError(grpc.StatusCode.UNAVAILABLE, "the server is shutting down") from None
            self.metrics.record_prompt(len(request.prompt_token_ids))
            if not context.add_callback(handle.cancel):  # the call already ended
                handle.cancel()
            for event in self._relay(handle, context):
                self.metrics.record_tokens(len(event.token_ids))
                message = pb.GenerateResponse(text=event.text, token_ids=event.token_ids,
                                              request_id=request.request_id)
                if event.finished:
                    result = event.result
                    self.metrics.record_result(result)
                    if result.finish_reason == FinishReason.ERROR:
                        raise RpcError(grpc.StatusCode.INTERNAL, f"generation failed: {clip(str(result.error))}")
                    if result.finish_reason == FinishReason.CANCELLED:
                        if not context.is_active():
                            return  # the client left; nobody to tell
                        with self._lock:
                            self._dropped += 1
                        raise RpcError(grpc.StatusCode.UNAVAILABLE, "the server stopped before the request finished")
                    message.finish_reason = FINISH_REASONS[result.finish_reason]
                    message.stats.CopyFrom(_stats(result))
                yield message
        except RpcError as exc:
            code = exc.code.name
            _abort(context, exc.code, exc.message)
        except Exception as exc:  # noqa: BLE001 - a bug must still end the call with a status
            code = "INTERNAL"
            log.exception("Generate failed")
            _abort(context, grpc.StatusCode.INTERNAL, f"internal error: {shown(exc)}")
        finally:
            if handle is not None and not handle.done():
                handle.cancel()
            if code == "OK" and not context.is_active():
                remaining = context.time_remaining()
                code = "DEADLINE_EXCEEDED" if remaining is not None and remaining <= DEADLINE_SLACK_S else "CANCELLED"
            self.metrics.record_rpc("Generate", code)
            if code == "OK":
                self.metrics.record_latency(time.perf_counter() - started)
            with self._lock:
                self._active_calls -= 1
                self._lock.notify_all()

    @staticmethod
    def _relay(handle: RequestHandle, context: grpc.ServicerContext):
        """The request's events until the final one; cancels it once the client is gone."""
        while True:
            try:
                event = handle.get(timeout=POLL_S)
            except queue.Empty:
                if not context.is_active():
                    handle.cancel()
                continue
            yield event
            if event.finished:
                return

    def _prepare(self, req: pb.GenerateRequest) -> Request:
        """Validate a request (INVALID_ARGUMENT with the reason) and tokenise it."""
        cfg = self.config
        if req.model and req.model != self.model_name:
            raise _invalid(f"unknown model {shown(req.model)}; this server serves {self.model_name!r} (see ListModels)")
        if req.prompt and req.messages:
            raise _invalid("set exactly one of 'prompt' and 'messages', not both")
        if not req.prompt and not req.messages:
            raise _invalid("empty prompt: set a non-empty 'prompt' or 'messages'")
        if len(req.stop) > cfg.max_stop_strings:
            raise _invalid(f"too many stop strings: {len(req.stop)} (at most {cfg.max_stop_strings})")
        for s in req.stop:
            if not s:
                raise _invalid("stop strings must be non-empty")
            if len(s) > cfg.max_stop_chars:
                raise _invalid(f"a stop string has {len(s)} characters (at most {cfg.max_stop_chars})")
        params = SamplingParams(
            temperature=req.temperature if req.HasField("temperature") else 0.0,
            top_p=req.top_p if req.HasField("top_p") else 1.0,
            top_k=req.top_k if req.HasField("top_k") else 0,
            seed=req.seed if req.HasField("seed") else None,
            max_tokens=req.max_tokens if req.HasField("max_tokens") else cfg.default_max_tokens,
            stop_strings=tuple(req.stop), ignore_eos=req.ignore_eos)
        try:
            params.validate(max_tokens_limit=cfg.max_tokens_limit)
        except ValueError as exc:
            raise _invalid(str(exc)) from None
        ids = self._tokenize(req)
        max_len = self.engine.config.max_len
        if not ids:
            raise _invalid("the prompt is empty after tokenisation")
        if len(ids) >= max_len:
            raise _invalid(f"prompt too long: {len(ids)} tokens, but the context holds {max_len} "
                           f"(at most {max_len - 1} prompt tokens, leaving room to generate)")
        return Request(secrets.token_hex(8), ids, params)

    def _tokenize(self, req: pb.GenerateRequest) -> list[int]:
        if not req.messages:
            return list(self.tokenizer.encode(req.prompt))
        if not _has_chat_template(self.tokenizer):
            raise _invalid(f"model {self.model_name!r} has no chat template: send 'prompt' instead of 'messages'")
        for i, m in enumerate(req.messages):
            if not m.role:
                raise _invalid(f"messages[{i}].role is empty")
        try:
            text = self.tokenizer.apply_chat_template([{"role": m.role, "content": m.content} for m in req.messages])
        except ValueError as exc:
            raise _invalid(f"the chat template failed: {clip(str(exc))}") from None
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def model_info(self) -> pb.ModelInfo:
        from jaxspec.profiler import draft_name  # the name the cost profiles use

        c = self.engine.config
        return pb.ModelInfo(name=self.model_name, context_length=c.max_len, max_tokens_limit=self.config.max_tokens_limit,
                            vocab_size=self.engine.model_config.vocab_size, proposer=draft_name(self.engine),
                            policy=self.policy.name if self.policy is not None else "", k_menu=c.k_menu,
                            chat_template=_has_chat_template(self.tokenizer))

    def _list_models(self, request: pb.ListModelsRequest, context: grpc.ServicerContext) -> pb.ListModelsResponse:
        self.metrics.record_rpc("ListModels", "OK")
        return pb.ListModelsResponse(models=[self.model_info()])


# --- building from names (the CLI) -----------------------------------------------------------


def resolve_tokenizer(spec: str, model_tokenizer: TokenizerLike | None, model_name: str) -> TokenizerLike:
    """'model': the model's own tokenizer (an error for presets, which have none); 'ascii' / 'bytes': a toy."""
    from serving.toy_tokenizer import TOY_TOKENIZERS

    if spec == "model":
        if model_tokenizer is None:
            raise ValueError(f"model {model_name!r} has no tokenizer (a preset with random weights): pass "
                             f"--tokenizer ascii (64 ids) or --tokenizer bytes (259 ids)")
        return model_tokenizer
    if spec in TOY_TOKENIZERS:
        return TOY_TOKENIZERS[spec]()
    raise ValueError(f"unknown tokenizer {spec!r}; choose 'model', {', '.join(map(repr, TOY_TOKENIZERS))}")


def build_server(config: ServeConfig, progress: bool = True) -> GenerationServer:
    """The engine (jaxspec.build), tokenizer and policy a ServeConfig names, as an unstarted server.
    Policy defaults and menu trimming are those of every engine command (serving.runtime)."""
    from jaxspec.build import build_model, build_proposer, load_engine_config
    from serving.runtime import _menu_for, build_policy, policy_spec

    spec = policy_spec(config)  # None: goodput with a proposer, else none
    engine_config = _menu_for(spec, load_engine_config(config.menu))  # only the k values the policy can pick
    policy: Policy | PolicyFactory
    if spec.partition(":")[0] in ("goodput", "goodput-per-request"):
        def policy(warm: Engine) -> Policy:  # needs the warmed-up engine: loads or measures its cost profile
            return build_policy(spec, warm.config.max_len, engine=warm, progress=progress)
    else:
        policy = build_policy(spec, engine_config.max_len)  # a bad spec fails before the model loads
    built = build_model(config.model)
    tokenizer = resolve_tokenizer(config.tokenizer, built.tokenizer, built.name)
    engine = Engine(built.model, build_proposer(config.proposer, built.model, config.draft), engine_config)
    return GenerationServer(engine, tokenizer, policy, config, model_name=built.name, progress=progress)


# --- `jaxspec serve` ---------------------------------------------------------------------------------


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `jaxspec serve` (each overrides the --config file, which overrides the defaults)."""
    d = ServeConfig()
    parser.add_argument("--config", default=None, help=f"serving YAML with ServeConfig keys (e.g. {DEFAULT_CONFIG.name})")
    parser.add_argument("--model", default=None, help="target model (default: the embedded default)")
    parser.add_argument("--proposer", default=None, choices=PROPOSERS,
                        help=f"speculation proposer (default {d.proposer})")
    parser.add_argument("--draft", default=None, help="draft model with --proposer draft (default: the shipped draft)")
    parser.add_argument("--policy", default=None, help="none | fixed:K | table[:B=K,...] | heuristic | goodput | "
                        "goodput-per-request (default: goodput with a proposer, else none)")
    parser.add_argument("--menu", default=None, help=f"engine menu: a configs/engine.yaml name or a YAML path "
                        f"(default {d.menu})")
    parser.add_argument("--tokenizer", default=None, help="'model', or 'ascii' / 'bytes' (toy tokenizers for "
                        "random-weight presets such as --model tiny)")
    parser.add_argument("--max-tokens-limit", type=int, default=None, help=f"largest max_tokens per request "
                        f"(default {d.max_tokens_limit})")
    parser.add_argument("--max-queue", type=int, default=None, help=f"requests waiting for a slot before "
                        f"RESOURCE_EXHAUSTED (default {d.max_queue})")
    parser.add_argument("--host", default=None, help=f"address to bind (default {d.host})")
    parser.add_argument("--port", type=int, default=None, help=f"gRPC port (default {d.port}; 0 = any free port)")
    parser.add_argument("--metrics-port", type=int, default=None, help="Prometheus /metrics port (default: off)")
    parser.add_argument("--tls-cert", default=None, help="PEM certificate chain (with --tls-key): serve TLS")
    parser.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    parser.add_argument("--auth-token", default=None, help="require 'authorization: Bearer TOKEN' on every call "
                        "(health checks exempt). Every local user sees argv in `ps`: prefer --auth-token-file or "
                        f"${TOKEN_ENV}")
    parser.add_argument("--auth-token-file", default=None, metavar="FILE",
                        help=f"read the bearer token from FILE (surrounding whitespace stripped); without either "
                        f"flag, ${TOKEN_ENV} is used when set")


def serve_config_from_args(args: argparse.Namespace) -> ServeConfig:
    return load_serve_config(args.config, model=args.model, proposer=args.proposer, draft=args.draft,
                             policy=args.policy, menu=args.menu, tokenizer=args.tokenizer,
                             max_tokens_limit=args.max_tokens_limit, max_queue=args.max_queue, host=args.host,
                             port=args.port, metrics_port=args.metrics_port, tls_cert=args.tls_cert,
                             tls_key=args.tls_key, auth_token=resolve_token(args.auth_token, args.auth_token_file))


def run_serve(args: argparse.Namespace, build: Callable[[ServeConfig], GenerationServer] = build_server) -> int:
    """`jaxspec serve`: build, warm up, serve until SIGTERM / SIGINT, drain. Returns the exit code: 0
    when every in-flight request finished, 1 when some were dropped (a second signal, or
    drain_timeout_s), 2 for bad input or configuration."""
    from jaxspec.engine import enable_compilation_cache

    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = serve_config_from_args(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"jaxspec serve: {exc}", file=sys.stderr)
        return 2
    enable_compilation_cache()
    stop = threading.Event()
    server: GenerationServer | None = None

    def on_signal(signum, _frame):
        if stop.is_set() and server is not None:
            log.warning("second %s: cancelling in-flight requests", signal.Signals(signum).name)
            server.cancel_inflight()
        log.info("%s: draining", signal.Signals(signum).name)
        stop.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        try:
            server = build(config)
            server.start()
        except (ValueError, OSError, KeyError) as exc:
            print(f"jaxspec serve: {exc}", file=sys.stderr)
            return 2
        metrics = f", metrics on :{server.metrics_port}" if server.metrics_port is not None else ""
        print(f"jaxspec serve: {server.model_name} on {server.address}{metrics}", file=sys.stderr, flush=True)
        while not stop.wait(0.5):
            pass
        if server.shutdown(drain=True):
            print("jaxspec serve: stopped (drained)", file=sys.stderr, flush=True)
            return 0
        n = server.dropped
        print(f"jaxspec serve: stopped: {n} in-flight request{'' if n == 1 else 's'} dropped (exit 1)",
              file=sys.stderr, flush=True)
        return 1
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def main(argv: list[str] | None = None) -> int:
    """`python -m serving.grpc_server ...` (the same flags as `jaxspec serve`)."""
    parser = argparse.ArgumentParser(prog="jaxspec serve", description="Serve jaxspec.v1.Generation over gRPC.")
    add_serve_arguments(parser)
    return run_serve(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
