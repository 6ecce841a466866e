"""TLS with a self-signed certificate made for the test, together with bearer-token auth."""

from __future__ import annotations

import argparse
import io

import grpc
import pytest

from serving import client as client_cli
from serving.client import GenerationClient
from tests.fake_tokenizer import ascii_tokenizer
from tests.serving.conftest import HOST, self_signed_cert, start_server, tiny_engine

TOKEN = "tls-token"


@pytest.fixture(scope="module")
def tls_server(tiny_model, tmp_path_factory):
    cert, key = self_signed_cert(tmp_path_factory.mktemp("tls"))
    server = start_server(tiny_engine(tiny_model, slots=1), ascii_tokenizer(), None, tls_cert=str(cert),
                          tls_key=str(key), auth_token=TOKEN)
    yield server, cert
    assert server.shutdown(timeout=10)


def test_tls_and_token(tls_server):
    server, cert = tls_server
    target = f"{HOST}:{server.port}"
    with GenerationClient(target, tls_ca=cert, auth_token=TOKEN) as client:
        assert client.health() == "SERVING"
        messages = list(client.generate("secure hello", max_tokens=5, ignore_eos=True))
        assert sum(len(m.token_ids) for m in messages) == 5
    with GenerationClient(target, tls_ca=cert) as no_token:  # TLS alone is not enough
        with pytest.raises(grpc.RpcError) as info:
            list(no_token.generate("hi", max_tokens=2))
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with GenerationClient(target, auth_token=TOKEN) as plaintext:  # no TLS: the handshake fails
        with pytest.raises(grpc.RpcError) as info:
            list(plaintext.generate("hi", max_tokens=2, timeout=5))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_client_cli_over_tls(tls_server):
    server, cert = tls_server
    parser = argparse.ArgumentParser()
    client_cli.add_client_arguments(parser)
    args = parser.parse_args(["secure hello", "--host", HOST, "--port", str(server.port), "--max-tokens", "4",
                              "--tls-ca", str(cert), "--auth-token", TOKEN])
    out = io.StringIO()
    assert client_cli.run_client(args, out, io.StringIO()) == 0
    assert out.getvalue().endswith("\n")
