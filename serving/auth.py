"""Bearer-token authentication for the gRPC server, as a server interceptor.

Every call must carry the metadata `authorization: Bearer <token>`; otherwise it ends with
UNAUTHENTICATED before reaching its handler. The standard health service is exempt, so load
balancers and orchestrators can probe the server without the secret.
"""

from __future__ import annotations

import hmac
from typing import Callable

import grpc

HEALTH_PREFIX = "/grpc.health.v1.Health/"


class BearerTokenInterceptor(grpc.ServerInterceptor):
    """Rejects calls without the right bearer token (compared in constant time).

    on_reject(method): called for every rejected call (e.g. to count it in the metrics).
    """

    def __init__(self, token: str, on_reject: Callable[[str], None] | None = None,
                 exempt_prefixes: tuple[str, ...] = (HEALTH_PREFIX,)):
        if not token:
            raise ValueError("the auth token must be a non-empty string")
        self._expected = f"Bearer {token}".encode()
        self._on_reject = on_reject
        self._exempt = exempt_prefixes

    def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        if method.startswith(self._exempt):
            return continuation(handler_call_details)
        given = next((v for k, v in handler_call_details.invocation_metadata or () if k == "authorization"), None)
        if given is not None and hmac.compare_digest(given.encode() if isinstance(given, str) else given,
                                                     self._expected):
            return continuation(handler_call_details)
        if self._on_reject is not None:
            self._on_reject(method)
        handler = continuation(handler_call_details)
        message = "missing bearer token" if given is None else "invalid bearer token"
        return _rejecting_handler(handler, message)


def _rejecting_handler(handler: grpc.RpcMethodHandler | None, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that ends the call with UNAUTHENTICATED."""

    def reject(request_or_iterator, context):
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    if handler is None:  # an unknown method: reveal nothing about it before authentication
        return grpc.unary_unary_rpc_method_handler(reject)
    kinds = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }
    make = kinds[(bool(handler.request_streaming), bool(handler.response_streaming))]
    return make(reject, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)
