"""Hostile clients, round 2 (issue 40): half-open health calls, one connection taking every pending
place, huge prompts, cancelled half-open calls in the metrics, extra request messages, oversized
messages, and where metrics and plain text may be served. The servers run on the fake engine."""

from __future__ import annotations

import re
import threading
import time

import grpc
import pytest

from jaxspec.serving.call_guard import PEER_GRACE_S
from jaxspec.serving.proto.jaxspec.v1 import generation_pb2 as pb
from jaxspec.serving.serve_config import ServeConfig
from jaxspec.serving.service import SERVICE_NAME, GenerationServer
from tests.fake_tokenizer import ascii_tokenizer
from tests.serving.conftest import HOST, client_for, fake_engine, free_port, start_server, wait_until

GENERATE = f"/{SERVICE_NAME}/Generate"
HEALTH_CHECK = "/grpc.health.v1.Health/Check"
PENDING = 8  # max_pending_calls of the server
PER_PEER = 3  # max_pending_calls_per_peer of the server
TIMEOUT_S = 20.0  # request_timeout_s: long, so that a held call stays held for the whole test
HEALTH_FLOOD = 150  # half-open health calls: more than the health service has threads
OWN_CONNECTION = (("grpc.use_local_subchannel_pool", 1),)  # a channel that shares no connection


class HalfOpen:
    """`n` calls of `method` on a connection of their own that send headers and never a request message."""

    def __init__(self, server, method: str, n: int):
        self.channel = grpc.insecure_channel(f"{HOST}:{server.port}", options=OWN_CONNECTION)
        self.release = threading.Event()
        self._open_call = self.channel.stream_stream(method)
        self.calls = []
        self.open(n)

    def open(self, n: int) -> None:
        """`n` more such calls on the same connection."""
        self.calls += [self._open_call(self._no_message(), timeout=60) for _ in range(n)]

    def _no_message(self):
        self.release.wait()
        return
        yield  # a generator that never yields a message

    def cancel(self) -> None:
        for call in self.calls:
            call.cancel()

    def close(self) -> None:
        self.release.set()
        self.channel.close()


def _codes(server: GenerationServer) -> dict[str, float]:
    """jaxspec_requests_total of Generate by code."""
    found = re.findall(r'jaxspec_requests_total\{code="(\w+)",method="Generate"\} (\S+)', server.metrics.render())
    return {code: float(value) for code, value in found}


def _delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {code: after.get(code, 0.0) - before.get(code, 0.0) for code in after
            if after.get(code, 0.0) != before.get(code, 0.0)}


@pytest.fixture(scope="module")
def server():
    server = start_server(fake_engine(slots=2), ascii_tokenizer(), None, max_queue=4, max_pending_calls=PENDING,
                          max_pending_calls_per_peer=PER_PEER, request_timeout_s=TIMEOUT_S)
    yield server
    assert server.shutdown(drain=True, timeout=10)


def _wait_counted(server: GenerationServer, before: dict[str, float], cancelled: int) -> None:
    """Until the calls a test cancelled on the shared server are gone and counted: a cancellation is counted when
    its call ends, which can be after the server's pending count dropped, and a count landing in the next test
    would be that test's (it saw CANCELLED one higher than its own calls under a loaded machine)."""
    wait_until(lambda: server.pending_calls == 0, what="no pending calls")
    wait_until(lambda: _delta(before, _codes(server)).get("CANCELLED", 0) >= cancelled,
               what="the cancellations counted")


def _generated(server) -> int:
    with client_for(server) as client:
        messages = list(client.generate("still here", max_tokens=3, ignore_eos=True, timeout=30))
    assert messages[-1].finish_reason == pb.FINISH_REASON_LENGTH
    return messages[-1].stats.completion_tokens


# --- item 1: health under half-open health calls --------------------------------------------------------


def test_health_answers_under_more_half_open_health_calls_than_it_has_threads(server):
    held = HalfOpen(server, HEALTH_CHECK, HEALTH_FLOOD)
    try:
        with client_for(server) as probe:
            for _ in range(3):
                assert probe.health(timeout=10) == "SERVING"
    finally:
        held.cancel()
        held.close()


# --- item 2: one connection cannot take every pending place ---------------------------------------------


def test_one_connection_cannot_take_every_pending_place(server):
    """A burst of half-open calls from one connection gets at most half of the pending places (the other
    half stays for other connections); once its calls have waited PEER_GRACE_S, it gets PER_PEER."""
    per_connection = max(PER_PEER, PENDING // 2)
    before = _codes(server)
    held = HalfOpen(server, GENERATE, PENDING)
    try:
        wait_until(lambda: server.pending_calls == per_connection, what="the connection's pending places to fill")
        assert _generated(server) == 3  # another connection still has places
        held.cancel()
        codes = [call.code() for call in held.calls]
        refused = [c for c in held.calls if c.code() == grpc.StatusCode.RESOURCE_EXHAUSTED]
        assert len(refused) == PENDING - per_connection, codes
        assert "per connection" in refused[0].details()
    finally:
        held.close()
    _wait_counted(server, before, per_connection)


def test_a_connection_whose_calls_stay_half_open_keeps_only_its_share(server):
    before = _codes(server)
    held = HalfOpen(server, GENERATE, PER_PEER)
    try:
        wait_until(lambda: server.pending_calls == PER_PEER, what="the connection's calls to wait")
        time.sleep(PEER_GRACE_S + 0.1)  # the calls age past the grace (a duration, not a stand-in for a condition)
        held.open(1)
        extra = held.calls[-1]
        wait_until(lambda: extra.done(), what="the extra call to be answered")
        assert extra.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_pending_calls_per_peer" in extra.details()
        assert server.pending_calls == PER_PEER
    finally:
        held.cancel()
        held.close()
    _wait_counted(server, before, PER_PEER)


# --- item 3: huge prompts are refused by their bytes, before tokenizing ---------------------------------


class CountingTokenizer:
    """The ascii tokenizer, counting the characters it was asked to encode."""

    def __init__(self):
        self._inner = ascii_tokenizer()
        self.encoded_chars = 0

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.encoded_chars += len(text)
        return self._inner.encode(text, add_special_tokens)


def test_a_prompt_over_the_byte_bound_is_refused_without_tokenizing():
    tokenizer = CountingTokenizer()
    server = start_server(fake_engine(slots=1), tokenizer, None)
    try:
        bound = server.max_prompt_bytes
        assert bound < server.config.max_message_bytes // 2  # the check is reachable below the message limit
        with client_for(server) as client:
            with pytest.raises(grpc.RpcError) as info:
                list(client.generate("y" * (bound + 1), max_tokens=2, timeout=30))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert f"at most {bound} bytes" in info.value.details(), info.value.details()
            assert tokenizer.encoded_chars == 0
            with pytest.raises(grpc.RpcError) as info:  # the same through the chat messages
                list(client.generate(messages=[("user", "y" * (bound + 1))], max_tokens=2, timeout=30))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert tokenizer.encoded_chars == 0
            assert sum(len(m.token_ids) for m in client.generate("hi", max_tokens=2, ignore_eos=True)) == 2
    finally:
        server.shutdown(timeout=10)


# --- item 5: cancelled half-open calls count as CANCELLED ----------------------------------------------


def test_half_open_calls_the_client_cancels_count_as_cancelled(server):
    before = _codes(server)
    held = HalfOpen(server, GENERATE, PER_PEER)
    try:
        wait_until(lambda: server.pending_calls == PER_PEER, what="the calls to be pending")
        held.cancel()
        wait_until(lambda: _delta(before, _codes(server)).get("CANCELLED", 0) >= PER_PEER, what="CANCELLED counts")
        wait_until(lambda: server.pending_calls == 0, what="no pending calls")
    finally:
        held.close()
    assert _delta(before, _codes(server)) == {"CANCELLED": PER_PEER}


def test_half_open_calls_the_server_times_out_count_once_as_cancelled():
    server = start_server(fake_engine(slots=1), ascii_tokenizer(), None, request_timeout_s=0.5)
    before = _codes(server)
    held = HalfOpen(server, GENERATE, 3)
    try:
        assert {call.code() for call in held.calls} == {grpc.StatusCode.CANCELLED}
        wait_until(lambda: server.pending_calls == 0, what="no pending calls")
        # the server counts each call as its handler thread ends, which may be after the client saw it end
        wait_until(lambda: sum(_delta(before, _codes(server)).values()) >= 3, what="the three calls counted")
        assert _delta(before, _codes(server)) == {"CANCELLED": 3}
    finally:
        held.close()
        server.shutdown(timeout=10)


# --- item 6: a unary call with two request messages ----------------------------------------------------


def test_a_second_request_message_is_invalid_argument(server):
    message = pb.GenerateRequest(prompt="hi", max_tokens=2).SerializeToString()
    with grpc.insecure_channel(f"{HOST}:{server.port}") as channel:
        with pytest.raises(grpc.RpcError) as info:
            list(channel.stream_stream(GENERATE)(iter([message, message]), timeout=10))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "exactly one request message" in info.value.details()


# --- item 7: RESOURCE_EXHAUSTED says whether to retry ------------------------------------------------


def _pushback(error: grpc.RpcError) -> str | None:
    return next((m.value for m in error.trailing_metadata() or () if m.key == "grpc-retry-pushback-ms"), None)


def test_busy_refusals_carry_a_pushback_and_the_transport_size_refusal_does_not(server):
    held = HalfOpen(server, GENERATE, max(PER_PEER, PENDING // 2) + 1)  # one more than a connection may hold
    try:
        busy = next(c for c in held.calls if c.code() == grpc.StatusCode.RESOURCE_EXHAUSTED)
        assert _pushback(busy) is not None and int(_pushback(busy)) > 0
    finally:
        held.cancel()
        held.close()
    oversized = pb.GenerateRequest(prompt="y" * (2 * server.config.max_message_bytes + 1)).SerializeToString()
    with grpc.insecure_channel(f"{HOST}:{server.port}") as channel:
        with pytest.raises(grpc.RpcError) as info:
            list(channel.unary_stream(GENERATE)(oversized, timeout=30))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert _pushback(info.value) is None  # not retryable: see README, "what a client can and cannot do"


# --- item 9: metrics on loopback, no plain text off loopback without a flag -------------------------------


def test_metrics_bind_to_loopback_whatever_the_serving_host():
    config = ServeConfig(host="127.0.0.2", port=free_port("127.0.0.2"), metrics_port=0)
    server = GenerationServer(fake_engine(slots=1), ascii_tokenizer(), None, config, model_name="tiny").start()
    try:
        assert server.metrics_address[0] == "127.0.0.1"
    finally:
        server.shutdown(timeout=10)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "example.org"])
def test_plain_text_off_loopback_needs_a_flag(host, tmp_path):
    with pytest.raises(ValueError, match="allow_plaintext"):
        ServeConfig(host=host)
    assert ServeConfig(host=host, allow_plaintext=True).host == host
    assert ServeConfig(host=host, tls_cert="c.pem", tls_key="k.pem").host == host


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "localhost", "::1"])
def test_plain_text_on_loopback_needs_no_flag(host):
    assert ServeConfig(host=host).host == host


def test_the_new_limits_are_serve_flags(monkeypatch):
    import argparse

    from jaxspec.serving import auth
    from jaxspec.serving.serve_cmd import add_serve_arguments, serve_config_from_args

    monkeypatch.delenv(auth.TOKEN_ENV, raising=False)
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    config = serve_config_from_args(parser.parse_args(["--host", "0.0.0.0", "--allow-plaintext", "--metrics-host",
                                                       "127.0.0.3", "--max-pending-calls-per-peer", "2"]))
    assert (config.allow_plaintext, config.metrics_host, config.max_pending_calls_per_peer) == (True, "127.0.0.3", 2)
    with pytest.raises(ValueError, match="allow_plaintext"):
        serve_config_from_args(parser.parse_args(["--host", "0.0.0.0"]))
    assert ServeConfig().metrics_host == "127.0.0.1"
