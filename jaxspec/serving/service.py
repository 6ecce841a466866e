"""The gRPC service behind `jaxspec serve`: jaxspec.v1.Generation, health, reflection, Prometheus metrics.

Threads:
    gRPC workers    one per live call: parse, validate and tokenise the request, submit it to the
                    scheduler, then relay its events (a thread-safe queue per request) as messages
    health workers  the health service's own threads: no other call can occupy them
    alarms          one thread that cancels calls whose request message is late (jaxspec.serving.call_guard)
    engine thread   `Scheduler.run_forever`, the only thread that touches the engine
    metrics         prometheus_client's HTTP server (with --metrics-port)

Calls (`jaxspec.serving.call_guard.CallGuard`):
gRPC hands every handler the call before its request message (they are all
registered request-streaming), so an unauthenticated call is refused from its metadata alone; the
request message must then arrive within `request_timeout_s`, else the call is cancelled; at most
`max_pending_calls` calls (health excluded) wait for theirs at once, half of them per connection and
`max_pending_calls_per_peer` once its calls have waited (`call_guard.PEER_GRACE_S`), more get
RESOURCE_EXHAUSTED (with grpc-retry-pushback-ms); the guard checks the size (`max_message_bytes`:
INVALID_ARGUMENT over it; gRPC's own transport limit is twice that), that a unary call sends one message,
and deserialises (malformed: INVALID_ARGUMENT). No half-open call
holds a thread for longer than the timeout; health never shares a limit or a thread with other
calls, and its half-open calls are capped (HEALTH_WAITING, the oldest cancelled) below its threads.
A prompt longer in bytes than any prompt that fits the context is refused before it is tokenized.

Lifecycle: bind (health NOT_SERVING, Generate answers UNAVAILABLE) -> warm up the whole menu (and,
for goodput policies, load or measure the cost profile) -> start the engine thread -> SERVING.
SIGTERM / SIGINT (jaxspec.serving.serve_cmd):
NOT_SERVING, new calls get UNAVAILABLE, in-flight streams finish, exit 0. A
second signal cancels what is left (as does `drain_timeout_s` passing first): the process then logs
how many in-flight requests were dropped and exits 1. Bad input or configuration exits 2.

A client that cancels, disconnects or runs past its deadline has its request cancelled through
`context.add_callback`, so its slot is free before the engine's next step.
"""

from __future__ import annotations

import logging
import queue
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from jaxspec.engine.api import EngineAPI
from jaxspec.policy.base import Policy
from jaxspec.scheduling.requests import (
    FinishReason,
    InvalidRequestError,
    QueueFullError,
    Request,
    RequestHandle,
    RequestLimits,
    RequestResult,
    SchedulerClosedError,
    validate_request,
)
from jaxspec.scheduling.scheduler import Scheduler, SchedulerConfig
from jaxspec.serving.auth import BearerTokenInterceptor
from jaxspec.serving.call_guard import CallGuard
from jaxspec.serving.metrics import ServingMetrics
from jaxspec.serving.proto.jaxspec.v1 import generation_pb2 as pb
from jaxspec.serving.serve_config import TRANSPORT_LIMIT_FACTOR, ServeConfig, check_tls_pair, is_loopback
from jaxspec.serving.wire import RpcError, abort, busy, clip, invalid, parse_generate_request, shown
from jaxspec.types import SamplingParams

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name  # "jaxspec.v1.Generation"
POLL_S = 0.25  # how often a relaying worker checks that its client is still there
DEADLINE_SLACK_S = 0.05  # a call that ends this close to its deadline counts as DEADLINE_EXCEEDED (the
#                          client's own timer cancels it a moment before the server's copy expires)
EXTRA_WORKERS = 16  # worker threads beyond queue + slots + pending calls: ListModels, reflection, rejections
HEALTH_WORKERS = 64  # the health service's own threads (made on demand), used by nothing else
HEALTH_WAITING = 48  # health calls awaiting their request message at once; a new one cancels the oldest, so
#                      HEALTH_WORKERS - HEALTH_WAITING threads are always free to answer
PROMPT_BYTES_SLACK = 4  # see GenerationServer.max_prompt_bytes
FINISH_REASONS = {FinishReason.EOS: pb.FINISH_REASON_EOS, FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
                  FinishReason.STOP: pb.FINISH_REASON_STOP}

TokenizerLike = Any  # encode / token_bytes / eos_token_ids / apply_chat_template (TextTokenizer or a toy)
PolicyFactory = Callable[[EngineAPI], Policy]


def _stats(result: RequestResult) -> pb.RequestStats:
    t = result.timings
    stats = pb.RequestStats(prompt_tokens=result.prompt_len, completion_tokens=len(result.token_ids),
                            steps=len(result.steps), proposed_tokens=result.proposed,
                            accepted_tokens=result.accepted, total_s=t.total_s, seed=result.seed,
                            cached_prompt_tokens=result.cached_prompt_tokens)
    for name, value in (("acceptance", result.acceptance_rate), ("time_to_first_token_s", t.ttft_s),
                        ("time_per_output_token_s", t.tpot_s), ("queued_s", t.queued_s)):
        if value is not None:
            setattr(stats, name, value)
    return stats


def _has_chat_template(tokenizer: TokenizerLike) -> bool:
    return hasattr(tokenizer, "apply_chat_template") and getattr(tokenizer, "chat_template", "") is not None


class GenerationServer:
    """One engine behind jaxspec.v1.Generation (+ health, reflection, metrics).

    engine:     anything satisfying the engine contract (jaxspec.engine.api.EngineAPI).
    policy:     a Policy, or a factory called with the warmed-up engine (goodput policies profile it);
                None: no speculation.
    model_name: the name ListModels reports and requests may name.
    `start()` binds, warms up and serves; `shutdown()` drains (or cancels) and stops.
    """

    def __init__(self, engine: EngineAPI, tokenizer: TokenizerLike, policy: Policy | PolicyFactory | None,
                 config: ServeConfig = ServeConfig(), *, model_name: str,
                 metrics: ServingMetrics | None = None, progress: bool = False):
        if tokenizer is None:
            raise ValueError("the server needs a tokenizer (the Generate API takes text)")
        if getattr(tokenizer, "vocab_size", 0) > engine.vocab_size:
            raise ValueError(f"the tokenizer has {tokenizer.vocab_size} ids but the model's vocabulary has "
                             f"{engine.vocab_size}")
        self.engine = engine
        self.tokenizer = tokenizer
        self.config = config
        self.model_name = model_name
        self.limits = RequestLimits.for_engine(engine, tokenizer, max_tokens_limit=config.max_tokens_limit)
        # Every token of a tokenized prompt stands for at least one byte of (normalised) text and at most
        # the longest byte string a token id decodes to, so a prompt that fits the context (< max_len
        # tokens) has at most (max_len - 1) × that many bytes. PROMPT_BYTES_SLACK leaves room for
        # normalisers that shrink text before it is split; anything longer is refused before tokenizing.
        longest_token = max(len(tokenizer.token_bytes(i)) for i in range(tokenizer.vocab_size))
        self.max_prompt_bytes = (self.limits.max_len - 1) * max(1, longest_token) * PROMPT_BYTES_SLACK
        self.metrics = metrics or ServingMetrics(tuple(engine.menu.k_menu))
        self._policy_source = policy
        self._progress = progress
        self.policy: Policy | None = None
        self.scheduler: Scheduler | None = None
        self._engine_thread: threading.Thread | None = None
        self._grpc: grpc.Server | None = None
        self._metrics_http = None
        self.port: int | None = None
        self.metrics_port: int | None = None
        self.metrics_address: tuple[str, int] | None = None  # where /metrics is bound (with metrics_port)
        self._health_pool = futures.ThreadPoolExecutor(max_workers=HEALTH_WORKERS, thread_name_prefix="jaxspec-health")
        self._health = health.HealthServicer(experimental_non_blocking=True, experimental_thread_pool=self._health_pool)
        self._pool: futures.ThreadPoolExecutor | None = None
        self._guard: CallGuard | None = None
        self._lock = threading.Condition()
        self._accepting = False
        self._active_calls = 0
        self._dropped = 0  # Generate calls the server ended before their request finished
        self.dropped = 0  # after shutdown(): those, and calls still open when the transport stopped
        self._stopped = False
        largest = engine.menu.largest_batch
        if config.max_running is not None and config.max_running > largest:
            raise ValueError(f"max_running={config.max_running} exceeds the menu's largest batch bucket {largest}")
        self._capacity = config.max_running or largest

    # --- lifecycle ---------------------------------------------------------------------------

    @property
    def address(self) -> str:
        """host:port of gRPC; 'off' when the config's port is 0."""
        return "off" if self.config.port == 0 else f"{self.config.host}:{self.port}"

    @property
    def pending_calls(self) -> int:
        """Calls (health excluded) now waiting for their request message."""
        return self._guard.pending if self._guard is not None else 0

    def start(self) -> GenerationServer:
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
        self._guard = CallGuard(timeout_s=cfg.request_timeout_s, max_pending=cfg.max_pending_calls,
                                max_pending_per_peer=cfg.max_pending_calls_per_peer, max_bytes=cfg.max_message_bytes,
                                health_pool=self._health_pool, max_health_waiting=HEALTH_WAITING, metrics=self.metrics)
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
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)  # on _health_pool (see CallGuard)
        reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
        for service in ("", SERVICE_NAME):
            self._health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        if cfg.port != 0:  # port 0: gRPC off (the HTTP API serves alone)
            self.port = self._bind(server)
            self._grpc = server
        try:
            if cfg.metrics_port is not None:
                self._metrics_http, self.metrics_port = self.metrics.serve_http(cfg.metrics_host, cfg.metrics_port)
                self.metrics_address = (cfg.metrics_host, self.metrics_port)
                if not is_loopback(cfg.metrics_host):
                    log.warning("metrics on %s:%d: the endpoint has no auth and no TLS", cfg.metrics_host,
                                self.metrics_port)
            if self._grpc is not None:
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
        cfg = self.config
        self.scheduler = Scheduler(self.engine, policy, self.tokenizer,
                                   SchedulerConfig(max_queue=cfg.max_queue, max_running=self._capacity,
                                                   overlap=not cfg.no_overlap),
                                   step_listeners=(self.metrics.observe_step,))
        self.policy = self.scheduler.policy  # None: the scheduler's default (no speculation)
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
                raise invalid(str(exc)) from None
            except QueueFullError as exc:
                raise busy(f"{exc}; retry later") from None
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
            abort(context, exc.code, exc.message, retry_later=exc.retry_later)
        except Exception as exc:  # noqa: BLE001 - a bug must still end the call with a status
            code = "INTERNAL"
            log.exception("Generate failed")
            abort(context, grpc.StatusCode.INTERNAL, f"internal error: {shown(exc)}")
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
        """Check the message's fields against the server's limits, tokenise it, and validate the
        request (jaxspec.scheduling.requests.validate_request); INVALID_ARGUMENT with the reason."""
        cfg = self.config
        if req.model and req.model != self.model_name:
            raise invalid(f"unknown model {shown(req.model)}; this server serves {self.model_name!r} (see ListModels)")
        if req.prompt and req.messages:
            raise invalid("set exactly one of 'prompt' and 'messages', not both")
        if not req.prompt and not req.messages:
            raise invalid("empty prompt: set a non-empty 'prompt' or 'messages'")
        if len(req.stop) > cfg.max_stop_strings:
            raise invalid(f"too many stop strings: {len(req.stop)} (at most {cfg.max_stop_strings})")
        for s in req.stop:
            if len(s) > cfg.max_stop_chars:
                raise invalid(f"a stop string has {len(s)} characters (at most {cfg.max_stop_chars})")
        size = len(req.prompt.encode()) + sum(len(m.role.encode()) + len(m.content.encode()) for m in req.messages)
        if size > self.max_prompt_bytes:
            raise invalid(f"the prompt has {size} bytes; a prompt that fits the context ({self.limits.max_len} "
                          f"tokens) has at most {self.max_prompt_bytes} bytes")
        params = SamplingParams(
            temperature=req.temperature if req.HasField("temperature") else 0.0,
            top_p=req.top_p if req.HasField("top_p") else 1.0,
            top_k=req.top_k if req.HasField("top_k") else 0,
            seed=req.seed if req.HasField("seed") else None,
            max_tokens=req.max_tokens if req.HasField("max_tokens") else cfg.default_max_tokens,
            stop_strings=tuple(req.stop), ignore_eos=req.ignore_eos)
        request = Request(secrets.token_hex(8), self._tokenize(req), params)
        try:
            validate_request(request, self.limits)
        except InvalidRequestError as exc:  # the id is the server's own: not part of the client's message
            raise invalid(str(exc).removeprefix(f"request {request.request_id!r}: ")) from None
        return request

    def _tokenize(self, req: pb.GenerateRequest) -> list[int]:
        if not req.messages:
            return list(self.tokenizer.encode(req.prompt))
        if not _has_chat_template(self.tokenizer):
            raise invalid(f"model {self.model_name!r} has no chat template: send 'prompt' instead of 'messages'")
        for i, m in enumerate(req.messages):
            if not m.role:
                raise invalid(f"messages[{i}].role is empty")
        try:
            text = self.tokenizer.apply_chat_template([{"role": m.role, "content": m.content} for m in req.messages])
        except ValueError as exc:
            raise invalid(f"the chat template failed: {clip(str(exc))}") from None
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def model_info(self) -> pb.ModelInfo:
        c = self.engine.menu
        return pb.ModelInfo(name=self.model_name, context_length=c.max_len,
                            max_tokens_limit=self.config.max_tokens_limit,
                            vocab_size=self.engine.vocab_size, proposer=self.engine.proposer_name,
                            policy=self.policy.name if self.policy is not None else "", k_menu=c.k_menu,
                            chat_template=_has_chat_template(self.tokenizer))

    def _list_models(self, request: pb.ListModelsRequest, context: grpc.ServicerContext) -> pb.ListModelsResponse:
        self.metrics.record_rpc("ListModels", "OK")
        return pb.ListModelsResponse(models=[self.model_info()])



__all__ = ["SERVICE_NAME", "GenerationServer", "PolicyFactory"]
