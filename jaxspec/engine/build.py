"""Assemble an engine from user-facing names: model spec, proposer kind, draft spec, menu."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from pathlib import Path

import jax
import yaml

from jaxspec.config_file import check_fields
from jaxspec.dtypes import resolve_dtype
from jaxspec.engine import draft_artifacts
from jaxspec.engine.engine import Engine
from jaxspec.engine.kernels import kernel_plan_for
from jaxspec.menu import Menu
from jaxspec.mesh import MeshSpec, make_mesh
from jaxspec.models.config import ModelConfig
from jaxspec.models.feature_draft import FeatureDraft
from jaxspec.models.kernel_plan import KernelChoice
from jaxspec.models.llama import Llama, from_hf_state_dict, is_serving_only, random_model, to_hf_state_dict
from jaxspec.models.loading import ModelLoadError, TextTokenizer, resolve_model
from jaxspec.models.loading.streaming import stream_model, streamed_source
from jaxspec.models.sharding import Placement, TensorParallelLayout, plan_layout, replicated_layout, serving_placement
from jaxspec.resources import config_file
from jaxspec.speculation.proposers.base import Proposer
from jaxspec.speculation.proposers.draft_model import DraftModelProposer
from jaxspec.speculation.proposers.feature_draft import FeatureDraftProposer
from jaxspec.speculation.proposers.prompt_lookup import PromptLookupProposer
from jaxspec.speculation.proposers.suffix import SuffixProposer
from jaxspec.speculation.suffix_tree import SuffixConfig, SuffixIndex

PROPOSERS = ("none", "draft", "ngram", "suffix")


def model_cache_dir() -> str:
    """Where `jaxspec models convert` and the opt-in real pair put files (serving streams GGUF directly)."""
    return os.environ.get("JAXSPEC_MODEL_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "jaxspec", "models"))


@dataclasses.dataclass(frozen=True)
class BuiltModel:
    model: Llama
    tokenizer: TextTokenizer | None
    name: str


def build_model(spec: str | None, seed: int = 0, dtype: str = "float32", mesh: MeshSpec = MeshSpec(),
                tensor_parallel: bool = True, kernels: KernelChoice = "auto") -> BuiltModel:
    """Load a model spec (weights) or build a preset with random weights (tests, GPU benches).

    `dtype` ('auto', 'float32', 'bfloat16') is that of the weights and KV cache, resolved against
    jax.default_backend() here (jaxspec.dtypes.resolve_dtype); engine commands pass --dtype (default auto).
    `mesh` / `tensor_parallel`: where loaded weights are placed (split over `model`, or replicated for a draft).
    A loaded model is streamed tensor by tensor into its serving layout for that placement and the kernel plan
    of `kernels` (`jaxspec.models.loading.streaming`: never a whole float32 copy on the host); it serves only there.
    """
    dtype = resolve_dtype(dtype, jax.default_backend())  # a bad name fails before anything loads
    source = resolve_model(spec)
    if source.preset is not None:
        return BuiltModel(random_model(source.preset.replace(dtype=dtype), seed), None, source.name)
    streamed = stream_model(source, dtype, _placement(mesh, tensor_parallel, kernels))
    return BuiltModel(streamed.model, streamed.tokenizer, source.name)


def _placement(mesh: MeshSpec, tensor_parallel: bool, kernels: KernelChoice) -> Callable[[ModelConfig], Placement]:
    """Where a loaded model's serving weights go: split over `model` (plan_layout) or replicated, in the weight
    layout of its kernel plan."""
    def placement(config: ModelConfig) -> Placement:
        layout = plan_layout(config, mesh.model) if tensor_parallel else replicated_layout(config, mesh.model)
        return serving_placement(make_mesh(mesh), layout, kernel_plan_for(config, mesh, kernels, tensor_parallel))

    return placement


def truncated_copy(target: Llama, num_layers: int, mesh: MeshSpec = MeshSpec(),
                   kernels: KernelChoice = "auto") -> Llama:
    """The target's first `num_layers` layers with its embedding and head: a cheap draft.

    A streamed (serving-only) target is re-read from its file (first layers only), replicated over `mesh`.
    """
    if not 1 <= num_layers <= target.config.num_layers:
        raise ValueError(f"truncated draft needs 1..{target.config.num_layers} layers, got {num_layers}")
    name = f"{target.config.name}-first{num_layers}"
    if is_serving_only(target):
        source = streamed_source(target)
        if source is None:
            raise ValueError(f"{target.config.name} is serving-only but was not streamed from a file")
        plan = kernel_plan_for(target.config, mesh, kernels, tensor_parallel=False)
        placement = serving_placement(make_mesh(mesh), TensorParallelLayout(), plan)
        return stream_model(source, target.config.dtype, placement, num_layers=num_layers,
                            name=name).model
    config = target.config.replace(name=name, num_layers=num_layers)
    return from_hf_state_dict(config, to_hf_state_dict(target))


def build_draft(spec: str, target: Llama, mesh: MeshSpec = MeshSpec(), kernels: KernelChoice = "auto") -> Llama:
    """Draft specs: 'self' (the target), 'truncated:N' (its first N layers), 'default' (the
    shipped distilled draft), or any model spec; every draft takes the target's dtype."""
    if spec == "self":
        return target
    if spec.startswith("truncated:"):
        return truncated_copy(target, int(spec.split(":", 1)[1]), mesh, kernels)
    if spec == "default":
        return draft_artifacts.load_shipped_draft(target.config, target)
    return build_model(spec, dtype=target.config.dtype, mesh=mesh, tensor_parallel=False, kernels=kernels).model


def build_feature_draft(spec: str, target: Llama) -> FeatureDraft:
    """'feature' (the shipped feature draft of the target) or 'feature:DIR' (one saved by `jaxspec distill
    --kind feature --out DIR`); it shares the target's embedding and head and takes its dtype."""
    if spec == "feature":
        return draft_artifacts.load_shipped_feature_draft(target)
    return draft_artifacts.load_feature_draft(spec.split(":", 1)[1], target)


def build_proposer(kind: str, target: Llama, draft: str | None = None,
                   ngram: tuple[int, int] = (1, 3), mesh: MeshSpec = MeshSpec(),
                   kernels: KernelChoice = "auto", suffix: SuffixConfig = SuffixConfig()) -> Proposer | None:
    """The proposer `kind` names (None for 'none'); 'suffix' gets a fresh suffix index with `suffix`'s scope and
    bounds (docs/design.md, "Suffix decoding")."""
    if kind == "none":
        return None
    if kind == "ngram":
        return PromptLookupProposer(min_ngram=ngram[0], max_ngram=ngram[1])
    if kind == "suffix":
        return SuffixProposer(SuffixIndex(suffix))
    if kind == "draft":
        spec = draft or "default"
        if spec == "feature" or spec.startswith("feature:"):
            return FeatureDraftProposer(build_feature_draft(spec, target))
        return DraftModelProposer(build_draft(spec, target, mesh, kernels))
    raise ValueError(f"unknown proposer {kind!r}; choose one of {', '.join(PROPOSERS)}")


def _engine_config(name_or_path: str | None) -> tuple[str, dict]:
    """The values of a named entry of jaxspec/configs/engine.yaml, or of a YAML file with the same keys."""
    name_or_path = name_or_path or "default"
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml"):
        if not path.is_file():
            raise FileNotFoundError(f"engine config {path} does not exist")
        values = yaml.safe_load(path.read_text()) or {}
    else:
        menus = yaml.safe_load(config_file("engine.yaml").read_text())
        if name_or_path not in menus:
            raise KeyError(f"unknown engine menu {name_or_path!r}; known: {', '.join(menus)}")
        values = menus[name_or_path]
    return name_or_path, dict(values)


def load_mesh(name_or_path: str | None = None) -> MeshSpec:
    """The `mesh: {data: D, model: M}` of an engine config (data=1,model=1 when it has none)."""
    name, values = _engine_config(name_or_path)
    mesh = values.get("mesh")
    return MeshSpec() if mesh is None else MeshSpec.from_mapping(mesh, f"engine config {name}")


def load_menu(name_or_path: str | None = None, **overrides) -> Menu:
    """A named menu of jaxspec/configs/engine.yaml, or a YAML file with the same keys, with overrides."""
    name_or_path, values = _engine_config(name_or_path)
    values.pop("mesh", None)  # load_mesh
    values = check_fields(Menu, values, f"engine config {name_or_path}")
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}
    values.update({k: v for k, v in overrides.items() if v is not None})
    return Menu(**values)


def build_engine(model: str | None = None, proposer: str = "none", draft: str | None = None,
                 menu: Menu | None = None, dtype: str = "float32", mesh: MeshSpec = MeshSpec(),
                 kernels: KernelChoice = "auto") -> tuple[Engine, TextTokenizer | None]:
    built = build_model(model, dtype=dtype, mesh=mesh, kernels=kernels)
    prop = build_proposer(proposer, built.model, draft, mesh=mesh, kernels=kernels)
    return Engine(built.model, prop, menu or load_menu(), mesh=mesh, kernels=kernels), built.tokenizer


__all__ = ["build_engine", "build_model", "build_proposer", "build_draft", "build_feature_draft", "load_menu",
           "load_mesh", "truncated_copy", "ModelLoadError", "PROPOSERS"]
