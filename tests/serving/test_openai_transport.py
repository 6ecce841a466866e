"""The HTTP API's transport, in-process over the fake engine: gRPC off (port 0) with HTTP alone, TLS over HTTP, a
chunked body over the size limit (413) and a body that arrives too slowly (408)."""

from __future__ import annotations

import argparse
import http.client
import json
import socket
import ssl
import time

import openai
import pytest

from jaxspec.serving.openai_api import start_http
from jaxspec.serving.serve_cmd import add_serve_arguments, run_serve
from jaxspec.serving.serve_config import ServeConfig
from jaxspec.serving.service import GenerationServer
from tests.fake_tokenizer import ascii_tokenizer
from tests.serving.conftest import HOST, fake_engine, free_port, self_signed_cert

LIMIT = 4096  # max_message_bytes
TIMEOUT_S = 1.0  # request_timeout_s


def serve_http_only(**config):
    """A GenerationServer with gRPC off (port 0) and the HTTP API on a free port, warm."""
    cfg = ServeConfig(host=HOST, port=0, http_port=free_port(), max_message_bytes=LIMIT,
                      request_timeout_s=TIMEOUT_S, **config)
    server = GenerationServer(fake_engine(slots=2), ascii_tokenizer(), None, cfg, model_name="fake")
    api = start_http(server, cfg.http_port)
    server.start()
    api.mark_ready()
    return server, api


@pytest.fixture(scope="module")
def plain():
    server, api = serve_http_only()
    yield api
    api.shutdown(timeout=5)
    server.shutdown(timeout=5)


def test_port_0_turns_grpc_off_and_http_serves_alone(plain):
    assert plain.server.port is None and plain.server.address == "off"
    reply = openai.OpenAI(base_url=f"http://{plain.address}/v1", api_key="x", max_retries=0).completions.create(
        model="fake", prompt="ab", max_tokens=3, temperature=0, extra_body={"ignore_eos": True})
    assert reply.usage.completion_tokens == 3


def test_both_servers_off_is_refused(capsys):
    with pytest.raises(ValueError, match="both servers are off"):
        ServeConfig(port=0)
    with pytest.raises(ValueError, match="both servers are off"):
        ServeConfig(port=0, http_port=0)
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    assert run_serve(parser.parse_args(["--model", "tiny", "--tokenizer", "ascii", "--port", "0"])) == 2
    assert "both servers are off" in capsys.readouterr().err


def test_a_chunked_body_over_the_limit_is_413(plain):
    """No content-length to refuse it by: the body is counted as it streams in."""
    connection = http.client.HTTPConnection(plain.address, timeout=10)
    connection.putrequest("POST", "/v1/completions")
    connection.putheader("transfer-encoding", "chunked")
    connection.putheader("content-type", "application/json")
    connection.endheaders()
    piece = b"x" * 1024
    try:
        for _ in range(LIMIT // len(piece) + 2):
            connection.send(b"%x\r\n%s\r\n" % (len(piece), piece))
        connection.send(b"0\r\n\r\n")
    except (BrokenPipeError, ConnectionResetError):
        pass  # the server may answer and close before the whole body is sent
    response = connection.getresponse()
    assert response.status == 413 and json.loads(response.read())["error"]["code"] == "request_too_large"
    connection.close()


def test_a_body_that_arrives_too_slowly_is_408(plain):
    host, port = plain.address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: 100\r\n\r\n{\"prompt\": ")  # then nothing
        started = time.monotonic()
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            data = sock.recv(4096)
            if not data:
                break
            answer += data
    assert answer.startswith(b"HTTP/1.1 408"), answer
    assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"
    assert time.monotonic() - started >= TIMEOUT_S * 0.9


def test_tls_over_http(tmp_path):
    cert, key = self_signed_cert(tmp_path)
    server, api = serve_http_only(tls_cert=str(cert), tls_key=str(key))
    try:
        body = json.dumps({"model": "fake", "prompt": "ab", "max_tokens": 3, "temperature": 0, "ignore_eos": True})
        connection = http.client.HTTPSConnection(api.address, timeout=10,
                                                 context=ssl.create_default_context(cafile=str(cert)))
        connection.request("POST", "/v1/completions", body, {"content-type": "application/json"})
        response = connection.getresponse()
        assert response.status == 200 and json.loads(response.read())["usage"]["completion_tokens"] == 3
        connection.close()
        plain_text = http.client.HTTPConnection(api.address, timeout=10)
        with pytest.raises((http.client.HTTPException, ConnectionError)):  # plain text on the TLS port: no answer
            plain_text.request("GET", "/health")
            plain_text.getresponse()
        plain_text.close()
    finally:
        api.shutdown(timeout=5)
        server.shutdown(timeout=5)
