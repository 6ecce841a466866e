"""Memory-bounded loading: a model file straight into its placed serving layout, one tensor at a time.

`stream_model(spec, dtype, placement)` reads the config, then goes layer by layer: each of the
layer's tensors is read (GGUF: dequantised from the memory-mapped file; safetensors: one
`safe_open` read; a converted orbax directory: that layer's tensors restored together), cast to
`dtype` at once, converted to our layout (`jaxspec.models.llama._hf_layer_tensors`), fused for `placement`
(`fuse_layer`) and placed (`Placement.put_param`); the host arrays are dropped before the next
layer. Embedding, final norm and LM head go the same way. The result is a serving-only `Llama`
(`serving_only_model`) whose split for `placement` is already registered.

Peak host memory: the placed weights (on CPU devices they are host memory) + one layer in `dtype`
(twice: unfused and fused) + one tensor in float32 (a converted directory: one float32 layer).
Never a whole float32 copy.

GGUF files are streamed from the file every time: the converted-checkpoint cache of
`load_model(cache_dir=...)` is not used, since writing it needs the whole float32 state dict, and
a memory-mapped GGUF dequantises tensor by tensor anyway. After each layer the file's pages are
dropped from this process's mapping (`madvise(MADV_DONTNEED)`; the OS page cache keeps them), so
the mapped file does not count towards the resident set.
"""

from __future__ import annotations

import dataclasses
import mmap
import re
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from safetensors import SafetensorError, safe_open

from jaxspec.models.config import ModelConfig
from jaxspec.models.llama import Llama, _hf_layer_tensors, fuse_layer, serving_only_model
from jaxspec.models.loading.checkpoints import PARAMS_DIR, read_converted_info
from jaxspec.models.loading.errors import ModelLoadError
from jaxspec.models.loading.gguf import gguf_tensor_shape, gguf_tensors, open_gguf, read_gguf_config, read_gguf_tensor
from jaxspec.models.loading.layout import check_shapes, expected_shapes
from jaxspec.models.loading.registry import ModelSource, finish_config, resolve_model
from jaxspec.models.loading.safetensors import is_ignored_tensor, read_safetensors_config, weight_files
from jaxspec.models.loading.tokenizer import TextTokenizer
from jaxspec.models.sharding import Placement

_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.")
# Rows compared at a time when checking a tied checkpoint's redundant lm_head against its embedding.
_TIE_CHECK_ROWS = 4096


@dataclasses.dataclass(frozen=True)
class StreamedModel:
    """A serving-only model (its split for `placement` registered), its tokenizer and where it came from."""

    model: Llama
    tokenizer: TextTokenizer
    source: ModelSource


class TensorSource:
    """Float32 HF-layout tensors of one model file, read one at a time (`read`)."""

    config: ModelConfig
    tokenizer: TextTokenizer
    where: str

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """HF name -> shape of every tensor the file holds, without reading data."""
        raise NotImplementedError

    def read(self, name: str) -> np.ndarray:
        """Tensor `name` in float32, HF layout ([out, in]) and row order."""
        raise NotImplementedError

    def layer_done(self) -> None:
        """Called after each layer (and each global tensor) is placed: release what the reads mapped."""

    def close(self) -> None:
        """Release the file."""


class GGUFSource(TensorSource):
    """A memory-mapped GGUF file; each read dequantises one tensor (llama Q/K rows unpermuted)."""

    def __init__(self, path: Path):
        self.reader = open_gguf(path)
        self.where = str(path)
        self.config = read_gguf_config(self.reader)
        self.tokenizer = TextTokenizer.from_gguf(self.reader)
        self.tensors = gguf_tensors(self.reader)
        # Config and tokenizer are built: drop the parsed metadata but the architecture (for a 150k
        # vocabulary its per-token Python objects are ~0.5 GB, held through the whole load otherwise).
        self.reader.fields = {k: v for k, v in self.reader.fields.items() if k == "general.architecture"}

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: gguf_tensor_shape(t) for name, t in self.tensors.items()}

    def read(self, name: str) -> np.ndarray:
        return read_gguf_tensor(self.reader, self.config, name, self.tensors[name])

    def layer_done(self) -> None:
        mapped = getattr(self.reader.data, "_mmap", None)  # np.memmap's mmap.mmap
        if isinstance(mapped, mmap.mmap) and hasattr(mmap, "MADV_DONTNEED"):
            mapped.madvise(mmap.MADV_DONTNEED)  # drop the read pages from our mapping; the page cache keeps them

    def close(self) -> None:
        self.layer_done()


class SafetensorsSource(TensorSource):
    """A transformers directory (single file or sharded); each read opens its file, copies one tensor, closes."""

    def __init__(self, directory: Path):
        self.where = str(directory)
        self.config = read_safetensors_config(directory)
        self.tokenizer = TextTokenizer.from_dir(directory)
        self.files: dict[str, Path] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}
        for path, names in weight_files(directory).items():
            with self._open(path) as f:
                present = set(f.keys())
                for name in names if names is not None else sorted(present):
                    if name not in present:
                        raise ModelLoadError(f"{path}: lacks tensor {name}, which the index places there")
                    if not is_ignored_tensor(name):
                        self.files[name] = path
                        self._shapes[name] = tuple(f.get_slice(name).get_shape())
        if self.config.tie_embeddings and "lm_head.weight" in self.files:
            self._check_tied_head()
            del self.files["lm_head.weight"], self._shapes["lm_head.weight"]

    def _open(self, path: Path):
        try:
            return safe_open(str(path), framework="numpy")
        except (SafetensorError, OSError, ValueError, TypeError) as e:
            raise ModelLoadError(f"{path}: not a readable safetensors file ({e})") from None

    def _check_tied_head(self) -> None:
        """A tied checkpoint that still saved lm_head.weight must save the embedding there (checked in row blocks)."""
        head, embed = "lm_head.weight", "model.embed_tokens.weight"
        if embed not in self.files or self._shapes[head] != self._shapes[embed]:
            raise ModelLoadError(f"{self.where}: tie_word_embeddings is true but lm_head.weight differs from the "
                                 "embedding")
        with self._open(self.files[head]) as fh, self._open(self.files[embed]) as fe:
            rows = self._shapes[head][0]
            for start in range(0, rows, _TIE_CHECK_ROWS):
                block = slice(start, min(start + _TIE_CHECK_ROWS, rows))
                if not np.array_equal(fh.get_slice(head)[block], fe.get_slice(embed)[block]):  # [rows, D] each
                    raise ModelLoadError(f"{self.where}: tie_word_embeddings is true but lm_head.weight differs "
                                         "from the embedding")

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return dict(self._shapes)

    def read(self, name: str) -> np.ndarray:
        path = self.files[name]
        try:
            with self._open(path) as f:
                return np.ascontiguousarray(f.get_tensor(name), dtype=np.float32)
        except (SafetensorError, OSError, ValueError, TypeError) as e:
            raise ModelLoadError(f"{path}: cannot read tensor {name} ({e})") from None


class ConvertedSource(TensorSource):
    """A `save_converted` directory; the first read of a layer restores that layer's tensors (float32) together."""

    def __init__(self, directory: Path):
        self.directory = directory.absolute()
        self.where = str(self.directory)
        self.config, _ = read_converted_info(self.directory)
        self.tokenizer = TextTokenizer.from_dir(self.directory)
        self._pending: dict[str, np.ndarray] = {}
        try:
            with ocp.PyTreeCheckpointer() as checkpointer:
                tree = checkpointer.metadata(self.directory / PARAMS_DIR).item_metadata.tree
        except Exception as e:  # orbax raises assorted errors on a damaged checkpoint
            raise ModelLoadError(f"{self.directory / PARAMS_DIR}: cannot read orbax metadata "
                                 f"({type(e).__name__}: {e})") from e
        self._shapes = {str(name): tuple(meta.shape) for name, meta in tree.items()}

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return dict(self._shapes)

    def read(self, name: str) -> np.ndarray:
        if name not in self._pending:
            match = _LAYER_RE.match(name)
            group = [n for n in self._shapes if n.startswith(match.group(0))] if match else [name]
            self._pending = self._restore(group)
        return self._pending.pop(name)

    def _restore(self, names: list[str]) -> dict[str, np.ndarray]:
        item = {n: np.broadcast_to(np.float32(0), self._shapes[n]) for n in names}  # no memory: only shapes matter
        args = {n: ocp.RestoreArgs(restore_type=np.ndarray) for n in names}
        try:
            with ocp.PyTreeCheckpointer() as checkpointer:
                restored = checkpointer.restore(self.directory / PARAMS_DIR, args=ocp.args.PyTreeRestore(
                    item=item, restore_args=args, partial_restore=True))
        except Exception as e:  # orbax raises assorted errors (FileNotFoundError, ValueError, tensorstore's)
            raise ModelLoadError(f"{self.directory / PARAMS_DIR}: cannot restore {names[0]} "
                                 f"({type(e).__name__}: {e})") from e
        return {n: np.asarray(v) for n, v in restored.items()}


def open_source(source: ModelSource) -> TensorSource:
    """The tensor source of a resolved (non-preset) model spec."""
    if source.kind == "preset" or source.path is None:
        raise ModelLoadError(f"{source.name!r} is a weightless preset; build random weights from its config")
    if source.kind == "gguf":
        return GGUFSource(source.path)
    if source.kind == "converted":
        return ConvertedSource(source.path)
    return SafetensorsSource(source.path)


_SOURCES: weakref.WeakKeyDictionary[Llama, ModelSource] = weakref.WeakKeyDictionary()


def streamed_source(model: Llama) -> ModelSource | None:
    """Where a model built by `stream_model` was read from (None for any other model)."""
    return _SOURCES.get(model)


def stream_model(spec: str | ModelSource | None, dtype: str, placement: Placement | Callable[[ModelConfig], Placement],
                 *, num_layers: int | None = None, name: str | None = None) -> StreamedModel:
    """Load `spec` straight into its serving layout for `placement`, weights in `dtype`.

    `placement` may be a function of the model's config (e.g. `plan_layout` over a mesh). `num_layers`
    keeps only the first layers (a truncated draft), `name` renames the config. A bad or
    inconsistent file raises ModelLoadError before any weight is placed.
    """
    source = spec if isinstance(spec, ModelSource) else resolve_model(spec)
    tensors = open_source(source)
    try:
        check_shapes(tensors.config, tensors.shapes(), tensors.where)
        config = finish_config(tensors.config, tensors.tokenizer, source).replace(dtype=dtype)
        if num_layers is not None:
            if not 1 <= num_layers <= config.num_layers:
                raise ValueError(f"{config.name} has 1..{config.num_layers} layers, asked for {num_layers}")
            config = config.replace(num_layers=num_layers)
        if name is not None:
            config = config.replace(name=name)
        model = _stream(config, tensors, placement if isinstance(placement, Placement) else placement(config))
    finally:
        tensors.close()
    _SOURCES[model] = source
    return StreamedModel(model, tensors.tokenizer, source)


def _stream(config: ModelConfig, tensors: TensorSource, placement: Placement) -> Llama:
    target = np.dtype(jnp.dtype(config.dtype))  # numpy dtype (ml_dtypes.bfloat16 for bfloat16)
    read = _checked_reader(tensors)

    def layers() -> Iterator[dict]:
        for i in range(config.num_layers):
            unfused = _hf_layer_tensors(config, read, i, target)  # LAYER_WEIGHTS shapes, in `target`
            fused = fuse_layer(config, unfused, placement.layout)
            del unfused
            yield {key: placement.put_param(key, value) for key, value in fused.items()}
            del fused
            tensors.layer_done()

    placed = tuple(layers())
    others = {}  # each placed as soon as it is read: [V, D], [D], [D, V]
    globals_ = {"embed": "model.embed_tokens.weight", "final_norm": "model.norm.weight", "lm_head": "lm_head.weight"}
    for key, hf_name in globals_.items():
        if key == "lm_head" and config.tie_embeddings:
            continue
        value = read(hf_name).astype(target, copy=False)
        others[key] = placement.put_param(key, value.T if key == "lm_head" else value)  # lm_head: [V, D] -> [D, V]
        del value
        tensors.layer_done()
    return serving_only_model(config, placement, placed, others)


def _checked_reader(tensors: TensorSource) -> Callable[[str], np.ndarray]:
    want = expected_shapes(tensors.config)

    def read(name: str) -> np.ndarray:
        value = tensors.read(name)
        if value.dtype != np.float32 or value.shape != want[name]:
            raise ModelLoadError(f"{tensors.where}: tensor {name} read as {value.dtype} {value.shape}, "
                                 f"expected float32 {want[name]}")
        return value

    return read


__all__ = ["ConvertedSource", "GGUFSource", "SafetensorsSource", "StreamedModel", "TensorSource", "open_source",
           "stream_model", "streamed_source"]
