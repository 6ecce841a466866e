"""Timing-dependent paths on a server whose engine steps can be held at a gate: a full queue,
cancellation within one step, deadlines, warm-up gating; and bearer-token auth (this server needs one).
On the fake engine, except `build_server` end to end (a real tiny engine, profiled once)."""

from __future__ import annotations

import time

import grpc
import pytest

from jaxspec.engine.fake import FakeEngine
from jaxspec.serving.proto.jaxspec.v1 import generation_pb2 as pb
from jaxspec.serving.serve_config import ServeConfig
from jaxspec.serving.service import SERVICE_NAME, GenerationServer
from tests.fake_tokenizer import ascii_tokenizer
from tests.serving.conftest import (
    HOST,
    StepGate,
    all_slots_free,
    client_for,
    fake_engine,
    free_port,
    small_menu,
    start_server,
    wait_until,
)

TOKEN = "s3cret-token"
LONG = dict(prompt="hold on", max_tokens=30, ignore_eos=True)


@pytest.fixture(scope="module")
def gated():
    engine = fake_engine(slots=2)
    gate = StepGate(engine)
    server = start_server(engine, ascii_tokenizer(), None, max_queue=2, auth_token=TOKEN)
    client = client_for(server, auth_token=TOKEN)
    yield server, client, gate
    gate.open()
    client.close()
    assert server.shutdown(drain=True, timeout=10)


@pytest.fixture
def gate(gated):
    server, _, gate = gated
    yield gate
    gate.open()
    wait_until(lambda: server.scheduler.num_live == 0, what="the scheduler to be idle")


def code(server, name: str) -> float:
    return server.metrics.requests.labels("Generate", name)._value.get()


def first_message(call) -> pb.GenerateResponse:
    message = next(call)
    assert message.token_ids
    return message


def test_auth_is_required_except_for_health(gated):
    server, client, _ = gated
    for token in (None, "wrong"):
        anonymous = client_for(server, auth_token=token)
        with pytest.raises(grpc.RpcError) as info:
            list(anonymous.generate("hi", max_tokens=2))
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert info.value.details() == ("missing bearer token" if token is None else "invalid bearer token")
        with pytest.raises(grpc.RpcError) as info:
            anonymous.list_models()
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert anonymous.health() == "SERVING"  # health checks are exempt
        anonymous.close()
    assert server.metrics.requests.labels("Generate", "UNAUTHENTICATED")._value.get() == 2
    assert [m.name for m in client.list_models()] == ["tiny"]
    assert list(client.generate("hi", max_tokens=2, ignore_eos=True))[-1].finish_reason == pb.FINISH_REASON_LENGTH


def test_full_queue_is_resource_exhausted_then_serves_normally(gated, gate):
    server, client, _ = gated
    gate.close()
    running = [client.generate(**LONG)]
    first_message(running[0])  # admitted, prefilled, first token out; its next step waits at the gate
    assert gate.blocked.wait(10)
    queued = [client.generate(**LONG) for _ in range(2)]  # the held loop admits nothing: the queue fills
    wait_until(lambda: server.scheduler.num_waiting == 2, what="two queued requests")
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as info:
        list(client.generate(**LONG))
    assert time.monotonic() - t0 < 2.0  # at once, not after a wait
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "queue is full" in info.value.details()
    gate.open()
    for call in running + queued:
        messages = list(call)
        assert messages[-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert messages[-1].stats.completion_tokens == LONG["max_tokens"]
    assert list(client.generate("hi", max_tokens=3, ignore_eos=True))[-1].stats.completion_tokens == 3
    assert code(server, "RESOURCE_EXHAUSTED") == 1


def test_cancel_frees_the_slot_within_one_step(gated, gate):
    server, client, _ = gated
    scheduler = server.scheduler
    gate.close()  # before the call: a fake engine's 30 steps would be over before it closed
    call = client.generate(**LONG)
    request_id = first_message(call).request_id
    assert gate.blocked.wait(10)  # the request's next step is in progress (held)
    steps = scheduler.steps_run
    call.cancel()
    # the server's on-termination callback reaches the scheduler while the step is still held
    wait_until(lambda: request_id in scheduler._cancel_ids, what="the cancellation to reach the scheduler")
    gate.open()
    wait_until(lambda: scheduler.num_running == 0, what="the slot to be freed")
    assert scheduler.steps_run <= steps + 1  # only the step that was in progress ran
    assert all_slots_free(server.engine)
    wait_until(lambda: code(server, "CANCELLED") == 1, what="the call counted as CANCELLED")


def test_deadline_is_honoured(gated, gate):
    server, client, _ = gated
    gate.close()
    t0 = time.monotonic()
    call = client.generate(**LONG, timeout=0.5)
    first_message(call)  # the server got the call before this: its deadline is < now + 0.5 s
    t_first = time.monotonic()
    with pytest.raises(grpc.RpcError) as info:
        list(call)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - t0 < 3.0
    time.sleep(max(0.0, t_first + 0.5 - time.monotonic()))  # the server's copy of the deadline has passed too
    assert server.scheduler.num_running == 1  # still held at the gate
    gate.open()
    wait_until(lambda: server.scheduler.num_live == 0 and server.scheduler.num_running == 0,
               what="the slot to be freed")
    wait_until(lambda: code(server, "DEADLINE_EXCEEDED") == 1, what="the call counted as DEADLINE_EXCEEDED")


def test_unavailable_and_not_serving_until_warm():
    """Health is NOT_SERVING and Generate UNAVAILABLE while the menu compiles; SERVING afterwards."""
    engine = FakeEngine(small_menu(slots=1, max_len=64), vocab_size=64)
    seen = {}
    warmup = engine.warmup

    def probing_warmup(progress=True):  # runs inside start(), after the port is bound
        with client_for(server) as probe:
            seen["health"] = probe.health()
            with pytest.raises(grpc.RpcError) as info:
                list(probe.generate("hi", max_tokens=2))
            seen["generate"] = (info.value.code(), info.value.details())
        return warmup(progress=progress)

    engine.warmup = probing_warmup
    server = GenerationServer(engine, ascii_tokenizer(), None, ServeConfig(host=HOST, port=free_port()),
                              model_name="tiny")
    server.start()
    try:
        assert seen["health"] == "NOT_SERVING"
        assert seen["generate"][0] == grpc.StatusCode.UNAVAILABLE and "warming up" in seen["generate"][1]
        with client_for(server) as probe:
            assert probe.health() == probe.health(SERVICE_NAME) == "SERVING"
    finally:
        server.shutdown()


def test_build_server_profiles_a_goodput_policy_once(tmp_path, monkeypatch):
    """`jaxspec serve --model tiny --tokenizer ascii --proposer ngram`: the default policy is goodput; the
    first start measures and saves the cost profile, the next one loads it."""
    from jaxspec.engine import profiler
    from jaxspec.serving.serve_cmd import build_server

    monkeypatch.setenv("JAXSPEC_PROFILE_DIR", str(tmp_path / "profiles"))
    menu = tmp_path / "menu.yaml"
    menu.write_text("num_slots: 1\nmax_len: 64\nbatch_buckets: [1]\nk_menu: [0, 2]\nwindow_buckets: [64]\n"
                    "prefill_buckets: [16]\n")
    config = ServeConfig(model="tiny", tokenizer="ascii", proposer="ngram", menu=str(menu), host=HOST, port=free_port())
    server = build_server(config, progress=False).start()
    try:
        assert server.policy.name == "goodput"
        [saved] = (tmp_path / "profiles").glob("*.json")
        assert saved.name == profiler.profile_key(server.engine).filename()
        with client_for(server) as client:
            [model] = client.list_models()
            assert (model.name, model.policy, list(model.k_menu)) == ("tiny", "goodput", [0, 2])
            assert model.proposer == server.engine.proposer_name
            assert len(list(client.generate("abab abab ab", max_tokens=6, ignore_eos=True))) >= 2
    finally:
        server.shutdown()

    def no_profiling(*args, **kwargs):
        raise AssertionError("profiled again although a matching profile was saved")

    monkeypatch.setattr(profiler, "profile_engine", no_profiling)
    again = build_server(config, progress=False).start()
    try:
        assert again.policy.name == "goodput"
    finally:
        again.shutdown()
