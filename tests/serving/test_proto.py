"""The proto's generated modules are current; serving config, request parsing and toy tokenizers (no server)."""

from __future__ import annotations

import dataclasses

import pytest

from jaxspec.engine.args import TOKENIZERS, EngineArgs
from jaxspec.serving.proto import generate as proto_gen
from jaxspec.serving.proto.jaxspec.v1 import generation_pb2 as pb
from jaxspec.serving.runtime import resolve_tokenizer
from jaxspec.serving.serve_config import DEFAULT_CONFIG, ServeConfig, load_serve_config
from jaxspec.serving.toy_tokenizer import TOY_TOKENIZERS, ascii_tokenizer, byte_tokenizer
from jaxspec.serving.wire import RpcError, parse_generate_request


def test_generated_modules_match_the_proto(tmp_path):
    written = proto_gen.generate(tmp_path)
    assert written, "protoc wrote nothing"
    for path in written:
        relative = path.relative_to(tmp_path)
        committed = proto_gen.PROTO_ROOT / relative
        assert committed.exists(), f"{relative} is not committed: run python jaxspec/serving/proto/generate.py"
        assert committed.read_text() == path.read_text(), \
            f"{relative} is out of date with the .proto: run python jaxspec/serving/proto/generate.py"


def test_proto_shape():
    assert pb.DESCRIPTOR.package == "jaxspec.v1"
    service = pb.DESCRIPTOR.services_by_name["Generation"]
    generate = service.methods_by_name["Generate"]
    assert generate.server_streaming and not generate.client_streaming
    assert "ListModels" in service.methods_by_name
    fields = pb.GenerateRequest.DESCRIPTOR.fields_by_name
    assert {"prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop"} <= set(fields)
    assert {"text", "token_ids", "finish_reason", "stats"} <= set(pb.GenerateResponse.DESCRIPTOR.fields_by_name)
    source = (proto_gen.PROTO_ROOT / proto_gen.PROTOS[0]).read_text()
    assert "reserved 10;" in source and source.count("// Next ID:") == 7  # one per message


def test_serving_yaml_holds_the_defaults():
    assert load_serve_config(DEFAULT_CONFIG) == ServeConfig()


def test_config_overrides_and_errors(tmp_path):
    path = tmp_path / "serve.yaml"
    path.write_text("port: 6000\nmax_queue: 3\n")
    config = load_serve_config(path, max_queue=5, host=None)
    assert (config.port, config.max_queue, config.host) == (6000, 5, "127.0.0.1")
    path.write_text("prot: 6000\n")
    with pytest.raises(ValueError, match=r"unknown keys \['prot'\]"):
        load_serve_config(path)
    with pytest.raises(FileNotFoundError):
        load_serve_config(tmp_path / "missing.yaml")
    with pytest.raises(ValueError, match="both tls_cert and tls_key"):
        ServeConfig(tls_cert="c.pem")
    with pytest.raises(ValueError, match="default_max_tokens"):
        ServeConfig(max_tokens_limit=8)
    with pytest.raises(ValueError, match="port"):
        dataclasses.replace(ServeConfig(), port=70000)
    with pytest.raises(ValueError, match="request_timeout_s must be > 0"):
        ServeConfig(request_timeout_s=0)
    with pytest.raises(ValueError, match="max_pending_calls must be >= 1"):
        ServeConfig(max_pending_calls=0)


def test_parse_names_the_field_with_bad_utf8():
    good = pb.GenerateRequest(prompt="hé", messages=[pb.ChatMessage(role="user", content="x")])
    assert parse_generate_request(good.SerializeToString()) == good
    with pytest.raises(RpcError, match=r"field 'stop\[1\]' is not valid UTF-8"):
        parse_generate_request(b"\x4a\x01a" + b"\x4a\x02\xe2\x82")  # stop: ["a", <half a character>]


def test_toy_tokenizers():
    ascii_, bytes_ = ascii_tokenizer(), byte_tokenizer()
    assert (ascii_.vocab_size, bytes_.vocab_size) == (64, 259)
    assert ascii_.decode(ascii_.encode("Hello, world!")) == "Hello, world!"
    assert bytes_.decode(bytes_.encode("héllo €")) == "héllo €"
    assert resolve_tokenizer("ascii", None, "tiny").vocab_size == 64
    with pytest.raises(ValueError, match="unknown tokenizer"):
        resolve_tokenizer("sentencepiece", None, "tiny")
    assert TOKENIZERS == ("model", *TOY_TOKENIZERS)  # the --tokenizer choices are the toys and the model's own


def test_serve_config_names_the_engine_args():
    config = ServeConfig(model="tiny", proposer="ngram", policy="fixed:2", menu="tiny", tokenizer="ascii")
    assert config.engine_args() == EngineArgs(model="tiny", proposer="ngram", policy="fixed:2", menu="tiny",
                                              tokenizer="ascii")
    with pytest.raises(ValueError, match="needs a proposer"):
        ServeConfig(policy="heuristic").engine_args()
