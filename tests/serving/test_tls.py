"""TLS with a self-signed certificate made for the test, together with bearer-token auth (on the fake engine)."""

from __future__ import annotations

import argparse
import io

import grpc
import pytest

from jaxspec.serving import client as client_cli
from jaxspec.serving.client import GenerationClient
from jaxspec.serving.serve_cmd import add_serve_arguments, run_serve, serve_config_from_args
from jaxspec.serving.service import GenerationServer
from tests.fake_tokenizer import ascii_tokenizer
from tests.serving.conftest import HOST, fake_engine, free_port, self_signed_cert, start_server

TOKEN = "tls-token"


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory):
    cert, key = self_signed_cert(tmp_path_factory.mktemp("tls"))
    server = start_server(fake_engine(slots=1), ascii_tokenizer(), None, tls_cert=str(cert),
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


def test_key_not_matching_its_certificate_is_a_clear_error(tmp_path, capsys):
    """Checked before binding: the message names the mismatch (gRPC alone says only 'cannot bind'), exit 2."""
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    cert, _ = self_signed_cert(tmp_path / "a")
    _, other_key = self_signed_cert(tmp_path / "b")  # another pair's key
    engine = fake_engine(slots=1)
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    args = parser.parse_args(["--host", HOST, "--port", str(free_port()), "--tls-cert", str(cert),
                              "--tls-key", str(other_key)])
    with pytest.raises(ValueError, match=f"TLS key {other_key} does not match the certificate {cert}"):
        GenerationServer(engine, ascii_tokenizer(), None, serve_config_from_args(args), model_name="tiny").start()
    assert run_serve(args, build=lambda config: GenerationServer(engine, ascii_tokenizer(), None, config,
                                                                 model_name="tiny")) == 2
    assert f"TLS key {other_key} does not match the certificate {cert}" in capsys.readouterr().err
