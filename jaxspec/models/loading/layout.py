"""The Hugging Face parameter layout every loader produces, and ModelConfig <-> JSON.

Names and shapes follow transformers' LlamaForCausalLM / Qwen2ForCausalLM: linear weights are
[out_features, in_features], everything is float32.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from jaxspec.models.config import ModelConfig
from jaxspec.models.loading.errors import ModelLoadError

StateDict = dict[str, np.ndarray]


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter name `config` implies, with its shape."""
    d, f, v = config.hidden_size, config.intermediate_size, config.vocab_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,)}
    if not config.tie_embeddings:
        shapes["lm_head.weight"] = (v, d)
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "self_attn.q_proj.weight"] = (q, d)
        shapes[p + "self_attn.k_proj.weight"] = (kv, d)
        shapes[p + "self_attn.v_proj.weight"] = (kv, d)
        shapes[p + "self_attn.o_proj.weight"] = (d, q)
        if config.qkv_bias:
            shapes[p + "self_attn.q_proj.bias"] = (q,)
            shapes[p + "self_attn.k_proj.bias"] = (kv,)
            shapes[p + "self_attn.v_proj.bias"] = (kv,)
        shapes[p + "mlp.gate_proj.weight"] = (f, d)
        shapes[p + "mlp.up_proj.weight"] = (f, d)
        shapes[p + "mlp.down_proj.weight"] = (d, f)
        shapes[p + "input_layernorm.weight"] = (d,)
        shapes[p + "post_attention_layernorm.weight"] = (d,)
    return shapes


def check_shapes(config: ModelConfig, shapes: Mapping[str, tuple[int, ...]], source: str) -> None:
    """Raise ModelLoadError unless `shapes` (tensor name -> shape) are exactly the tensors `config` implies."""
    want = expected_shapes(config)
    for problem, names in (("missing", set(want) - set(shapes)), ("unexpected", set(shapes) - set(want))):
        if names:
            first, more = sorted(names)[0], len(names) - 1
            raise ModelLoadError(f"{source}: {problem} tensor {first}" + (f" (and {more} more)" if more else ""))
    for name, shape in want.items():
        if tuple(shapes[name]) != shape:
            raise ModelLoadError(f"{source}: tensor {name} has shape {tuple(shapes[name])}, expected {shape}")


def check_state_dict(config: ModelConfig, state_dict: Mapping[str, np.ndarray], source: str) -> None:
    """Raise ModelLoadError unless `state_dict` has exactly the float32 tensors `config` implies."""
    check_shapes(config, {name: tuple(array.shape) for name, array in state_dict.items()}, source)
    for name, array in state_dict.items():
        if array.dtype != np.float32:
            raise ModelLoadError(f"{source}: tensor {name} has dtype {array.dtype}, expected float32")


def config_to_json(config: ModelConfig) -> dict[str, Any]:
    """A JSON-ready dict of every ModelConfig field."""
    out = dataclasses.asdict(config)
    out["eos_token_ids"] = list(config.eos_token_ids)
    return out


def config_from_json(data: Mapping[str, Any], source: str) -> ModelConfig:
    """Inverse of `config_to_json`; unknown or missing fields raise ModelLoadError."""
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ModelLoadError(f"{source}: unknown ModelConfig field {unknown[0]!r}")
    values = dict(data)
    if "eos_token_ids" in values:
        values["eos_token_ids"] = tuple(int(i) for i in values["eos_token_ids"])
    try:
        return ModelConfig(**values)
    except (TypeError, ValueError) as e:
        raise ModelLoadError(f"{source}: invalid model config: {e}") from None


def read_json_object(path: Path) -> dict[str, Any]:
    """A JSON object from `path`; anything else raises ModelLoadError."""
    if not path.is_file():
        raise ModelLoadError(f"{path}: no such file")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: not readable JSON ({e})") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: expected a JSON object")
    return data
