"""Streaming loads (jaxspec.models.loading.streaming): the same serving weights and tokens as the whole-state-dict
path, and never more than one float32 tensor (or, for float32 weights, one layer) alive at a time."""

from __future__ import annotations

import weakref

import jax
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from jaxspec.engine.build import build_draft, build_model
from jaxspec.engine.engine import Engine
from jaxspec.engine.kernels import kernel_plan_for
from jaxspec.menu import Menu
from jaxspec.mesh import MeshSpec, make_mesh
from jaxspec.models.config import TINY, TINY_QWEN
from jaxspec.models.llama import from_hf_state_dict, is_serving_only, random_model, serving_split, to_hf_state_dict
from jaxspec.models.loading import (
    TextTokenizer,
    load_model,
    read_gguf,
    save_converted,
    streaming,
    write_safetensors_dir,
)
from jaxspec.models.loading import gguf as gguf_module
from jaxspec.models.loading.layout import expected_shapes
from jaxspec.models.sharding import Placement, TensorParallelLayout, serving_placement
from jaxspec.types import SamplingParams
from tests.models.test_loading import QUANT_CONFIG, random_state, write_gguf


def _tokenizer(vocab_size: int) -> TextTokenizer:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.ByteLevel()
    return TextTokenizer(tok, bos_token_id=None, eos_token_ids=(1,))


def _placement(dtype: str = "float32") -> Placement:
    """One device as the engine places it: on XLA:CPU float32 layers are stored as column panels (kernel plan)."""
    plan = kernel_plan_for(TINY.replace(dtype=dtype), MeshSpec(), tensor_parallel=False)
    return serving_placement(make_mesh(MeshSpec()), TensorParallelLayout(), plan)


def _assert_same_serving_weights(streamed, reference, placement):
    params, layers = serving_split(streamed, placement)[1]
    ref_params, ref_layers = serving_split(reference, placement)[1]
    assert len(layers) == len(ref_layers)
    for layer, ref in zip(layers, ref_layers):
        assert layer.keys() == ref.keys()
        for name in ref:
            assert type(layer[name]) is type(ref[name]) and layer[name].dtype == ref[name].dtype, name
            for mine, theirs in zip(jax.tree.leaves(layer[name]), jax.tree.leaves(ref[name]), strict=True):
                np.testing.assert_array_equal(np.asarray(mine), np.asarray(theirs), err_msg=name)
    for name in ("embed", "final_norm") + (() if reference.config.tie_embeddings else ("lm_head",)):
        np.testing.assert_array_equal(np.asarray(params[name].value), np.asarray(ref_params[name].value))
        np.testing.assert_array_equal(np.asarray(getattr(streamed, name).value), np.asarray(ref_params[name].value))


@pytest.mark.parametrize("config", [TINY, TINY_QWEN], ids=["llama", "qwen"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_safetensors_dir_streams_to_the_same_serving_weights(tmp_path, config, dtype):
    config = config.replace(num_layers=3)
    sd = to_hf_state_dict(random_model(config, seed=3))
    write_safetensors_dir(tmp_path / "hf", config, sd, max_shard_bytes=20_000, tokenizer=_tokenizer(config.vocab_size))
    save_converted(tmp_path / "conv", config, sd, tokenizer=_tokenizer(config.vocab_size))
    placement = _placement(dtype)
    assert placement.panels == (dtype == "float32")
    for sub in ("hf", "conv"):
        streamed = streaming.stream_model(str(tmp_path / sub), dtype, placement)
        assert is_serving_only(streamed.model) and streamed.tokenizer.encode("w5 w7") == [5, 7]
        loaded = load_model(str(tmp_path / sub))
        reference = from_hf_state_dict(loaded.config.replace(dtype=dtype), loaded.state_dict)
        assert streamed.model.config == reference.config
        _assert_same_serving_weights(streamed.model, reference, placement)
        tokens = np.arange(12, dtype=np.int32)[None, :] % config.vocab_size  # [1, 12]
        mine, ref = np.asarray(streamed.model(tokens)), np.asarray(reference(tokens))  # [1, 12, V] each
        # same weights; the fused unrolled path vs the stacked scan. Measured max|mine - ref| / max|ref| (XLA:CPU,
        # 2026-12-06): bfloat16 9.0e-3 (llama) and 6.9e-3 (qwen) here, at most 1.4e-2 over seeds 0-5, about 2.5
        # bf16 roundings (2^-8) of the largest logit: 0.02 leaves a 2.2x margin on this test's figure. float32:
        # at most 6e-7 over those seeds.
        tol = 0.02 if dtype == "bfloat16" else 1e-5
        np.testing.assert_allclose(mine, ref, rtol=0, atol=tol * np.abs(ref).max())


@pytest.mark.parametrize("arch,qtype", [("llama", Q.Q4_K), ("qwen2", Q.Q8_0)])
def test_quantised_gguf_streams_in_row_blocks_to_the_same_serving_weights(tmp_path, monkeypatch, arch, qtype):
    config = QUANT_CONFIG.replace(name="q", qkv_bias=arch == "qwen2")
    write_gguf(tmp_path / "q.gguf", config, random_state(config, seed=2), arch=arch, qtype=qtype)
    loaded_config, state = read_gguf(tmp_path / "q.gguf")  # dequantised in the default blocks
    reference = from_hf_state_dict(loaded_config, state)
    monkeypatch.setattr(gguf_module, "_BLOCK_VALUES", 1)  # one row per block
    _, blocked = read_gguf(tmp_path / "q.gguf")
    for name, value in state.items():
        np.testing.assert_array_equal(blocked[name], value, err_msg=name)
    # the test file has no BPE merges: give it a word-level tokenizer
    monkeypatch.setattr(TextTokenizer, "from_gguf", classmethod(lambda cls, reader: _tokenizer(config.vocab_size)))
    streamed = streaming.stream_model(str(tmp_path / "q.gguf"), "float32", _placement())
    _assert_same_serving_weights(streamed.model, reference, _placement())


def test_truncated_draft_of_a_streamed_target(tmp_path):
    config = TINY.replace(num_layers=3)
    sd = to_hf_state_dict(random_model(config, seed=4))
    write_safetensors_dir(tmp_path, config, sd, tokenizer=_tokenizer(config.vocab_size))
    target = build_model(str(tmp_path)).model
    draft = build_draft("truncated:2", target)
    reference = from_hf_state_dict(config.replace(num_layers=2, name=draft.config.name), sd)
    assert draft.config.num_layers == 2 and is_serving_only(draft)
    _assert_same_serving_weights(draft, reference, _placement())


def _track_float32(monkeypatch, source_cls):
    """Record the most float32 bytes returned by `source_cls.read` alive at once (freed when unreferenced)."""
    alive, peak = [0], [0]
    original = source_cls.read

    def freed(nbytes):
        alive[0] -= nbytes

    def read(self, name):
        value = original(self, name)
        assert value.dtype == np.float32
        alive[0] += value.nbytes
        peak[0] = max(peak[0], alive[0])
        weakref.finalize(value, freed, value.nbytes)
        return value

    monkeypatch.setattr(source_cls, "read", read)
    return peak


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_never_more_than_one_float32_tensor_or_layer(tmp_path, monkeypatch, dtype):
    config = TINY.replace(num_layers=8, vocab_size=256)
    sd = to_hf_state_dict(random_model(config, seed=5))
    write_safetensors_dir(tmp_path, config, sd, tokenizer=_tokenizer(config.vocab_size))
    peak = _track_float32(monkeypatch, streaming.SafetensorsSource)
    streaming.stream_model(str(tmp_path), dtype, _placement(dtype))
    shapes = expected_shapes(config)
    tensor = max(4 * int(np.prod(s)) for s in shapes.values())
    layer = sum(4 * int(np.prod(s)) for n, s in shapes.items() if n.startswith("model.layers.0."))
    whole = sum(4 * int(np.prod(s)) for s in shapes.values())
    bound = tensor if dtype == "bfloat16" else max(tensor, layer)  # float32: a layer is float32 until placed
    assert 0 < peak[0] <= bound < whole / 4


@pytest.mark.slow
def test_default_gguf_streams_like_the_whole_state_dict():
    streamed = build_model(None)  # float32, one device
    loaded = load_model(None)
    reference = from_hf_state_dict(loaded.config, loaded.state_dict)
    del loaded
    assert is_serving_only(streamed.model) and streamed.model.config == reference.config
    _assert_same_serving_weights(streamed.model, reference, _placement())
    tok = streamed.tokenizer
    ids = tok.encode("The capital of France is Paris. The capital of Italy is")
    menu = Menu(num_slots=1, max_len=64, batch_buckets=(1,), k_menu=(0,), window_buckets=(64,),
                prefill_buckets=(32,))
    outputs, logits = [], []
    for model in (streamed.model, reference):
        engine = Engine(model, None, menu)
        engine.warmup(progress=False)
        out = [engine.prefill(0, ids, SamplingParams())]
        while len(out) < 8:
            out += engine.step([0], 0).row_tokens(0)
        outputs.append(out[:8])
        logits.append(np.asarray(model(np.asarray([ids], np.int32))))  # [1, T, V]
    assert outputs[0] == outputs[1]
    np.testing.assert_allclose(logits[0], logits[1], rtol=1e-4, atol=1e-4 * np.abs(logits[1]).max())
