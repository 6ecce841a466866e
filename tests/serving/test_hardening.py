"""A hostile client against a server with a bearer token: half-open calls (headers, never a request
message), garbage bodies, random method names, bearer-scheme spelling, oversized requests and
over-long echoed values. The server (on the fake engine) has a small pending-call cap and a short request
timeout."""

from __future__ import annotations

import argparse
import collections
import logging
import re
import threading

import grpc
import pytest

from jaxspec.serving import auth
from jaxspec.serving.client import GenerationClient
from jaxspec.serving.proto.jaxspec.v1 import generation_pb2 as pb
from jaxspec.serving.serve_cmd import add_serve_arguments, serve_config_from_args
from jaxspec.serving.service import SERVICE_NAME
from tests.fake_tokenizer import ascii_tokenizer
from tests.serving.conftest import HOST, client_for, fake_engine, start_server, wait_until

TOKEN = "hardening-token"
BEARER = (("authorization", f"Bearer {TOKEN}"),)
PENDING = 4  # max_pending_calls of this server
TIMEOUT_S = 2.0  # request_timeout_s of this server
# more half-open calls than the pre-fix cap of this server (maximum_concurrent_rpcs = queue 2 + slots 2 + 16)
HALF_OPEN = 40
CALL_TIMEOUT_S = 30.0  # the client's deadline on a half-open call: far past the server's request timeout
GENERATE = f"/{SERVICE_NAME}/Generate"
LIST_MODELS = f"/{SERVICE_NAME}/ListModels"
HEALTH_CHECK = "/grpc.health.v1.Health/Check"
REFLECTION = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"


@pytest.fixture(scope="module")
def guarded():
    server = start_server(fake_engine(slots=2), ascii_tokenizer(), None, max_queue=2, auth_token=TOKEN,
                          max_pending_calls=PENDING, request_timeout_s=TIMEOUT_S)
    client = client_for(server, auth_token=TOKEN)
    yield server, client
    client.close()
    assert server.shutdown(drain=True, timeout=10)


class HalfOpen:
    """`n` calls of `method` on one channel that send their headers and never a request message."""

    def __init__(self, server, method: str, n: int, metadata=()):
        self.channel = grpc.insecure_channel(f"{HOST}:{server.port}")
        self.release = threading.Event()
        open_call = self.channel.stream_stream(method)  # raw bytes; the wire is that of a unary request
        self.calls = [open_call(self._no_message(), metadata=metadata, timeout=CALL_TIMEOUT_S) for _ in range(n)]

    def _no_message(self):
        self.release.wait()
        return
        yield  # a generator that never yields a message

    def codes(self) -> collections.Counter:
        """How the calls ended (blocks until each has)."""
        return collections.Counter(call.code() for call in self.calls)

    def close(self) -> None:
        self.release.set()
        self.channel.close()


def _raw(server, method: str, payload: bytes, metadata=(), streaming: bool = False) -> grpc.RpcError:
    """Send `payload` as the request bytes of `method`; return the error it ends with."""
    with grpc.insecure_channel(f"{HOST}:{server.port}") as channel:
        with pytest.raises(grpc.RpcError) as info:
            if streaming:
                list(channel.unary_stream(method)(payload, metadata=metadata, timeout=10))
            else:
                channel.unary_unary(method)(payload, metadata=metadata, timeout=10)
    return info.value


def _generated(client: GenerationClient) -> int:
    messages = list(client.generate("still here", max_tokens=3, ignore_eos=True, timeout=30))
    assert messages[-1].finish_reason == pb.FINISH_REASON_LENGTH
    return messages[-1].stats.completion_tokens


# --- item 1: half-open calls -----------------------------------------------------------------------------


def test_half_open_calls_without_token_are_refused_from_metadata(guarded):
    """More half-open unauthenticated calls than the old cap: each is refused at once, without waiting
    for its body; health, ListModels and an authenticated Generate are served meanwhile."""
    server, client = guarded
    held = HalfOpen(server, GENERATE, HALF_OPEN)
    try:
        with client_for(server) as anonymous:  # health needs no token
            assert anonymous.health() == "SERVING"
        assert [m.name for m in client.list_models()] == ["tiny"]
        assert _generated(client) == 3
        assert held.codes() == {grpc.StatusCode.UNAUTHENTICATED: HALF_OPEN}  # their bodies never came
    finally:
        held.close()


def test_half_open_calls_with_token_are_capped_and_dropped_after_the_timeout(guarded):
    server, client = guarded
    timeouts = server.metrics.request_timeouts._value.get()
    held = HalfOpen(server, GENERATE, PENDING + 3, metadata=BEARER)
    try:
        wait_until(lambda: server.pending_calls == PENDING, what="the pending-call cap to fill")
        with client_for(server) as anonymous:
            assert anonymous.health() == "SERVING"  # health has threads of its own, outside the cap
        # the calls over the cap are refused at once; the held ones are cancelled after request_timeout_s
        assert held.codes() == {grpc.StatusCode.RESOURCE_EXHAUSTED: 3, grpc.StatusCode.CANCELLED: PENDING}
        assert "waiting for their request message" in next(
            c.details() for c in held.calls if c.code() == grpc.StatusCode.RESOURCE_EXHAUSTED)
    finally:
        held.close()
    assert server.metrics.request_timeouts._value.get() - timeouts == PENDING
    wait_until(lambda: server.pending_calls == 0, what="no pending calls")
    assert _generated(client) == 3


def test_half_open_health_list_models_and_reflection_are_dropped_too(guarded):
    server, client = guarded
    held = [HalfOpen(server, HEALTH_CHECK, 2), HalfOpen(server, LIST_MODELS, 1, metadata=BEARER),
            HalfOpen(server, REFLECTION, 1, metadata=BEARER)]
    try:
        with client_for(server) as anonymous:
            assert anonymous.health() == "SERVING"
        assert [h.codes() for h in held] == [{grpc.StatusCode.CANCELLED: 2}, {grpc.StatusCode.CANCELLED: 1},
                                             {grpc.StatusCode.CANCELLED: 1}]
    finally:
        for h in held:
            h.close()


def test_health_watch_still_streams(guarded):
    """Watch is the health service's non-blocking streaming method: the guard keeps it working."""
    from grpc_health.v1 import health_pb2

    server, _ = guarded
    with client_for(server) as anonymous:
        stream = anonymous.health_stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=10)
        assert next(stream).status == health_pb2.HealthCheckResponse.SERVING
        stream.cancel()


# --- items 2-4: metric labels, auth edge cases, garbage bodies -------------------------------------------


def test_metric_method_labels_are_bounded(guarded):
    server, _ = guarded
    names = [f"/evil.Service{i}/Method{i}" for i in range(30)] + ["/evil.Service/Generate"]
    for name in names:
        assert _raw(server, name, b"").code() == grpc.StatusCode.UNAUTHENTICATED
    labels = set(re.findall(r'jaxspec_requests_total\{[^}]*method="([^"]*)"', server.metrics.render()))
    assert "unknown" in labels and labels <= {"Generate", "ListModels", "unknown"}


def test_garbage_body_without_token_is_unauthenticated(guarded):
    server, _ = guarded
    garbage = b"\xff\xff\xff\xff"
    for method, streaming in ((LIST_MODELS, False), (GENERATE, True)):
        error = _raw(server, method, garbage, streaming=streaming)
        assert (error.code(), error.details()) == (grpc.StatusCode.UNAUTHENTICATED, "missing bearer token")


@pytest.mark.parametrize("value", [f"bearer {TOKEN}", f"BEARER {TOKEN}", f"Bearer   {TOKEN}"])
def test_bearer_scheme_is_case_insensitive(guarded, value):
    server, _ = guarded
    with grpc.insecure_channel(f"{HOST}:{server.port}") as channel:
        call = channel.unary_unary(LIST_MODELS, request_serializer=pb.ListModelsRequest.SerializeToString,
                                   response_deserializer=pb.ListModelsResponse.FromString)
        assert [m.name for m in call(pb.ListModelsRequest(), metadata=(("authorization", value),), timeout=10).models] \
            == ["tiny"]


@pytest.mark.parametrize("value", [f"Basic {TOKEN}", f"Bearer{TOKEN}", TOKEN, f"Bearer {TOKEN}x", "Bearer "])
def test_other_credentials_are_refused(guarded, value):
    server, _ = guarded
    error = _raw(server, LIST_MODELS, b"", metadata=(("authorization", value),))
    assert (error.code(), error.details()) == (grpc.StatusCode.UNAUTHENTICATED, "invalid bearer token")


def test_list_models_with_a_garbage_body_is_invalid_argument(guarded, caplog):
    server, _ = guarded
    with caplog.at_level(logging.DEBUG):
        error = _raw(server, LIST_MODELS, b"\xff\xff\xff\xff", metadata=BEARER)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details().startswith("malformed request message")
    assert not [r for r in caplog.records if r.exc_info], "a bad request logged a traceback"


def _serve_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return parser.parse_args(list(argv))


def test_token_from_environment_or_file(tmp_path, monkeypatch):
    monkeypatch.delenv(auth.TOKEN_ENV, raising=False)
    assert serve_config_from_args(_serve_args()).auth_token is None
    monkeypatch.setenv(auth.TOKEN_ENV, "from-env")
    assert serve_config_from_args(_serve_args()).auth_token == "from-env"
    path = tmp_path / "token"
    path.write_text("from-file\n")
    assert serve_config_from_args(_serve_args("--auth-token-file", str(path))).auth_token == "from-file"
    assert serve_config_from_args(_serve_args("--auth-token", "from-argv")).auth_token == "from-argv"
    with pytest.raises(ValueError, match="either --auth-token or --auth-token-file"):
        serve_config_from_args(_serve_args("--auth-token", "a", "--auth-token-file", str(path)))
    path.write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        serve_config_from_args(_serve_args("--auth-token-file", str(path)))
    with pytest.raises(FileNotFoundError):
        serve_config_from_args(_serve_args("--auth-token-file", str(tmp_path / "missing")))
    monkeypatch.setenv(auth.TOKEN_ENV, "")
    with pytest.raises(ValueError, match=f"{auth.TOKEN_ENV} is set but empty"):
        serve_config_from_args(_serve_args())
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    assert "ps" in parser.format_help() and auth.TOKEN_ENV in parser.format_help()


def test_client_reads_the_token_from_a_file(guarded, tmp_path, monkeypatch):
    import io

    from jaxspec.serving import client as client_cli

    server, _ = guarded
    monkeypatch.delenv(auth.TOKEN_ENV, raising=False)
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    parser = argparse.ArgumentParser()
    client_cli.add_client_arguments(parser)
    base = ["hi", "--host", HOST, "--port", str(server.port), "--max-tokens", "2"]
    out = io.StringIO()
    assert client_cli.run_client(parser.parse_args(base + ["--auth-token-file", str(path)]), out, io.StringIO()) == 0
    monkeypatch.setenv(auth.TOKEN_ENV, TOKEN)
    assert client_cli.run_client(parser.parse_args(base), io.StringIO(), io.StringIO()) == 0


# --- items 5-6: size limit, echoed values -----------------------------------------------------------------


def test_oversized_request_is_invalid_argument(guarded):
    server, client = guarded
    limit = server.config.max_message_bytes
    with pytest.raises(grpc.RpcError) as info:
        list(client.generate("y" * (limit + limit // 2), max_tokens=2))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert re.fullmatch(rf"the request is \d+ bytes; at most {limit} bytes are accepted \(max_message_bytes\)",
                        info.value.details()), info.value.details()
    assert _generated(client) == 3


def test_echoed_values_are_bounded(guarded):
    server, client = guarded
    name = "m" * 20_000
    with pytest.raises(grpc.RpcError) as info:
        list(client.generate("hi", model=name, max_tokens=2))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = info.value.details()
    assert details.startswith("unknown model 'mmm") and "…" in details and len(details) < 400, details
