"""Bearer-token authentication for the gRPC server, as a server interceptor; where a token comes from.

Every call must carry the metadata `authorization: Bearer <token>` (the scheme in any letter case,
RFC 7235); otherwise it ends with UNAUTHENTICATED, decided from its metadata alone: the request
message is never awaited or deserialised. The standard health service is exempt, so load balancers
and orchestrators can probe the server without the secret.

A token is given on the command line (`--auth-token`, visible to every local user in `ps`), in a
file (`--auth-token-file`) or in the environment variable JAXSPEC_AUTH_TOKEN (`resolve_token`).
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Callable, Mapping
from pathlib import Path

import grpc

HEALTH_PREFIX = "/grpc.health.v1.Health/"
TOKEN_ENV = "JAXSPEC_AUTH_TOKEN"
SCHEME = "bearer"


class BearerTokenInterceptor(grpc.ServerInterceptor):
    """Rejects calls without the right bearer token (compared in constant time).

    on_reject(method): called for every rejected call (e.g. to count it in the metrics).
    """

    def __init__(self, token: str, on_reject: Callable[[str], None] | None = None,
                 exempt_prefixes: tuple[str, ...] = (HEALTH_PREFIX,)):
        if not token:
            raise ValueError("the auth token must be a non-empty string")
        self._expected = token.encode()
        self._on_reject = on_reject
        self._exempt = exempt_prefixes

    def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        if method.startswith(self._exempt):
            return continuation(handler_call_details)
        given = next((v for k, v in handler_call_details.invocation_metadata or () if k == "authorization"), None)
        if given is not None and hmac.compare_digest(_credentials(given), self._expected):
            return continuation(handler_call_details)
        if self._on_reject is not None:
            self._on_reject(method)
        return _rejecting_handler("missing bearer token" if given is None else "invalid bearer token")


def _credentials(value: str | bytes) -> bytes:
    """The token of an `authorization` value 'Bearer <token>' (scheme in any case, 1+ spaces); b'' if
    it has another scheme."""
    text = value.decode("utf-8", "replace") if isinstance(value, bytes) else value
    scheme, _, token = text.partition(" ")
    return token.lstrip(" ").encode() if scheme.lower() == SCHEME else b""


def _rejecting_handler(message: str) -> grpc.RpcMethodHandler:
    """Ends any call with UNAUTHENTICATED. Registered request-streaming, so gRPC runs it at once and
    never awaits or deserialises the request (the same handler for every method: nothing about a
    method is revealed before authentication)."""

    def reject(_requests, context):
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    return grpc.stream_stream_rpc_method_handler(reject)


def resolve_token(token: str | None, token_file: str | Path | None,
                  environ: Mapping[str, str] = os.environ) -> str | None:
    """The bearer token from `token` (a flag), else the file `token_file` (surrounding
    whitespace stripped), else $JAXSPEC_AUTH_TOKEN; None when none is given. Both flags, an empty file or an
    empty variable raise ValueError; a missing file FileNotFoundError."""
    if token is not None and token_file is not None:
        raise ValueError("give either --auth-token or --auth-token-file, not both")
    if token_file is not None:
        path = Path(token_file)
        if not path.is_file():
            raise FileNotFoundError(f"auth token file {path} does not exist")
        token = path.read_text().strip()
        if not token:
            raise ValueError(f"auth token file {path} is empty")
        return token
    if token is not None:
        return token
    if TOKEN_ENV in environ:
        if not environ[TOKEN_ENV]:
            raise ValueError(f"{TOKEN_ENV} is set but empty")
        return environ[TOKEN_ENV]
    return None
