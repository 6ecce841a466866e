"""The gRPC server over real sockets on 127.0.0.1, one tiny server for the module (the target as its
own draft, so proposals are accepted; SmartSpec goodput policy on synthetic costs): streamed == offline, 200 concurrent streams,
cancellation, bad input, health, reflection, metrics, the client CLI and the load-test script."""

from __future__ import annotations

import argparse
import io
import json
import math
import time
import urllib.request

import grpc
import pytest
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from benchmarks import load_test
from jaxspec.proposers.draft_model import DraftModelProposer
from jaxspec.scheduler import Request, Scheduler
from jaxspec.types import SamplingParams
from serving import client as client_cli
from serving.grpc_server import SERVICE_NAME
from serving.proto.jaxspec.v1 import generation_pb2 as pb
from tests.fake_tokenizer import ascii_tokenizer
from tests.serving.conftest import HOST, client_for, start_server, synthetic_goodput, tiny_engine, wait_until

LIMIT = 100  # --max-tokens-limit of this server
CASES = {
    "plain": dict(prompt="hello world", max_tokens=24),
    "repetitive": dict(prompt="the cat sat on the mat. the cat sat on the mat. the cat", max_tokens=40, ignore_eos=True),
    "abc": dict(prompt="abcabcabcabcabcabc", max_tokens=30, ignore_eos=True),
    "chat": dict(messages=[("system", "be brief"), ("user", "what is up?")], max_tokens=20, ignore_eos=True),
    "long": dict(prompt="a long prompt, " * 6, max_tokens=LIMIT, ignore_eos=True),  # capped by the context
}
FINISH = {"eos": pb.FINISH_REASON_EOS, "length": pb.FINISH_REASON_LENGTH, "stop": pb.FINISH_REASON_STOP}


def to_request(tokenizer, name: str, case: dict) -> Request:
    """What the server makes of a case (same tokenisation and parameters)."""
    if "messages" in case:
        messages = [{"role": r, "content": c} for r, c in case["messages"]]
        ids = tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)
    else:
        ids = tokenizer.encode(case["prompt"])
    return Request(name, ids, SamplingParams(max_tokens=case["max_tokens"], ignore_eos=case.get("ignore_eos", False),
                                             stop_strings=tuple(case.get("stop", ()))))


@pytest.fixture(scope="module")
def served(tiny_model):
    tokenizer = ascii_tokenizer()
    engine = tiny_engine(tiny_model, DraftModelProposer(tiny_model), k_menu=(0, 2))  # the target as its own draft
    cases = dict(CASES)
    # offline references (the scheduler in this thread), then a stop string cut from one of them
    first = Scheduler(engine, synthetic_goodput(engine), tokenizer).generate_all(
        [to_request(tokenizer, n, c) for n, c in cases.items()])
    text = first[1].text
    cases["stop"] = dict(CASES["repetitive"], stop=[text[10:13]])
    offline = Scheduler(engine, synthetic_goodput(engine), tokenizer).generate_all(
        [to_request(tokenizer, n, c) for n, c in cases.items()])
    references = {r.request_id: r for r in offline}
    assert references["stop"].finish_reason.value == "stop"
    server = start_server(engine, tokenizer, synthetic_goodput(engine), max_queue=256, metrics_port=0,
                          max_tokens_limit=LIMIT, default_max_tokens=16)
    client = client_for(server)
    yield server, client, cases, references
    client.close()
    assert server.shutdown(drain=True, timeout=10)


def collect(stream) -> tuple[str, list[int], list[pb.GenerateResponse]]:
    messages = list(stream)
    return "".join(m.text for m in messages), [t for m in messages for t in m.token_ids], messages


def check_against(messages, text, ids, reference) -> None:
    assert (text, ids) == (reference.text, list(reference.token_ids))
    last = messages[-1]
    assert last.finish_reason == FINISH[reference.finish_reason.value]
    assert all(m.finish_reason == pb.FINISH_REASON_UNSPECIFIED and not m.HasField("stats") for m in messages[:-1])
    assert last.stats.prompt_tokens == reference.prompt_len
    assert last.stats.completion_tokens == len(reference.token_ids)
    assert last.stats.HasField("time_to_first_token_s") and last.stats.time_to_first_token_s >= 0
    assert len({m.request_id for m in messages}) == 1


def test_health_and_list_models(served):
    server, client, _, _ = served
    assert client.health() == "SERVING"
    assert client.health(SERVICE_NAME) == "SERVING"
    [model] = client.list_models()
    assert (model.name, model.context_length, model.max_tokens_limit, model.vocab_size) == ("tiny", 128, LIMIT, 64)
    assert (model.proposer, model.policy, list(model.k_menu), model.chat_template) == ("draft:tiny", "goodput", [0, 2], True)


def test_streams_equal_offline_generation(served):
    server, client, cases, references = served
    calls = {name: client.generate(**case) for name, case in cases.items()}  # all in flight at once
    streamed = {}
    for name, call in calls.items():
        text, ids, messages = collect(call)
        check_against(messages, text, ids, references[name])
        streamed[name] = messages
    # the policy speculated and proposals were accepted: one message can carry several tokens
    messages = streamed["repetitive"]
    assert messages[-1].stats.accepted_tokens > 0 and max(len(m.token_ids) for m in messages) > 1


def test_200_concurrent_streams_complete(served):
    server, client, cases, references = served
    names = [list(cases)[i % len(cases)] for i in range(200)]
    t0 = time.monotonic()
    calls = [client.generate(**cases[n], timeout=60) for n in names]  # 200 streams open at once
    for name, call in zip(names, calls):
        text, ids, messages = collect(call)
        check_against(messages, text, ids, references[name])
    assert time.monotonic() - t0 < 60
    wait_until(lambda: server.scheduler.num_live == 0, what="every request to retire")


def _idle(server) -> bool:
    s = server.scheduler
    return s.num_live == 0 and s.num_running == 0 and not server.engine.lengths.any()


def test_cancel_and_disconnect_mid_stream_free_every_slot(served):
    server, client, _, references = served
    before = server.metrics.requests.labels("Generate", "CANCELLED")._value.get()
    long = dict(prompt="cancel me", max_tokens=LIMIT, ignore_eos=True)
    for round_ in range(3):
        calls = [client.generate(**long) for _ in range(12)]
        for i, call in enumerate(calls):
            if i % 3:  # two thirds read a message first; the rest are cancelled before any
                next(call)
            call.cancel()
        # disconnects: a channel closed under its open streams
        other = client_for(server)
        streams = [other.generate(**long) for _ in range(4)]
        for s in streams:
            next(s)
        other.close()
        wait_until(lambda: _idle(server), what="every slot to be freed")
    cancelled = server.metrics.requests.labels("Generate", "CANCELLED")._value.get() - before
    assert 3 * 12 <= cancelled <= 3 * 16  # calls cancelled before reaching the server leave no record
    text, ids, messages = collect(client.generate(**CASES["plain"]))  # still serving normally
    check_against(messages, text, ids, references["plain"])


def _raw_generate(server, payload: bytes, limit: int | None = None) -> grpc.RpcError:
    options = [] if limit is None else [("grpc.max_send_message_length", limit)]
    with grpc.insecure_channel(f"{HOST}:{server.port}", options) as channel:
        call = channel.unary_stream(f"/{SERVICE_NAME}/Generate", request_serializer=None,
                                    response_deserializer=pb.GenerateResponse.FromString)
        with pytest.raises(grpc.RpcError) as info:
            list(call(payload, timeout=10))
    return info.value


def _len_field(number: int, payload: bytes) -> bytes:
    assert len(payload) < 128
    return bytes([number << 3 | 2, len(payload)]) + payload


BAD = [
    (dict(prompt=""), "empty prompt"),
    (dict(prompt="hi", messages=[("user", "hi")]), "exactly one of 'prompt' and 'messages'"),
    (dict(prompt="x" * 200), "prompt too long: 200 tokens, but the context holds 128"),
    (dict(prompt="hi", max_tokens=0), "max_tokens must be > 0, got 0"),
    (dict(prompt="hi", max_tokens=-3), "max_tokens must be > 0, got -3"),
    (dict(prompt="hi", max_tokens=LIMIT + 1), f"max_tokens must be <= {LIMIT}, got {LIMIT + 1}"),
    (dict(prompt="hi", temperature=-0.5), "temperature must be >= 0, got -0.5"),
    (dict(prompt="hi", temperature=math.nan), "temperature must be >= 0, got nan"),
    (dict(prompt="hi", top_p=0.0), "top_p must be in (0, 1], got 0.0"),
    (dict(prompt="hi", top_p=1.5), "top_p must be in (0, 1], got 1.5"),
    (dict(prompt="hi", top_k=-1), "top_k must be >= 0, got -1"),
    (dict(prompt="hi", seed=-1), "seed must be in [0, 2^31), got -1"),
    (dict(prompt="hi", model="gpt-17"), "unknown model 'gpt-17'; this server serves 'tiny'"),
    (dict(prompt="hi", stop=[f"s{i}" for i in range(9)]), "too many stop strings: 9 (at most 8)"),
    (dict(prompt="hi", stop=[""]), "stop strings must be non-empty"),
    (dict(prompt="hi", stop=["x" * 300]), "a stop string has 300 characters (at most 256)"),
    (dict(messages=[("", "hi")]), "messages[0].role is empty"),
]


@pytest.mark.parametrize("kwargs, message", BAD, ids=[m for _, m in BAD])
def test_bad_input_is_invalid_argument(served, kwargs, message):
    server, client, _, _ = served
    with pytest.raises(grpc.RpcError) as info:
        list(client.generate(**kwargs))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in info.value.details()


def test_invalid_utf8_and_oversized_requests(served):
    server, client, _, _ = served
    # a Python client cannot even build these (protobuf refuses non-UTF-8 str fields): send raw bytes
    with pytest.raises(ValueError):
        pb.GenerateRequest(prompt=b"ab\xffcd")
    error = _raw_generate(server, _len_field(1, b"ab\xffcd"))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details() == "field 'prompt' is not valid UTF-8"
    user = _len_field(1, b"user")
    payload = _len_field(2, user + _len_field(2, b"hi")) + _len_field(2, user + _len_field(2, b"\xc3\x28"))
    error = _raw_generate(server, payload)
    assert (error.code(), error.details()) == (grpc.StatusCode.INVALID_ARGUMENT,
                                               "field 'messages[1].content' is not valid UTF-8")
    error = _raw_generate(server, b"\x0a\x05ab")  # truncated
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "malformed GenerateRequest" in error.details()
    over = pb.GenerateRequest(prompt="y" * (3 << 19)).SerializeToString()  # 1.5 MiB > max_message_bytes (1 MiB)
    error = _raw_generate(server, over, limit=4 << 20)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "(max_message_bytes)" in error.details()
    big = pb.GenerateRequest(prompt="y" * (2 << 20)).SerializeToString()  # > twice that: gRPC's transport limit
    assert _raw_generate(server, big, limit=4 << 20).code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    # the well-formed bytes of a good request work through the same raw path
    with grpc.insecure_channel(f"{HOST}:{server.port}") as channel:
        call = channel.unary_stream(f"/{SERVICE_NAME}/Generate", request_serializer=None,
                                    response_deserializer=pb.GenerateResponse.FromString)
        assert list(call(client.request("hi", max_tokens=3, ignore_eos=True).SerializeToString(), timeout=10))


def test_reflection_lists_the_services(served):
    server, _, _, _ = served
    with grpc.insecure_channel(f"{HOST}:{server.port}") as channel:
        db = ProtoReflectionDescriptorDatabase(channel)
        services = set(db.get_services())
        assert {SERVICE_NAME, "grpc.health.v1.Health"} <= services
        assert db.FindFileContainingSymbol(SERVICE_NAME).name == "jaxspec/v1/generation.proto"


def _scrape(server) -> str:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(f"http://{HOST}:{server.metrics_port}/metrics", timeout=10) as response:
        return response.read().decode()


def _value(text: str, sample: str) -> float:
    for line in text.splitlines():
        if line.startswith(sample + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{sample} not in the scrape")


def test_prometheus_metrics(served):
    server, client, cases, _ = served
    collect(client.generate(**cases["repetitive"]))
    with pytest.raises(grpc.RpcError):
        list(client.generate(prompt=""))
    text = _scrape(server)
    names = ["requests_total", "queue_depth", "running_slots", "time_to_first_token_seconds",
             "time_per_output_token_seconds", "request_latency_seconds", "generated_tokens_total",
             "prompt_tokens_total", "engine_steps_total", "engine_step_seconds", "chosen_k", "proposed_tokens_total",
             "accepted_tokens_total", "position_trials_total", "position_accepted_total", "acceptance_rate",
             "predicted_goodput_tokens_per_second", "realised_goodput_tokens_per_second", "compilations_total",
             "compilations_after_warmup", "ready"]
    helps = {line.split()[2]: line for line in text.splitlines() if line.startswith("# HELP ")}
    for name in names:
        help_line = helps[f"jaxspec_{name}"]
        assert len(help_line) > 80, help_line  # a definition, not just a name
    assert _value(text, 'jaxspec_requests_total{code="OK",method="Generate"}') >= 1
    assert _value(text, 'jaxspec_requests_total{code="INVALID_ARGUMENT",method="Generate"}') >= 1
    assert _value(text, "jaxspec_compilations_after_warmup") == 0  # nothing compiled while serving
    assert _value(text, "jaxspec_ready") == 1
    assert _value(text, "jaxspec_queue_depth") == 0 and _value(text, "jaxspec_running_slots") == 0
    steps = _value(text, "jaxspec_engine_steps_total")
    assert steps > 0 and _value(text, "jaxspec_chosen_k_count") == steps
    assert _value(text, 'jaxspec_chosen_k_bucket{le="0.0"}') < steps  # k = 2 was chosen too
    assert _value(text, "jaxspec_predicted_goodput_tokens_per_second_count") == steps
    assert _value(text, "jaxspec_realised_goodput_tokens_per_second_count") > 0
    proposed, accepted = _value(text, "jaxspec_proposed_tokens_total"), _value(text, "jaxspec_accepted_tokens_total")
    assert 0 < accepted <= proposed
    assert _value(text, 'jaxspec_acceptance_rate{position="all"}') == pytest.approx(accepted / proposed)
    trials_1 = _value(text, 'jaxspec_position_trials_total{position="1"}')
    assert trials_1 >= _value(text, 'jaxspec_position_trials_total{position="2"}') > 0
    assert _value(text, 'jaxspec_acceptance_rate{position="1"}') == pytest.approx(
        _value(text, 'jaxspec_position_accepted_total{position="1"}') / trials_1)
    assert _value(text, "jaxspec_generated_tokens_total") > 0
    assert _value(text, "jaxspec_time_to_first_token_seconds_count") > 0


def _client_args(server, prompt, *extra) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    client_cli.add_client_arguments(parser)
    return parser.parse_args([prompt, "--host", HOST, "--port", str(server.port), *extra])


def test_client_cli_streams_text(served):
    server, _, cases, references = served
    out, err = io.StringIO(), io.StringIO()
    case = cases["plain"]
    assert client_cli.run_client(_client_args(server, case["prompt"], "--max-tokens", str(case["max_tokens"]),
                                              "--stats"), out, err) == 0
    assert out.getvalue() == references["plain"].text + "\n"
    assert "completion" in err.getvalue()
    out = io.StringIO()
    (_, user), = [m for m in cases["chat"]["messages"] if m[0] == "user"]
    assert client_cli.run_client(_client_args(server, user, "--chat", "--system", "be brief", "--max-tokens", "20"),
                                 out, err) == 0
    assert out.getvalue().startswith(references["chat"].text[:5])  # the chat case (it also ignored eos)
    err = io.StringIO()
    assert client_cli.run_client(_client_args(server, "hi", "--max-tokens", "0"), io.StringIO(), err) == 1
    assert "INVALID_ARGUMENT: max_tokens must be > 0" in err.getvalue()


def test_load_test_smoke(served, tmp_path):
    server, client, _, _ = served
    config = load_test.LoadConfig(target=f"{HOST}:{server.port}", rates=(20.0, 60.0), duration_s=0.5,
                                  max_requests=20, max_tokens=12, ignore_eos=True)
    report = load_test.run_load_test(config)
    json_path, md_path = load_test.write_report(report, tmp_path)
    saved = json.loads(json_path.read_text())
    assert [s["rate"] for s in saved["summaries"]] == [20.0, 60.0]
    for summary in saved["summaries"]:
        assert summary["requests"] > 0 and summary["ok"] == summary["requests"]
        assert summary["ttft_s"]["p50"] > 0 and summary["tpot_s"]["p99"] >= summary["tpot_s"]["p50"] > 0
    assert all(s["tokens"] == 12 for s in saved["samples"])
    table = md_path.read_text()
    assert "| rate (req/s) |" in table and table.count("\n| ") == 3  # header + two rates
