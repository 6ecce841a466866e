"""Model loading: GGUF / safetensors / orbax checkpoints into HF-layout float32 numpy weights.

Every loader returns `(ModelConfig, dict[str, np.ndarray])` with transformers' parameter names
(see `layout.expected_shapes`) and raises `ModelLoadError` on any failure. Those hold the whole model
in float32; serving loads go through `jaxspec.models.loading.streaming.stream_model` instead (tensor by
tensor into the placed serving layout; not imported here, it needs the model code).
"""

from jaxspec.models.loading.checkpoints import is_converted_dir, load_converted, save_converted
from jaxspec.models.loading.errors import ModelLoadError
from jaxspec.models.loading.gguf import read_gguf, read_gguf_metadata
from jaxspec.models.loading.layout import StateDict, check_state_dict, expected_shapes
from jaxspec.models.loading.registry import (
    DEFAULT_MODEL,
    LoadedModel,
    ModelEntry,
    ModelSource,
    list_models,
    load_model,
    resolve_model,
)
from jaxspec.models.loading.safetensors import read_safetensors_dir, write_safetensors_dir
from jaxspec.models.loading.tokenizer import TextTokenizer

__all__ = [
    "DEFAULT_MODEL",
    "LoadedModel",
    "ModelEntry",
    "ModelLoadError",
    "ModelSource",
    "StateDict",
    "TextTokenizer",
    "check_state_dict",
    "expected_shapes",
    "is_converted_dir",
    "list_models",
    "load_converted",
    "load_model",
    "read_gguf",
    "read_gguf_metadata",
    "read_safetensors_dir",
    "resolve_model",
    "save_converted",
    "write_safetensors_dir",
]
