"""Read a GGUF file into a ModelConfig and a float32 state dict in Hugging Face layout.

Dequantisation is the `gguf` library's (`gguf.quants.dequantize`); this module only maps names,
shapes and metadata. GGUF lists a tensor's dims fastest-first (ne0 = in_features), so a numpy
array has the reversed shape, which is already transformers' [out, in].
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from jaxspec.models.config import ModelConfig
from jaxspec.models.loading.errors import ModelLoadError
from jaxspec.models.loading.layout import StateDict, check_state_dict
from jaxspec.models.loading.special_tokens import stop_token_ids

SUPPORTED_ARCHITECTURES = ("llama", "qwen2")

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Values dequantised at a time (a block of rows of one tensor).
_BLOCK_VALUES = 1 << 22


GGUFSource = str | os.PathLike[str] | gguf.GGUFReader


def open_gguf(path: GGUFSource) -> gguf.GGUFReader:
    """A GGUFReader for `path`, or ModelLoadError if it is missing or not a readable GGUF file.

    An already open reader is passed through, so callers can share one parse of the file.
    """
    if isinstance(path, gguf.GGUFReader):
        return path
    p = Path(path)
    if not p.is_file():
        raise ModelLoadError(f"{p}: no such file" if not p.exists() else f"{p}: not a file")
    try:
        return gguf.GGUFReader(p)
    except Exception as e:  # the reader raises assorted errors on foreign or damaged files
        raise ModelLoadError(f"{p}: not a readable GGUF file ({type(e).__name__}: {e})") from e


def field_value(reader: gguf.GGUFReader, key: str) -> Any:
    """The value of metadata field `key` (a list for arrays), or None if absent."""
    field = reader.fields.get(key)
    if field is None:
        return None
    value = field.contents()
    if field.types and field.types[0] == gguf.GGUFValueType.FLOAT32:
        value = float(str(np.float32(value)))  # shortest decimal: 1e-05, not 9.99999974738e-06
    return value


def reader_path(reader: gguf.GGUFReader) -> Path:
    return Path(reader.data.filename)


def read_gguf_metadata(path: GGUFSource, arrays: bool = False) -> dict[str, Any]:
    """Metadata key -> value of a GGUF file, without touching tensor data.

    Array fields (the tokenizer's vocabulary and merges) are left out unless `arrays` is True.
    """
    reader = open_gguf(path)
    return {
        key: field_value(reader, key)
        for key, field in reader.fields.items()
        if not key.startswith("GGUF.") and (arrays or field.types[:1] != [gguf.GGUFValueType.ARRAY])
    }


def read_gguf(path: GGUFSource) -> tuple[ModelConfig, StateDict]:
    """Config and dequantised float32 weights (HF names, HF layout) of a llama or qwen2 GGUF file.

    The config is named after the file stem. Holds the whole model in float32: serving loads use
    `jaxspec.models.loading.streaming` instead (one tensor at a time).
    """
    reader = open_gguf(path)
    source = str(reader_path(reader))
    config = read_gguf_config(reader)
    tensors = gguf_tensors(reader)
    state = {name: _dequantize(t, source) for name, t in tensors.items()}
    check_state_dict(config, state, source)
    arch = config_arch(reader)
    return config, {name: _hf_row_order(arch, config, name, value) for name, value in state.items()}


def read_gguf_config(path: GGUFSource) -> ModelConfig:
    """The ModelConfig of a GGUF file (named after the file stem), without touching tensor data."""
    reader = open_gguf(path)
    return _config_from_reader(reader, reader_path(reader).stem, str(reader_path(reader)))


def gguf_tensors(path: GGUFSource) -> dict[str, Any]:
    """HF name -> the file's (not yet dequantised) tensor; ModelLoadError on a tensor we do not map."""
    reader = open_gguf(path)
    source = str(reader_path(reader))
    return {_hf_name(t.name, source): t for t in reader.tensors}


def gguf_tensor_shape(tensor: Any) -> tuple[int, ...]:
    """A file tensor's shape in numpy (HF) order: GGUF lists dims fastest-first."""
    return tuple(int(n) for n in reversed(tensor.shape.tolist()))


def read_gguf_tensor(reader: gguf.GGUFReader, config: ModelConfig, name: str, tensor: Any) -> np.ndarray:
    """One tensor (HF name `name`, from `gguf_tensors`) dequantised to float32 in HF layout and row order."""
    value = _dequantize(tensor, str(reader_path(reader)))  # [out, in] or [n] float32
    return _hf_row_order(config_arch(reader), config, name, value)


def _hf_row_order(arch: str, config: ModelConfig, name: str, value: np.ndarray) -> np.ndarray:
    """llama files store Q/K rows permuted for llama.cpp's RoPE; qwen2 files keep HF's row order."""
    if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
        return unpermute_qk(value, config.num_heads if ".q_proj." in name else config.num_kv_heads)
    return value


def config_arch(reader: gguf.GGUFReader) -> str:
    return str(field_value(reader, "general.architecture"))


def unpermute_qk(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row order for interleaved RoPE, giving HF's half-split order.

    llama.cpp's converter stores `w.reshape(h, 2, d // 2, ...).swapaxes(1, 2)`: within each head, rows
    from the two halves interleaved. Works for weights [h*d, in] and biases [h*d].
    """
    rows = weight.shape[0]
    if rows % (2 * num_heads):
        raise ModelLoadError(f"cannot split {rows} rows into {num_heads} heads of even size")
    half = rows // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def permute_qk(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's permutation (the inverse of `unpermute_qk`); for writing test files."""
    half = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, 2, half, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _hf_name(name: str, source: str) -> str:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    match = _BLOCK_RE.fullmatch(name)
    if match and match.group(2) in _BLOCK_NAMES:
        return f"model.layers.{match.group(1)}.{_BLOCK_NAMES[match.group(2)]}.{match.group(3)}"
    raise ModelLoadError(f"{source}: unsupported tensor {name!r} (no rope scaling, MoE or extra heads)")


def _dequantize(tensor: Any, source: str) -> np.ndarray:
    """A file tensor as float32 in numpy (HF) shape, dequantised in blocks of rows.

    Blocks bound the library's temporaries (several arrays of the block's size) to about
    `_BLOCK_VALUES` values instead of a multiple of the whole tensor.
    """
    shape = gguf_tensor_shape(tensor)
    data = tensor.data  # quantised: uint8 [rows, row bytes]; F32 / F16: [rows, cols] or [n]
    out = np.empty(shape, np.float32)  # [out, in] or [n]
    row_values = int(np.prod(shape[1:]))
    blocked = len(shape) == 2 and data.ndim == 2 and data.shape[0] == shape[0]
    step = max(1, _BLOCK_VALUES // max(1, row_values)) if blocked else max(1, shape[0])
    for start in range(0, shape[0] if shape else 1, step):
        part = data[start:start + step] if blocked else data
        try:
            values = gguf.quants.dequantize(part, tensor.tensor_type)  # [rows in block, in] (or flat)
        except NotImplementedError:
            raise ModelLoadError(
                f"{source}: tensor {tensor.name} has type {tensor.tensor_type.name}, "
                "which the gguf library cannot dequantise"
            ) from None
        target = out[start:start + step] if blocked else out
        if values.size != target.size:
            raise ModelLoadError(f"{source}: tensor {tensor.name} has {values.size} values where {target.size} "
                                 f"were expected (shape {shape})")
        target[...] = np.asarray(values, dtype=np.float32).reshape(target.shape)  # copies out of the mapped file
    return out


def _int_field(reader: gguf.GGUFReader, key: str, source: str, default: int | None = None) -> int:
    value = field_value(reader, key)
    if value is None:
        if default is None:
            raise ModelLoadError(f"{source}: metadata field {key} is missing")
        return default
    if not isinstance(value, int):
        raise ModelLoadError(f"{source}: metadata field {key} is {value!r}, expected one integer")
    return value


def _float_field(reader: gguf.GGUFReader, key: str, source: str, default: float | None = None) -> float:
    value = field_value(reader, key)
    if value is None:
        if default is None:
            raise ModelLoadError(f"{source}: metadata field {key} is missing")
        return default
    if not isinstance(value, (int, float)):
        raise ModelLoadError(f"{source}: metadata field {key} is {value!r}, expected a number")
    return float(value)


def _config_from_reader(reader: gguf.GGUFReader, name: str, source: str) -> ModelConfig:
    arch = config_arch(reader)
    if arch not in SUPPORTED_ARCHITECTURES:
        supported = ", ".join(SUPPORTED_ARCHITECTURES)
        raise ModelLoadError(f"{source}: unsupported architecture {arch!r} (supported: {supported})")
    scaling = field_value(reader, f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        raise ModelLoadError(f"{source}: RoPE scaling {scaling!r} is not supported")
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ModelLoadError(f"{source}: missing tensor token_embd.weight")
    vocab_size = int(tensors["token_embd.weight"].shape[1])
    declared_vocab = field_value(reader, f"{arch}.vocab_size")
    if declared_vocab is not None and declared_vocab != vocab_size:
        raise ModelLoadError(f"{source}: {arch}.vocab_size={declared_vocab} but token_embd has {vocab_size} rows")

    hidden = _int_field(reader, f"{arch}.embedding_length", source)
    heads = _int_field(reader, f"{arch}.attention.head_count", source)
    kv_heads = _int_field(reader, f"{arch}.attention.head_count_kv", source, default=heads)
    if heads <= 0:
        raise ModelLoadError(f"{source}: {arch}.attention.head_count is {heads}")
    if hidden % heads and field_value(reader, f"{arch}.attention.key_length") is None:
        raise ModelLoadError(f"{source}: embedding_length {hidden} is not a multiple of head_count {heads}")
    head_dim = _int_field(reader, f"{arch}.attention.key_length", source, default=hidden // heads)
    rope_dims = field_value(reader, f"{arch}.rope.dimension_count")
    if rope_dims is not None and rope_dims != head_dim:
        raise ModelLoadError(f"{source}: partial rotary embedding ({rope_dims} of {head_dim} dims) is unsupported")

    tokens = field_value(reader, "tokenizer.ggml.tokens") or []
    token_ids = {t: i for i, t in reversed(list(enumerate(tokens)))}  # first id wins on duplicates
    bos = field_value(reader, "tokenizer.ggml.bos_token_id")
    eos = stop_token_ids(
        [field_value(reader, "tokenizer.ggml.eos_token_id")],
        field_value(reader, "tokenizer.chat_template"),
        token_ids.get,
    )
    try:
        return ModelConfig(
            name=name,
            vocab_size=vocab_size,
            hidden_size=hidden,
            num_layers=_int_field(reader, f"{arch}.block_count", source),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=_int_field(reader, f"{arch}.feed_forward_length", source),
            # 10000 is llama.cpp's value when a file omits the base.
            rope_theta=_float_field(reader, f"{arch}.rope.freq_base", source, default=10000.0),
            rms_norm_eps=_float_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", source),
            tie_embeddings="output.weight" not in tensors,
            qkv_bias="blk.0.attn_q.bias" in tensors,
            max_position_embeddings=_int_field(reader, f"{arch}.context_length", source),
            bos_token_id=bos,
            eos_token_ids=eos,
        )
    except ValueError as e:
        raise ModelLoadError(f"{source}: inconsistent model metadata: {e}") from None
