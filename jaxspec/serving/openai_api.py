"""The OpenAI-compatible HTTP API of `jaxspec serve --http-port P` (docs/openai_api.md), beside gRPC.

It runs in the gRPC server's process on the same scheduler (`jaxspec.serving.service.GenerationServer`): a Starlette
app served by uvicorn in its own thread, streams as server-sent events (sse-starlette).

    GET  /v1/models            the served model and its proposer, as OpenAI model objects
    POST /v1/chat/completions  `messages` through the model's chat template
    POST /v1/completions       `prompt` (one string)
    GET  /health               200 once warm-up is over and until draining starts, else 503

Each of a request's `n` choices is one scheduler request; the scheduler's thread hands its events (one per
engine step) straight to the event loop (`RequestHandle.listen` + `call_soon_threadsafe`: no relay thread).
Every error has OpenAI's shape
`{"error": {"message", "type", "param", "code"}}`: 400 bad input (the field named), 401 a missing or wrong
bearer token (/health exempt), 404 an unknown model or path, 408 a body that does not arrive within
request_timeout_s, 413 a body over max_message_bytes, 429 a full queue, 503 warming up or draining.
A client that disconnects cancels its requests, so their slots are free before the engine's next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import math
import secrets
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import uvicorn
from sse_starlette.sse import EventSourceResponse
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from jaxspec.scheduling.requests import (
    FinishReason,
    InvalidRequestError,
    QueueFullError,
    Request,
    RequestHandle,
    RequestOutput,
    RequestResult,
    SchedulerClosedError,
    validate_request,
)
from jaxspec.serving.serve_config import check_tls_pair
from jaxspec.serving.wire import clip, shown
from jaxspec.types import MAX_LOGPROBS, SamplingParams, TokenLogprobs

log = logging.getLogger(__name__)

MAX_N = 16  # the most choices one request may ask for (each takes a scheduler request)
EXTRA_CONNECTIONS = 16  # connections beyond queue + slots + pending calls (health checks, refusals)
SHUTDOWN_GRACE_S = 5.0  # uvicorn's wait for open connections once the API has stopped
FINISH_REASONS = {FinishReason.EOS: "stop", FinishReason.STOP: "stop", FinishReason.LENGTH: "length"}
CHAT_ROLES = ("system", "developer", "user", "assistant")
ENDPOINTS = {"/v1/models": "models", "/v1/chat/completions": "chat_completions", "/v1/completions": "completions",
             "/health": "health"}  # path -> the metrics label; any other path counts as "unknown"
# fields OpenAI defines that this server cannot honour: refused unless they hold their no-op value
UNSUPPORTED = {
    "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0), "logit_bias": (None, {}),
    "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []), "function_call": (None, "none"),
    "echo": (None, False), "best_of": (None, 1), "suffix": (None, ""), "audio": (None,), "prediction": (None,),
    "modalities": (None, ["text"]), "parallel_tool_calls": (None, False, True),
}


class ApiError(Exception):
    """Ends a call with an HTTP status and OpenAI's error body."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def body(self) -> dict:
        return {"error": {"message": clip(self.message, 1000), "type": self.type, "param": self.param,
                          "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def bad(param: str | None, message: str) -> ApiError:
    return ApiError(400, message, param=param)


# --- request parsing -------------------------------------------------------------------------


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _number(body: dict, name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if not _is_number(value) or not math.isfinite(value):
        raise bad(name, f"'{name}' must be a number, got {shown(value)}")
    return float(value)


def _integer(body: dict, name: str, default: int | None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool):
        raise bad(name, f"'{name}' must be an integer, got {shown(value)}")
    return value


def _boolean(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad(name, f"'{name}' must be true or false, got {shown(value)}")
    return value


def _text_content(content: Any, where: str) -> str:
    """A message's content: a string, or a list of {"type": "text", "text": ...} parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad(f"{where}[{j}]", f"'{where}[{j}]': only text parts ({{'type': 'text', 'text': ...}}) "
                          f"are supported, got {shown(part)}")
            parts.append(part["text"])
        return "".join(parts)
    raise bad(where, f"'{where}' must be a string or a list of text parts, got {shown(content)}")


def parse_messages(body: dict) -> list[dict[str, str]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "'messages' must be a non-empty list of {'role', 'content'} objects")
    parsed = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}]", f"'messages[{i}]' must be an object, got {shown(m)}")
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise bad(f"messages[{i}].role", f"'messages[{i}].role' must be one of {', '.join(CHAT_ROLES)}, "
                      f"got {shown(role)}")
        if m.get("tool_calls"):
            raise bad(f"messages[{i}].tool_calls", "tool calls are not supported")
        content = "" if m.get("content") is None and role == "assistant" else m.get("content")
        parsed.append({"role": "system" if role == "developer" else role,
                       "content": _text_content(content, f"messages[{i}].content")})
    return parsed


def parse_prompt(body: dict) -> str:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, list):
        raise bad("prompt", "'prompt' must be one string (lists of prompts or of token ids are not supported: "
                  "send one request per prompt)")
    if not isinstance(prompt, str) or not prompt:
        raise bad("prompt", f"'prompt' must be a non-empty string, got {shown(prompt)}")
    return prompt


def parse_stop(body: dict, max_strings: int, max_chars: int) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise bad("stop", f"'stop' must be a non-empty string or a list of them, got {shown(stop)}")
    if len(stops) > max_strings:
        raise bad("stop", f"too many stop strings: {len(stops)} (at most {max_strings})")
    for s in stops:
        if len(s) > max_chars:
            raise bad("stop", f"a stop string has {len(s)} characters (at most {max_chars})")
    return tuple(stops)


def parse_sampling(body: dict, *, chat: bool, default_max_tokens: int, max_strings: int,
                   max_chars: int) -> SamplingParams:
    """The request's SamplingParams (ranges are checked by jaxspec.scheduling.requests.validate_request)."""
    for name, allowed in UNSUPPORTED.items():
        if body.get(name, None) not in allowed:
            raise bad(name, f"'{name}' is not supported by this server")
    if chat:
        fmt = body.get("response_format")
        if fmt is not None and fmt != {"type": "text"}:
            raise bad("response_format", "only response_format {'type': 'text'} is supported")
    max_tokens = _integer(body, "max_tokens", None)
    if chat and body.get("max_completion_tokens") is not None:
        completion = _integer(body, "max_completion_tokens", None)
        if max_tokens is not None and completion != max_tokens:
            raise bad("max_completion_tokens", "'max_tokens' and 'max_completion_tokens' differ: set one")
        max_tokens = completion
    max_name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    if max_tokens is not None and max_tokens < 1:
        raise bad(max_name, f"'{max_name}' must be >= 1, got {max_tokens}")
    top_k = _integer(body, "top_k", 0)
    logprobs = parse_logprobs(body, chat=chat)
    return SamplingParams(logprobs=logprobs,
        temperature=_number(body, "temperature", 1.0), top_p=_number(body, "top_p", 1.0),
        top_k=0 if top_k == -1 else top_k, seed=_integer(body, "seed", None),
        max_tokens=default_max_tokens if max_tokens is None else max_tokens,
        stop_strings=parse_stop(body, max_strings, max_chars), ignore_eos=_boolean(body, "ignore_eos", False))


def parse_logprobs(body: dict, *, chat: bool) -> int | None:
    """The top alternatives asked per token (None: no logprobs). Chat: `logprobs` true and `top_logprobs` N;
    completions: `logprobs` N."""
    if not chat:
        n = _integer(body, "logprobs", None)
        if n is not None and not 0 <= n <= MAX_LOGPROBS:
            raise bad("logprobs", f"'logprobs' must be in [0, {MAX_LOGPROBS}], got {n}")
        return n
    top = _integer(body, "top_logprobs", None)
    if top is not None and not 0 <= top <= MAX_LOGPROBS:
        raise bad("top_logprobs", f"'top_logprobs' must be in [0, {MAX_LOGPROBS}], got {top}")
    if not _boolean(body, "logprobs", False):
        if top:
            raise bad("top_logprobs", "'top_logprobs' needs 'logprobs': true")
        return None
    return top or 0


def _param_of(reason: str) -> str | None:
    """The field an InvalidRequestError's reason is about ('temperature must be >= 0' -> 'temperature')."""
    first = reason.split(" ", 1)[0]
    if first in ("temperature", "top_p", "top_k", "seed", "max_tokens", "logprobs"):
        return first
    return "prompt" if "prompt" in reason or "token ids" in reason else None


def speculation_stats(result: RequestResult) -> dict:
    """The `jaxspec` extension field of a choice: its speculation steps, acceptance and mean k."""
    steps = result.steps
    return {"steps": len(steps), "proposed_tokens": result.proposed, "accepted_tokens": result.accepted,
            "acceptance": result.acceptance_rate, "mean_k": sum(s.k for s in steps) / len(steps) if steps else None,
            "seed": result.seed}


class LogprobsView:
    """OpenAI's `choices[].logprobs` from TokenLogprobs: chat's {"content": [...]} or completions' parallel lists.
    The end-of-sequence token that ended a request adds no text and gets no entry."""

    FLOOR = -9999.0  # OpenAI's stand-in for a log-probability of -inf (JSON has no infinity)

    def __init__(self, tokenizer: Any, chat: bool):
        self.tokenizer, self.chat = tokenizer, chat
        self.offset = 0  # completions' text_offset of the next token

    @staticmethod
    def shown(entries: tuple[TokenLogprobs, ...], finish: FinishReason | None) -> tuple[TokenLogprobs, ...]:
        return entries[:-1] if finish == FinishReason.EOS and entries else entries

    def _token(self, token_id: int) -> tuple[str, list[int]]:
        raw = self.tokenizer.token_bytes(token_id)
        return raw.decode("utf-8", errors="replace"), list(raw)

    def _value(self, logprob: float) -> float:
        return max(logprob, self.FLOOR) if math.isfinite(logprob) else self.FLOOR

    def render(self, entries: tuple[TokenLogprobs, ...]) -> dict:
        if self.chat:
            content = []
            for e in entries:
                text, raw = self._token(e.token_id)
                top = [dict(zip(("token", "bytes"), self._token(i)), logprob=self._value(v)) for i, v in e.top]
                content.append({"token": text, "logprob": self._value(e.logprob), "bytes": raw, "top_logprobs": top})
            return {"content": content, "refusal": None}
        tokens, offsets = [], []
        for e in entries:
            tokens.append(self._token(e.token_id)[0])
            offsets.append(self.offset)
            self.offset += len(tokens[-1])
        return {"tokens": tokens, "token_logprobs": [self._value(e.logprob) for e in entries],
                "top_logprobs": [{self._token(i)[0]: self._value(v) for i, v in e.top} for e in entries],
                "text_offset": offsets}


# --- the app -------------------------------------------------------------------------------


class OpenAIServer:
    """The OpenAI-compatible API over a GenerationServer's scheduler, on `port` (here 0 binds any free port;
    `jaxspec serve` turns HTTP off with 0 and never passes it).

    `start()` binds and serves (/health answers 503); `mark_ready()` once the GenerationServer is warm;
    `begin_shutdown()` refuses new completions (503); `shutdown()` waits for open calls, then stops.
    """

    def __init__(self, server: Any, port: int):
        self.server = server  # a jaxspec.serving.service.GenerationServer
        self.config = server.config
        self.requested_port = port
        self.port: int | None = None
        self._ready = False
        self._lock = threading.Condition()
        self._active = 0
        self.dropped = 0  # calls whose requests the server cancelled (a second SIGTERM, drain timeout)
        self._uvicorn: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self.app = Starlette(routes=[
            Route("/v1/models", self._models, methods=["GET"]),
            Route("/v1/chat/completions", self._chat, methods=["POST"]),
            Route("/v1/completions", self._completions, methods=["POST"]),
            Route("/health", self._health, methods=["GET"]),
        ], exception_handlers={HTTPException: self._http_error})

    @property
    def address(self) -> str:
        return f"{self.config.host}:{self.port}"

    # --- lifecycle --------------------------------------------------------------------------

    def start(self) -> OpenAIServer:
        """Bind (OSError if the address is taken) and serve in a background thread."""
        cfg = self.config
        if cfg.tls_cert is not None:
            check_tls_pair(cfg.tls_cert, cfg.tls_key)  # say what is wrong with the files (uvicorn would not)
        family = socket.AF_INET6 if ":" in cfg.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((cfg.host, self.requested_port))
        except OSError as exc:
            sock.close()
            raise OSError(f"cannot bind {cfg.host}:{self.requested_port} for HTTP: {exc.strerror or exc}") from None
        self.port = sock.getsockname()[1]
        capacity = cfg.max_running or self.server.engine.menu.largest_batch
        config = uvicorn.Config(
            self.app, log_level="warning", lifespan="off", access_log=False, ssl_certfile=cfg.tls_cert,
            ssl_keyfile=cfg.tls_key, timeout_keep_alive=int(max(1, cfg.request_timeout_s)),
            limit_concurrency=cfg.max_queue + capacity + cfg.max_pending_calls + EXTRA_CONNECTIONS,
            timeout_graceful_shutdown=int(SHUTDOWN_GRACE_S))
        self._uvicorn = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._uvicorn.run, kwargs={"sockets": [sock]},
                                        name="jaxspec-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._uvicorn.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise OSError(f"the HTTP server on {self.address} did not start")
            time.sleep(0.01)
        log.info("HTTP (OpenAI API) listening on %s", self.address)
        return self

    def mark_ready(self) -> None:
        with self._lock:
            self._ready = True

    def begin_shutdown(self) -> None:
        with self._lock:
            self._ready = False

    def shutdown(self, timeout: float | None = None) -> bool:
        """Refuse new calls, wait up to `timeout` s (default drain_timeout_s) for open ones, stop.
        Returns whether every call ended with its request finished."""
        self.begin_shutdown()
        deadline = time.monotonic() + (self.config.drain_timeout_s if timeout is None else timeout)
        with self._lock:
            while self._active and time.monotonic() < deadline:
                self._lock.wait(0.05)
            dropped = self.dropped = self.dropped + self._active
        if self._uvicorn is not None:
            self._uvicorn.should_exit = True
        if self._thread is not None:
            self._thread.join(SHUTDOWN_GRACE_S + 5)
        return dropped == 0

    # --- plumbing ---------------------------------------------------------------------------

    def _count(self, request: HttpRequest, status: int) -> None:
        endpoint = ENDPOINTS.get(request.url.path, "unknown")
        self.server.metrics.record_http(endpoint, status)

    async def _http_error(self, request: HttpRequest, exc: HTTPException) -> Response:
        status = exc.status_code
        message = f"no such endpoint: {request.method} {clip(request.url.path)}" if status in (404, 405) \
            else str(exc.detail)
        self._count(request, status)
        return ApiError(status, message, code="not_found" if status == 404 else None).response()

    def _authorize(self, request: HttpRequest) -> None:
        token = self.config.auth_token
        if token is None:
            return
        given = request.headers.get("authorization")
        scheme, _, credentials = (given or "").partition(" ")
        if given is None or not hmac.compare_digest(
                credentials.strip().encode() if scheme.lower() == "bearer" else b"", token.encode()):
            raise ApiError(401, "missing bearer token" if given is None else "invalid bearer token",
                           type="authentication_error", code="invalid_api_key")

    async def _read_json(self, request: HttpRequest) -> dict:
        limit = self.config.max_message_bytes
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise ApiError(413, f"request body of {length} bytes exceeds the limit of {limit} bytes",
                           code="request_too_large")

        async def read() -> bytes:
            chunks, size = [], 0
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise ApiError(413, f"request body exceeds the limit of {limit} bytes", code="request_too_large")
                chunks.append(chunk)
            return b"".join(chunks)

        try:
            data = await asyncio.wait_for(read(), self.config.request_timeout_s)
        except TimeoutError:
            raise ApiError(408, f"the request body did not arrive within {self.config.request_timeout_s} s",
                           code="request_timeout") from None
        try:
            body = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise bad(None, f"the body is not valid JSON: {clip(str(exc))}") from None
        if not isinstance(body, dict):
            raise bad(None, "the body must be a JSON object")
        return body

    def _check_model(self, body: dict) -> None:
        model = body.get("model")
        if model is not None and model != self.server.model_name:
            raise ApiError(404, f"unknown model {shown(model)}; this server serves {self.server.model_name!r} "
                           "(see /v1/models)", param="model", code="model_not_found")

    def _tokenize(self, body: dict, chat: bool) -> list[int]:
        tokenizer = self.server.tokenizer
        if not chat:
            return list(tokenizer.encode(parse_prompt(body)))
        messages = parse_messages(body)
        if not hasattr(tokenizer, "apply_chat_template") or getattr(tokenizer, "chat_template", "") is None:
            raise bad("messages", f"model {self.server.model_name!r} has no chat template: use /v1/completions")
        try:
            text = tokenizer.apply_chat_template(messages)
        except ValueError as exc:
            raise bad("messages", f"the chat template failed: {clip(str(exc))}") from None
        return list(tokenizer.encode(text, add_special_tokens=False))

    def _submit(self, body: dict, chat: bool) -> tuple[list[RequestHandle], int]:
        """Validate, tokenise and submit the request's n choices; (handles, prompt tokens)."""
        if not self._ready:
            raise ApiError(503, "the server is warming up or shutting down; retry when /health answers 200",
                           type="service_unavailable", code="unavailable")
        self._check_model(body)
        cfg = self.config
        params = parse_sampling(body, chat=chat, default_max_tokens=cfg.default_max_tokens,
                                max_strings=cfg.max_stop_strings, max_chars=cfg.max_stop_chars)
        n = _integer(body, "n", 1)
        if not 1 <= n <= MAX_N:
            raise bad("n", f"'n' must be in [1, {MAX_N}], got {n}")
        if body.get("stream_options") is not None:
            options = body["stream_options"]
            if not body.get("stream"):
                raise bad("stream_options", "'stream_options' needs 'stream': true")
            if not isinstance(options, dict):
                raise bad("stream_options", f"'stream_options' must be an object, got {shown(options)}")
            _boolean(options, "include_usage", False)
        prompt = self._tokenize(body, chat)
        requests = [Request(secrets.token_hex(8), prompt, params if params.seed is None or i == 0 else
                            SamplingParams(**{**params.__dict__, "seed": (params.seed + i) % 2**31}))
                    for i in range(n)]
        try:
            validate_request(requests[0], self.server.limits)
        except InvalidRequestError as exc:
            raise bad(_param_of(exc.reason), exc.reason) from None
        handles: list[RequestHandle] = []
        try:
            for request in requests:
                handles.append(self.server.scheduler.submit(request))
        except BaseException as exc:
            for handle in handles:
                handle.cancel()
            if isinstance(exc, InvalidRequestError):
                raise bad(_param_of(exc.reason), exc.reason) from None
            if isinstance(exc, QueueFullError):
                raise ApiError(429, f"{exc}; retry later", type="rate_limit_error", code="queue_full") from None
            if isinstance(exc, SchedulerClosedError):
                raise ApiError(503, "the server is shutting down", type="service_unavailable",
                               code="unavailable") from None
            raise
        self.server.metrics.record_prompt(len(prompt) * n)
        return handles, len(prompt)

    async def _events(self, handles: list[RequestHandle]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(choice index, event) of every choice until each one's final event; leaving early (a
        disconnect, an error) cancels what is still running."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[tuple[int, RequestOutput]] = asyncio.Queue()

        def forward(index: int) -> Callable[[RequestOutput], None]:
            def put(event: RequestOutput) -> None:  # on the scheduler's thread: hand over, return at once
                with contextlib.suppress(RuntimeError):  # the loop closed: nobody reads any more
                    loop.call_soon_threadsafe(events.put_nowait, (index, event))
            return put

        for i, handle in enumerate(handles):
            handle.listen(forward(i))
        try:
            open_choices = len(handles)
            while open_choices:
                index, event = await events.get()
                self.server.metrics.record_tokens(len(event.token_ids))
                if event.finished:
                    open_choices -= 1
                    self.server.metrics.record_result(event.result)
                yield index, event
        finally:
            for handle in handles:
                if not handle.done():
                    handle.cancel()

    def _final_error(self, result: RequestResult) -> ApiError | None:
        if result.finish_reason == FinishReason.ERROR:
            return ApiError(500, f"generation failed: {clip(str(result.error))}", type="server_error",
                            code="generation_failed")
        if result.finish_reason == FinishReason.CANCELLED:
            with self._lock:
                self.dropped += 1
            return ApiError(503, "the server stopped before the request finished", type="service_unavailable",
                            code="unavailable")
        return None

    # --- endpoints --------------------------------------------------------------------------

    async def _health(self, request: HttpRequest) -> Response:
        status = 200 if self._ready else 503
        self._count(request, status)
        return JSONResponse({"status": "ok" if self._ready else "unavailable"}, status_code=status)

    async def _models(self, request: HttpRequest) -> Response:
        try:
            self._authorize(request)
        except ApiError as exc:
            self._count(request, exc.status)
            return exc.response()
        engine, created = self.server.engine, 0
        data = [{"id": self.server.model_name, "object": "model", "created": created, "owned_by": "jaxspec",
                 "max_model_len": engine.menu.max_len}]
        if engine.proposer_name != "none":
            data.append({"id": engine.proposer_name, "object": "model", "created": created, "owned_by": "jaxspec",
                         "parent": self.server.model_name, "role": "proposer"})
        self._count(request, 200)
        return JSONResponse({"object": "list", "data": data})

    async def _chat(self, request: HttpRequest) -> Response:
        return await self._complete(request, chat=True)

    async def _completions(self, request: HttpRequest) -> Response:
        return await self._complete(request, chat=False)

    async def _complete(self, request: HttpRequest, chat: bool) -> Response:
        started = time.perf_counter()
        with self._lock:
            self._active += 1
        streaming, status = False, 200
        try:
            self._authorize(request)
            body = await self._read_json(request)
            stream = _boolean(body, "stream", False)
            handles, prompt_len = self._submit(body, chat)
            want_logprobs = parse_logprobs(body, chat=chat) is not None
            call_id = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
            head = {"id": call_id, "object": "chat.completion" if chat else "text_completion",
                    "created": int(time.time()), "model": self.server.model_name}
            if stream:
                include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
                outcome = {"status": 499}  # what the stream sets when it ends on its own

                def close() -> None:  # runs however the response ends, even before its first event
                    for handle in handles:
                        if not handle.done():
                            handle.cancel()
                    self._end_call(request, outcome["status"], started)

                streaming = True
                return _ClosingEventSource(
                    self._stream(handles, head, prompt_len, chat, include_usage, outcome, want_logprobs),
                    on_close=close, ping=15, sep="\n")
            return await self._respond(request, handles, head, prompt_len, chat, started, want_logprobs)
        except ApiError as exc:
            status = exc.status
            return exc.response()
        except Exception as exc:  # noqa: BLE001 - a bug must still answer in OpenAI's shape
            log.exception("HTTP completion failed")
            status = 500
            return ApiError(500, f"internal error: {shown(exc)}", type="server_error").response()
        finally:
            if not streaming:
                self._end_call(request, status)

    def _end_call(self, request: HttpRequest, status: int, started: float | None = None) -> None:
        self._count(request, status)
        if status == 200 and started is not None:
            self.server.metrics.record_latency(time.perf_counter() - started)
        with self._lock:
            self._active -= 1
            self._lock.notify_all()

    async def _respond(self, request: HttpRequest, handles: list[RequestHandle], head: dict, prompt_len: int,
                       chat: bool, started: float, want_logprobs: bool) -> Response:
        """The whole completion as one JSON body; a client that disconnects first cancels it."""
        results: list[RequestResult | None] = [None] * len(handles)

        async def collect() -> None:
            async for index, event in self._events(handles):
                if event.finished:
                    results[index] = event.result

        async def disconnected() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass

        work, watch = asyncio.ensure_future(collect()), asyncio.ensure_future(disconnected())
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (work, watch):
                task.cancel()
        if not work.done() or work.cancelled():
            with contextlib.suppress(asyncio.CancelledError):
                await work  # its cleanup cancelled the requests
            raise ApiError(499, "the client disconnected", code="client_closed")
        work.result()
        choices = []
        for i, result in enumerate(results):
            error = self._final_error(result)
            if error is not None:
                raise error
            logprobs = None
            if want_logprobs:
                view = LogprobsView(self.server.tokenizer, chat)
                logprobs = view.render(view.shown(result.logprobs, result.finish_reason))
            choice: dict[str, Any] = {"index": i, "finish_reason": FINISH_REASONS[result.finish_reason],
                                      "logprobs": logprobs, "jaxspec": speculation_stats(result)}
            if chat:
                choice["message"] = {"role": "assistant", "content": result.text}
            else:
                choice["text"] = result.text
            choices.append(choice)
        completion = sum(len(r.token_ids) for r in results)
        self.server.metrics.record_latency(time.perf_counter() - started)
        return JSONResponse({**head, "choices": choices,
                             "usage": usage(prompt_len, completion, [r.cached_prompt_tokens for r in results])})

    async def _stream(self, handles: list[RequestHandle], head: dict, prompt_len: int, chat: bool,
                      include_usage: bool, outcome: dict, want_logprobs: bool) -> AsyncIterator[dict]:
        """SSE events: one chunk per engine step's new text per choice, each choice's last chunk with its
        finish_reason, the usage chunk when asked, then [DONE]. Sets outcome["status"] when it ends."""
        head = {**head, "object": "chat.completion.chunk" if chat else "text_completion"}
        extra = {"usage": None} if include_usage else {}
        completion, cached = 0, []
        views = [LogprobsView(self.server.tokenizer, chat) for _ in handles]

        def chunk(index: int, text: str | None, finish: str | None = None, logprobs: tuple = (), **fields) -> dict:
            shown = views[index].render(logprobs) if want_logprobs and logprobs else None
            choice: dict[str, Any] = {"index": index, "finish_reason": finish, "logprobs": shown, **fields}
            if chat:
                choice["delta"] = {} if text is None else {"content": text}
            else:
                choice["text"] = text or ""
            return {"data": json.dumps({**head, "choices": [choice], **extra})}

        if chat:
            for i in range(len(handles)):
                yield {"data": json.dumps({**head, "choices": [{"index": i, "delta": {"role": "assistant",
                                           "content": ""}, "finish_reason": None, "logprobs": None}], **extra})}
        async for index, event in self._events(handles):
            if not event.finished:
                if event.text or event.logprobs:
                    yield chunk(index, event.text, logprobs=event.logprobs)
                continue
            result = event.result
            error = self._final_error(result)
            if error is not None:
                outcome["status"] = error.status
                yield {"data": json.dumps(error.body())}
                return
            completion += len(result.token_ids)
            cached.append(result.cached_prompt_tokens)
            logprobs = LogprobsView.shown(event.logprobs, result.finish_reason)
            if event.text or logprobs:
                yield chunk(index, event.text, logprobs=logprobs)
            yield chunk(index, None, FINISH_REASONS[result.finish_reason], jaxspec=speculation_stats(result))
        if include_usage:
            yield {"data": json.dumps({**head, "choices": [], "usage": usage(prompt_len, completion, cached)})}
        outcome["status"] = 200
        yield {"data": "[DONE]"}


def usage(prompt_len: int, completion: int, cached: list[int]) -> dict:
    """The response's `usage`: the prompt counted once; its cached tokens are those every choice was served from
    the prefix cache (the fewest)."""
    return {"prompt_tokens": prompt_len, "completion_tokens": completion, "total_tokens": prompt_len + completion,
            "prompt_tokens_details": {"cached_tokens": min(cached, default=0)}}


class _ClosingEventSource(EventSourceResponse):
    """An SSE response that calls `on_close()` however it ends (done, failed, or the client gone)."""

    def __init__(self, content: AsyncIterator[dict], *, on_close: Callable[[], None], **kwargs):
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def start_http(server: Any, port: int) -> OpenAIServer:
    """Bind the OpenAI API of `server` (a GenerationServer) on `port`; /health answers 503 until mark_ready()."""
    return OpenAIServer(server, port).start()


__all__ = ["ApiError", "OpenAIServer", "parse_sampling", "speculation_stats", "start_http"]
