"""Hugging Face model directories: config.json plus model.safetensors (single file or sharded)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from jaxspec.models.config import ModelConfig
from jaxspec.models.loading.errors import ModelLoadError
from jaxspec.models.loading.layout import StateDict, check_state_dict, expected_shapes, read_json_object

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Buffers some older checkpoints saved next to the parameters; they are derived, not learned.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def config_from_hf(hf: Mapping[str, Any], name: str, source: str) -> ModelConfig:
    """ModelConfig from a transformers config.json dict; unsupported features raise ModelLoadError."""
    archs = hf.get("architectures") or []
    arch = archs[0] if archs else None
    if arch not in SUPPORTED_ARCHITECTURES:
        supported = ", ".join(SUPPORTED_ARCHITECTURES)
        raise ModelLoadError(f"{source}: unsupported architecture {arch!r} (supported: {supported})")
    if hf.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"{source}: activation {hf['hidden_act']!r} is not supported (only silu)")
    if hf.get("mlp_bias") or (arch != "Qwen2ForCausalLM" and hf.get("attention_bias")):
        raise ModelLoadError(f"{source}: attention_bias / mlp_bias are not supported")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ModelLoadError(f"{source}: RoPE scaling {rope_type!r} is not supported")
    try:
        heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        max_pos = int(hf["max_position_embeddings"])
        # A sliding window equals full attention on sequences no longer than the window.
        window = hf.get("sliding_window")
        if window and (arch == "MistralForCausalLM" or hf.get("use_sliding_window")):
            max_pos = min(max_pos, int(window))
        eos = hf.get("eos_token_id")
        return ModelConfig(
            name=name,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or hidden // heads),
            intermediate_size=int(hf["intermediate_size"]),
            rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),  # transformers' default for all three
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=arch == "Qwen2ForCausalLM",
            max_position_embeddings=max_pos,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]),
        )
    except KeyError as e:
        raise ModelLoadError(f"{source}: config.json lacks {e.args[0]!r}") from None
    except (TypeError, ValueError, ZeroDivisionError) as e:
        raise ModelLoadError(f"{source}: invalid config.json: {e}") from None


def config_to_hf(config: ModelConfig) -> dict[str, Any]:
    """A transformers config.json dict (LlamaForCausalLM, or Qwen2ForCausalLM when qkv_bias)."""
    qwen = config.qkv_bias
    eos = list(config.eos_token_ids)
    hf: dict[str, Any] = {
        "architectures": ["Qwen2ForCausalLM" if qwen else "LlamaForCausalLM"],
        "model_type": "qwen2" if qwen else "llama",
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "tie_word_embeddings": config.tie_embeddings,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": eos if len(eos) > 1 else (eos[0] if eos else None),
        "dtype": "float32",
    }
    if qwen:
        hf.update(use_sliding_window=False, sliding_window=None)
    else:
        hf.update(attention_bias=False, mlp_bias=False)
    return hf


def read_safetensors_dir(directory: str | os.PathLike[str]) -> tuple[ModelConfig, StateDict]:
    """Config and float32 weights of a transformers model directory (the config is named after it).

    Holds the whole model in float32: serving loads use `jaxspec.models.loading.streaming` instead.
    """
    d = Path(directory)
    config = read_safetensors_config(d)
    state: StateDict = {}
    for path, names in weight_files(d).items():
        try:
            with safe_open(str(path), framework="numpy") as f:
                present = set(f.keys())
                for name in names if names is not None else sorted(present):
                    if name not in present:
                        raise ModelLoadError(f"{path}: lacks tensor {name}, which the index places there")
                    if is_ignored_tensor(name):
                        continue
                    state[name] = np.ascontiguousarray(f.get_tensor(name), dtype=np.float32)
        except (SafetensorError, OSError, ValueError, TypeError) as e:
            raise ModelLoadError(f"{path}: not a readable safetensors file ({e})") from None

    if config.tie_embeddings and "lm_head.weight" in state:
        head = state.pop("lm_head.weight")
        embed = state.get("model.embed_tokens.weight")
        if embed is None or not np.array_equal(head, embed):
            raise ModelLoadError(f"{d}: tie_word_embeddings is true but lm_head.weight differs from the embedding")
    check_state_dict(config, state, str(d))
    return config, state


def read_safetensors_config(directory: str | os.PathLike[str]) -> ModelConfig:
    """The ModelConfig of a transformers directory (config.json, plus generation_config.json's stop ids)."""
    d = Path(directory)
    if not d.is_dir():
        raise ModelLoadError(f"{d}: no such directory" if not d.exists() else f"{d}: not a directory")
    config = config_from_hf(read_json_object(d / "config.json"), d.name, str(d))
    generation = d / "generation_config.json"
    if generation.is_file():
        extra = read_json_object(generation).get("eos_token_id")
        extra = extra if isinstance(extra, list) else [] if extra is None else [extra]
        config = config.replace(eos_token_ids=tuple(dict.fromkeys([*config.eos_token_ids, *map(int, extra)])))
    return config


def is_ignored_tensor(name: str) -> bool:
    """Buffers some checkpoints save next to the parameters (derived, not learned)."""
    return name.endswith(_IGNORED_SUFFIXES)


def write_safetensors_dir(
    directory: str | os.PathLike[str],
    config: ModelConfig,
    state_dict: Mapping[str, np.ndarray],
    *,
    max_shard_bytes: int | None = None,
    tokenizer: Any = None,
) -> None:
    """Write config.json, generation_config.json and weights that transformers can load.

    With `max_shard_bytes`, weights go into model-0000i-of-0000n.safetensors shards plus an index.
    `tokenizer` (a TextTokenizer) is saved alongside when given.
    """
    check_state_dict(config, state_dict, "state dict to write")
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(config_to_hf(config), indent=2) + "\n")
    generation = {"bos_token_id": config.bos_token_id, "eos_token_id": list(config.eos_token_ids)}
    (d / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")

    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name in expected_shapes(config):
        array = np.ascontiguousarray(state_dict[name])
        if max_shard_bytes is not None and shards[-1] and size + array.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = array
        size += array.nbytes
    metadata = {"format": "pt"}
    if max_shard_bytes is None:
        save_file(shards[0], str(d / SINGLE_FILE), metadata=metadata)
    else:
        weight_map = {}
        for i, shard in enumerate(shards, start=1):
            filename = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(d / filename), metadata=metadata)
            weight_map.update(dict.fromkeys(shard, filename))
        total = sum(a.nbytes for s in shards for a in s.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (d / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    if tokenizer is not None:
        tokenizer.save(d)


def weight_files(d: Path) -> dict[Path, list[str] | None]:
    """Safetensors file -> tensor names to take from it (None: all)."""
    if (d / INDEX_FILE).is_file():
        weight_map = read_json_object(d / INDEX_FILE).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(f"{d / INDEX_FILE}: no weight_map")
        files: dict[Path, list[str] | None] = {}
        for name, filename in weight_map.items():
            files.setdefault(d / filename, []).append(name)  # type: ignore[union-attr]
        for path in files:
            if not path.is_file():
                raise ModelLoadError(f"{d / INDEX_FILE}: shard {path.name} is missing")
        return files
    if (d / SINGLE_FILE).is_file():
        return {d / SINGLE_FILE: None}
    raise ModelLoadError(f"{d}: neither {SINGLE_FILE} nor {INDEX_FILE} found")
