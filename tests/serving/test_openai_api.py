"""The OpenAI-compatible HTTP API (jaxspec/serving/openai_api.py), driven by the official `openai` client against a live
`jaxspec serve --http-port` process: the tiny model for most (one server for the module), the default model once
(slow). Every engine step of the tiny server sleeps STEP_DELAY s (tests.serving.serve_entry) so streams are in
flight long enough to disconnect from."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest

from benchmarks import load_test
from jaxspec.serving.client import GenerationClient
from tests.serving.conftest import HOST, free_port, wait_until

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "s3cret"
STEP_DELAY = 0.02
MAX_QUEUE = 4
LOGPROBS = 3  # the served engine's --logprobs
GREEDY = dict(temperature=0, max_tokens=12, extra_body={"ignore_eos": True})


class Served:
    """A `jaxspec serve` process with its gRPC, HTTP and metrics addresses."""

    def __init__(self, *flags: str, announce: str, timeout: float = 180, delay: float = STEP_DELAY):
        env = dict(os.environ, JAXSPEC_TEST_STEP_DELAY=str(delay), PYTHONPATH=str(ROOT))
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.serving.serve_entry", *flags, "--host", HOST,
                                      "--port", str(free_port()), "--http-port", str(free_port()),
                                      "--metrics-port", "0"],
                                     cwd=ROOT, env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
        self.lines: list[str] = []
        threading.Thread(target=lambda: self.lines.extend(self.proc.stderr), daemon=True).start()
        pattern = re.compile(rf"jaxspec serve: {announce} on [\d.]+:(\d+), HTTP on [\d.]+:(\d+), metrics on :(\d+)")
        wait_until(lambda: any(pattern.search(l) for l in list(self.lines)) or self.proc.poll() is not None,
                   timeout=timeout, what="the server to start")
        assert self.proc.poll() is None, "".join(self.lines)
        grpc_port, http_port, metrics_port = next(pattern.search(l) for l in self.lines if pattern.search(l)).groups()
        self.grpc = f"{HOST}:{grpc_port}"
        self.base = f"http://{HOST}:{http_port}"
        self.metrics = f"http://{HOST}:{metrics_port}/metrics"

    def client(self, token: str = TOKEN, **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base}/v1", api_key=token, max_retries=0, timeout=60, **kwargs)

    def metric(self, name: str, labels: str = "") -> float:
        text = urllib.request.urlopen(self.metrics, timeout=10).read().decode()
        match = re.search(rf"^{re.escape(name + ('{' + labels + '}' if labels else ''))} (\S+)$", text, re.M)
        return float(match.group(1)) if match else 0.0

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


@pytest.fixture(scope="module")
def served():
    server = Served("--model", "tiny", "--tokenizer", "ascii", "--menu", "tiny", "--proposer", "none", "--policy",
                    "none", "--max-queue", str(MAX_QUEUE), "--auth-token", TOKEN, "--logprobs", str(LOGPROBS),
                    announce="tiny")
    yield server
    assert server.stop() == 0, "".join(server.lines)


@pytest.fixture(scope="module")
def client(served):
    return served.client()


def post(served: Served, path: str, data: bytes, token: str = TOKEN) -> tuple[int, dict]:
    request = urllib.request.Request(served.base + path, data=data, method="POST",
                                     headers={"content-type": "application/json", "authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_models_and_health(served, client):
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny"]
    assert models[0].object == "model"
    assert urllib.request.urlopen(served.base + "/health", timeout=10).status == 200  # no token needed


def test_chat_at_temperature_0_equals_grpc_and_reports_usage(served, client):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello"}, {"role": "user", "content": "more"}]
    reply = client.chat.completions.create(model="tiny", messages=messages, **GREEDY)
    choice = reply.choices[0]
    assert (reply.object, choice.finish_reason, choice.message.role) == ("chat.completion", "length", "assistant")
    assert reply.usage.completion_tokens == 12
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 12
    assert choice.model_extra["jaxspec"]["steps"] == 11  # the first token comes from the prefill
    with GenerationClient(served.grpc, auth_token=TOKEN) as grpc_client:
        events = list(grpc_client.generate(messages=[(m["role"], m["content"]) for m in messages], max_tokens=12,
                                           temperature=0, ignore_eos=True))
    assert choice.message.content == "".join(e.text for e in events)
    assert reply.usage.prompt_tokens == events[-1].stats.prompt_tokens
    # the gRPC call came after the HTTP one with the same prompt: its full pages were served from the prefix cache
    page = 16
    assert reply.usage.prompt_tokens_details.cached_tokens % page == 0
    assert events[-1].stats.cached_prompt_tokens == (reply.usage.prompt_tokens - 1) // page * page > 0


def test_completion_streams_the_same_text_with_usage(client):
    whole = client.completions.create(model="tiny", prompt="hello there", **GREEDY)
    chunks = list(client.completions.create(model="tiny", prompt="hello there", stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    assert whole.object == "text_completion" and whole.choices[0].finish_reason == "length"
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert len([t for t in texts if t]) > 1  # streamed step by step, not in one piece
    assert "".join(texts) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_stream_deltas_join_to_the_whole_reply(client):
    messages = [{"role": "user", "content": "tell me"}]
    whole = client.chat.completions.create(model="tiny", messages=messages, **GREEDY)
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, stream=True, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].usage is None


def test_stop_string_ends_the_text_before_it(client):
    text = client.completions.create(model="tiny", prompt="abc", **GREEDY).choices[0].text
    stop = text[5:7]
    cut = client.completions.create(model="tiny", prompt="abc", stop=[stop, "never"], **GREEDY).choices[0]
    assert cut.finish_reason == "stop"
    assert cut.text == text[:text.index(stop)]


def test_n_samples_and_a_seed_that_repeats(client):
    def sample(seed):
        reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], n=2,
                                               temperature=1.0, seed=seed, max_tokens=16,
                                               extra_body={"ignore_eos": True})
        assert [c.index for c in reply.choices] == [0, 1] and reply.usage.completion_tokens == 32
        return [c.message.content for c in reply.choices]

    first = sample(7)
    assert sample(7) == first
    assert first[0] != first[1]  # independent samples (16 random tokens over 61 characters)
    assert sample(8) != first


@pytest.mark.parametrize(("body", "param"), [
    (dict(prompt="hi", temperature=-1), "temperature"),
    (dict(prompt="hi", max_tokens=0), "max_tokens"),
    (dict(prompt="hi", max_tokens=100_000), "max_tokens"),
    (dict(prompt="hi", top_p=2), "top_p"),
    (dict(prompt="hi", n=0), "n"),
    (dict(prompt="hi", stop=[""]), "stop"),
    (dict(prompt="hi", seed="x"), "seed"),
    (dict(prompt=""), "prompt"),
    (dict(prompt=["a", "b"]), "prompt"),
    (dict(prompt="hi" * 100), "prompt"),  # longer than the cache
    (dict(prompt="hi", logprobs=LOGPROBS + 1), "logprobs"),  # more than the engine's --logprobs
    (dict(prompt="hi", logprobs=21), "logprobs"),
    (dict(prompt="hi", frequency_penalty=0.5), "frequency_penalty"),
    (dict(prompt="hi", stream_options={"include_usage": True}), "stream_options"),
])
def test_bad_completion_input_is_400_naming_the_field(client, body, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", **body)
    assert info.value.status_code == 400 and info.value.param == param, info.value.body


@pytest.mark.parametrize(("body", "param"), [
    (dict(messages=[]), "messages"),
    (dict(messages=[{"role": "robot", "content": "x"}]), "messages[0].role"),
    (dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
     "messages[0].content[0]"),
    (dict(messages=[{"role": "user", "content": "x"}], logprobs=True, top_logprobs=LOGPROBS + 1), "logprobs"),
    (dict(messages=[{"role": "user", "content": "x"}], top_logprobs=2), "top_logprobs"),  # without logprobs
])
def test_bad_chat_input_is_400_naming_the_field(client, body, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", **body)
    assert info.value.param == param, info.value.body


def test_logprobs_of_chat_and_completions_streamed_and_not(client):
    """The target's log-probabilities, one entry per token: at temperature 0 each token is its own most likely
    alternative; a stream carries the same entries, chunk by chunk."""
    messages = [{"role": "user", "content": "odds"}]
    chat = client.chat.completions.create(model="tiny", messages=messages, logprobs=True, top_logprobs=2, **GREEDY)
    content = chat.choices[0].logprobs.content
    assert len(content) == 12
    assert "".join(e.token for e in content if e.token != "<eos>") == chat.choices[0].message.content
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].token == entry.token and entry.top_logprobs[0].logprob == entry.logprob
        assert entry.top_logprobs[1].logprob <= entry.logprob
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, logprobs=True, top_logprobs=2,
                                                 stream=True, **GREEDY))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    assert client.chat.completions.create(model="tiny", messages=messages, **GREEDY).choices[0].logprobs is None

    whole = client.completions.create(model="tiny", prompt="odds", logprobs=LOGPROBS, **GREEDY).choices[0]
    lp = whole.logprobs
    # ignore_eos: end-of-sequence ids generated mid-text keep their entries (their token string adds no text)
    assert "".join(t for t in lp.tokens if t != "<eos>") == whole.text and len(lp.token_logprobs) == 12
    assert all(len(top) == LOGPROBS and top[t] == v for t, v, top in zip(lp.tokens, lp.token_logprobs,
                                                                           lp.top_logprobs))
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(12)]
    parts = list(client.completions.create(model="tiny", prompt="odds", logprobs=LOGPROBS, stream=True, **GREEDY))
    assert [v for p in parts if p.choices and p.choices[0].logprobs for v in p.choices[0].logprobs.token_logprobs] \
        == lp.token_logprobs


def test_malformed_bodies_are_400_and_unknown_fields_are_ignored(served, client):
    assert post(served, "/v1/completions", b"{not json")[0] == 400
    assert post(served, "/v1/completions", b"[1, 2]")[0] == 400
    assert post(served, "/v1/completions", b"\xff\xfe")[0] == 400
    reply = client.completions.create(model="tiny", prompt="hi", user="u1", temperature=0, max_tokens=12,
                                      extra_body={"ignore_eos": True, "some_extension": 1})
    assert reply.choices[0].finish_reason == "length"


def test_auth_unknown_model_size_limit_and_unknown_path(served):
    with pytest.raises(urllib.error.HTTPError) as info:  # the openai client always sends a token
        urllib.request.urlopen(served.base + "/v1/models", timeout=10)
    assert info.value.code == 401 and json.loads(info.value.read())["error"]["message"] == "missing bearer token"
    with pytest.raises(openai.AuthenticationError) as info:
        served.client(token="wrong").completions.create(model="tiny", prompt="hi")
    assert info.value.status_code == 401 and info.value.body["code"] == "invalid_api_key"
    with pytest.raises(openai.NotFoundError) as info:
        served.client().completions.create(model="gpt-17", prompt="hi")
    assert info.value.body["code"] == "model_not_found"
    # a body announced over max_message_bytes (1 MiB) is refused before it is read
    connection = http.client.HTTPConnection(served.base.removeprefix("http://"), timeout=10)
    connection.putrequest("POST", "/v1/completions")
    for name, value in (("authorization", f"Bearer {TOKEN}"), ("content-length", str(2 << 20))):
        connection.putheader(name, value)
    connection.endheaders()
    response = connection.getresponse()
    assert response.status == 413 and json.loads(response.read())["error"]["code"] == "request_too_large"
    connection.close()
    assert post(served, "/v1/nothing", b"{}")[0] == 404


def test_a_full_queue_is_429_and_holds_no_slot(served, client):
    with pytest.raises(openai.RateLimitError):  # 16 choices: 8 slots + MAX_QUEUE waiting cannot take them
        client.completions.create(model="tiny", prompt="hi", n=16, max_tokens=50)
    wait_until(lambda: served.metric("jaxspec_running_slots") == 0 and served.metric("jaxspec_queue_depth") == 0,
               what="the accepted choices to be cancelled")


def test_a_disconnect_cancels_the_request_and_frees_its_slot(served, client):
    before = served.metric("jaxspec_http_requests_total", 'endpoint="completions",status="499"')
    stream = client.completions.create(model="tiny", prompt="long", stream=True, max_tokens=100,
                                       extra_body={"ignore_eos": True})  # 100 steps: 2 s at least
    next(iter(stream))
    wait_until(lambda: served.metric("jaxspec_running_slots") == 1, what="the request to run")
    stream.close()
    wait_until(lambda: served.metric("jaxspec_running_slots") == 0, timeout=5, what="the slot to be freed")
    wait_until(lambda: served.metric("jaxspec_http_requests_total",
                                     'endpoint="completions",status="499"') == before + 1, what="the 499 count")
    assert served.metric("jaxspec_http_requests_total", 'endpoint="chat_completions",status="200"') >= 1


def test_load_test_drives_http_and_grpc_side_by_side(served, tmp_path):
    config = load_test.LoadConfig(target=served.grpc, http_target=served.base, protocols=("grpc", "http"),
                                  closed_loop=2, max_requests=6, max_tokens=5, ignore_eos=True, auth_token=TOKEN)
    report = load_test.run_load_test(config)
    by = {s["protocol"]: s for s in report["summaries"]}
    assert {p: (s["requests"], s["ok"], s["output_tokens"]) for p, s in by.items()} == {"grpc": (3, 3, 15),
                                                                                        "http": (3, 3, 15)}
    assert report["overhead"]["latency_mean_http_over_grpc"] > 0
    assert {"command", "date", "loadavg_before", "loadavg_after"} <= set(report)
    json_path, md_path = load_test.write_report(report, tmp_path)
    assert "HTTP / gRPC mean latency" in md_path.read_text()


def test_sigterm_drains_an_http_stream_and_refuses_new_calls(tmp_path):
    served = Served("--model", "tiny", "--tokenizer", "ascii", "--menu", "tiny", "--proposer", "none", "--policy",
                    "none", announce="tiny", delay=0.05)
    try:
        client = served.client(token="unused")
        stream = iter(client.completions.create(model="tiny", prompt="drain", stream=True, max_tokens=40,
                                                extra_body={"ignore_eos": True}))
        first = next(stream)
        served.proc.send_signal(signal.SIGTERM)
        wait_until(lambda: _status(served.base + "/health") == 503, timeout=5, what="/health 503")
        with pytest.raises(openai.InternalServerError) as info:
            client.completions.create(model="tiny", prompt="too late", max_tokens=2)
        assert info.value.status_code == 503
        rest = list(stream)
        assert rest[-1].choices[0].finish_reason == "length"
        assert len("".join(c.choices[0].text for c in [first, *rest])) > 0
        assert served.proc.wait(timeout=60) == 0, "".join(served.lines)
    finally:
        served.stop()


def _status(url: str) -> int:
    try:
        return urllib.request.urlopen(url, timeout=5).status
    except urllib.error.HTTPError as exc:
        return exc.code


@pytest.mark.slow
def test_default_model_answers_paris_and_equals_grpc_and_offline_generate():
    """SmolLM2 (the default model) on the small tiny menu: the chat answer names Paris, and its temperature-0 text
    is the gRPC endpoint's and `jaxspec generate --chat`'s."""
    question = "What is the capital of France?"
    served = Served("--menu", "tiny", "--proposer", "none", "--policy", "none", announce=r"\S+", delay=0.0,
                    timeout=900)
    try:
        reply = served.client(token="unused").chat.completions.create(
            model=served.client(token="unused").models.list().data[0].id,
            messages=[{"role": "user", "content": question}], temperature=0, max_tokens=24)
        text = reply.choices[0].message.content
        assert "Paris" in text
        with GenerationClient(served.grpc) as grpc_client:
            assert "".join(e.text for e in grpc_client.generate(messages=[("user", question)], max_tokens=24,
                                                                temperature=0)) == text
    finally:
        assert served.stop() == 0
    offline = subprocess.run([sys.executable, "-m", "jaxspec.cli", "generate", question, "--chat", "--menu", "tiny",
                              "--max-tokens", "24", "--temperature", "0", "--json"], cwd=ROOT, capture_output=True,
                             text=True, timeout=900, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert offline.returncode == 0, offline.stderr
    assert json.loads(offline.stdout.strip().splitlines()[-1])["text"] == text
