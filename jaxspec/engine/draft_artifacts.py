"""Draft artifacts: the architectures of the token draft and the feature draft, building one for a target, and
saving and loading trained drafts (`draft.json` + `weights.npz`), the shipped ones included.

The engine builder (jaxspec.engine.build) loads drafts through this module; training (jaxspec.training) builds,
trains and saves them through it. docs/drafts.md describes both drafts and their formats.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxspec.models.config import ModelConfig
from jaxspec.models.draft import DraftLlama, load_trainable_state, trainable_state
from jaxspec.models.feature_draft import FeatureDraft, feature_draft_config
from jaxspec.models.llama import Llama
from jaxspec.resources import draft_arch_file, shipped_draft_dir

DEFAULT_ARCH = "wide2"
FORMAT = "jaxspec-draft"
REBUILD_COMMAND = "jaxspec distill"
FEATURE_FORMAT = "jaxspec-feature-draft"
FEATURE_SUBDIR = "feature"  # jaxspec/drafts/<target>/feature/
FEATURE_REBUILD_COMMAND = "jaxspec distill --kind feature"


# --- the token draft ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DraftArch:
    """A draft architecture (jaxspec/configs/drafts/*.yaml). Width = hidden_size; the embedding
    width is the target's (projections are added when they differ)."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_keep: int | None = None  # None: the full vocabulary
    init_layers: tuple[int, ...] | None = None  # target layers to copy (needs the target's shapes)

    @classmethod
    def load(cls, spec: str | Path) -> DraftArch:
        """A YAML path, or a name under jaxspec/configs/drafts/."""
        import yaml

        path = Path(spec)
        if not path.is_file():
            path = draft_arch_file(str(spec))  # FileNotFoundError naming the known architectures
        raw = yaml.safe_load(path.read_text()) or {}
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> DraftArch:
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = set(raw) - fields
        if unknown:
            raise ValueError(f"unknown draft architecture keys: {sorted(unknown)}")
        raw = dict(raw)
        if raw.get("init_layers") is not None:
            raw["init_layers"] = tuple(int(i) for i in raw["init_layers"])
        return cls(**raw)

    def model_config(self, target: ModelConfig) -> ModelConfig:
        return target.replace(name=f"{target.name}-draft-{self.name}", num_layers=self.num_layers,
                              hidden_size=self.hidden_size, num_heads=self.num_heads,
                              num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                              intermediate_size=self.intermediate_size, tie_embeddings=True,
                              qkv_bias=target.qkv_bias)

    def own_params(self, embed_dim: int) -> int:
        """Trainable parameters (the shared embedding and kept-row head not counted)."""
        d, f = self.hidden_size, self.intermediate_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        per_layer = d * q * 2 + 2 * d * kv + 3 * d * f + 2 * d
        proj = 2 * embed_dim * d if d != embed_dim else 0
        return self.num_layers * per_layer + d + proj


def build_draft(target: Llama, arch: DraftArch, keep_ids=None, seed: int = 0) -> DraftLlama:
    """A draft sharing `target`'s embedding; initialised from target layers if arch says so."""
    config = arch.model_config(target.config)
    draft = DraftLlama(config, embed=target.embed.value, keep_ids=keep_ids, rngs=nnx.Rngs(seed))
    if arch.init_layers:
        tc = target.config
        same = (arch.hidden_size, arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.intermediate_size) == (
            tc.hidden_size, tc.num_heads, tc.num_kv_heads, tc.head_dim, tc.intermediate_size)
        if not same or len(arch.init_layers) != arch.num_layers:
            raise ValueError("init_layers needs the target's layer shapes and one index per draft layer")
        idx = np.asarray(arch.init_layers)
        for name in draft.stacked_weight_names():
            getattr(draft, name).value = getattr(target, name).value[idx]
        draft.final_norm.value = jnp.copy(target.final_norm.value)  # a copy: training donates its params
    return draft


# --- the files: draft.json (architecture, target, recipe, metrics) + weights.npz (own weights, kept ids) ----------


def _write_files(out_dir: str | Path, draft, info: dict, dtype) -> Path:
    """Write `draft`'s own weights (in `dtype`) and kept ids to weights.npz and `info` to draft.json."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    weights = {k: v.astype(dtype) for k, v in trainable_state(draft).items()}
    weights["keep_ids"] = np.asarray(draft.keep_ids.value, np.int32)
    np.savez(out / "weights.npz", **weights)
    (out / "draft.json").write_text(json.dumps(info, indent=2, default=str) + "\n")
    return out


def _read_files(path: Path, expected_format: str, kind: str, target: Llama,
                rebuild_command: str) -> tuple[dict, dict[str, np.ndarray], np.ndarray]:
    """(draft.json, own weights as float32, kept ids) of a `kind` saved for `target`'s vocabulary and width."""
    info_file = path / "draft.json"
    if not info_file.is_file():
        raise FileNotFoundError(f"no {kind} at {path} (draft.json missing); build it with: {rebuild_command}")
    info = json.loads(info_file.read_text())
    if info.get("format") != expected_format:
        raise ValueError(f"{path}: not a jaxspec {kind} (format {info.get('format')!r})")
    t = info["target"]
    if (t["vocab_size"], t["hidden_size"]) != (target.config.vocab_size, target.config.hidden_size):
        raise ValueError(f"{path}: {kind} was trained for {t['name']} (vocab {t['vocab_size']}, width "
                         f"{t['hidden_size']}), not {target.config.name}")
    with np.load(path / "weights.npz") as z:
        weights = {k: z[k] for k in z.files}
    keep = weights.pop("keep_ids")
    return info, {k: v.astype(np.float32) for k, v in weights.items()}, keep


def save_draft(out_dir: str | Path, draft: DraftLlama, arch: DraftArch, target_config: ModelConfig,
               meta: dict | None = None, dtype=np.float16) -> Path:
    """draft.json (architecture, kept ids count, recipe, metrics) + weights.npz (own weights)."""
    info = {"format": FORMAT, "version": 1, "arch": dataclasses.asdict(arch),
            "target": {"name": target_config.name, "vocab_size": target_config.vocab_size,
                       "hidden_size": target_config.hidden_size},
            "num_kept": draft.num_kept, "own_params": arch.own_params(draft.embed_dim), **(meta or {})}
    return _write_files(out_dir, draft, info, dtype)


def load_draft(path: str | Path, target: Llama) -> DraftLlama:
    """A draft saved by `save_draft`, sharing `target`'s embedding."""
    info, weights, keep = _read_files(Path(path), FORMAT, "draft", target, REBUILD_COMMAND)
    arch = DraftArch.from_dict(info["arch"])
    draft = DraftLlama(arch.model_config(target.config), embed=target.embed.value, keep_ids=keep,
                       rngs=nnx.Rngs(0))
    return load_trainable_state(draft, weights)


def shipped_draft_path(target_config: ModelConfig) -> Path:
    return shipped_draft_dir(target_config.name)


def load_shipped_draft(target_config: ModelConfig, target: Llama | None = None) -> DraftLlama:
    """The default draft (`--draft default`) for `target_config`; `target` supplies the shared
    embedding (loaded with load_model(None) when omitted and the target is the default)."""
    path = shipped_draft_path(target_config)
    if not (path / "draft.json").is_file():
        raise FileNotFoundError(f"no shipped draft for {target_config.name!r} at {path}; build it with: "
                                f"{REBUILD_COMMAND}")
    if target is None:
        from jaxspec.models.llama import from_hf_state_dict
        from jaxspec.models.loading.registry import load_model

        loaded = load_model(target_config.name)
        target = from_hf_state_dict(loaded.config, loaded.state_dict)
    if target.config.vocab_size != target_config.vocab_size:
        raise ValueError("target does not match target_config")
    return load_draft(path, target)


# --- the feature draft ----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class FeatureArch:
    """The feature draft's shape and loss: `num_layers` decoder layers at the target's width, reading the
    target's hidden states after `feature_layers` (None: its last layer only, EAGLE-1; e.g. (2, 15, 30): EAGLE-3's
    low/mid/high fusion, the last entry the target's last layer)."""

    num_layers: int = 1
    vocab_keep: int | None = 8192  # None: the full vocabulary
    passes: int = 3  # training-time-test depth U
    reg_weight: float = 1.0  # weight of the feature regression next to the KL
    feature_layers: tuple[int, ...] | None = None

    @classmethod
    def from_dict(cls, raw: dict) -> FeatureArch:
        fields = {f.name: raw[f.name] for f in dataclasses.fields(cls) if f.name in raw}
        if fields.get("feature_layers") is not None:
            fields["feature_layers"] = tuple(fields["feature_layers"])
        return cls(**fields)

    def layers_for(self, target: ModelConfig) -> tuple[int, ...]:
        """The target layer counts read, checked against the target (the last must be its last layer)."""
        layers = self.feature_layers or (target.num_layers,)
        if layers[-1] != target.num_layers or not all(1 <= i <= target.num_layers for i in layers):
            raise ValueError(f"feature layers {layers} must lie in 1..{target.num_layers} and end with "
                             f"{target.num_layers}, the target's last layer (what the draft predicts)")
        return tuple(layers)


def target_head(target: Llama) -> jax.Array | None:
    """The target's output head as [V, D] rows when it is not its tied embedding (else None)."""
    return None if target.config.tie_embeddings else target.lm_head.value.T


def build_feature_draft(target: Llama, arch: FeatureArch, keep_ids=None, seed: int = 0) -> FeatureDraft:
    """A feature draft sharing the target's embedding and head; layers initialised from its last layers."""
    draft = FeatureDraft(feature_draft_config(target.config, arch.num_layers), embed=target.embed.value,
                         feature_layers=arch.layers_for(target.config), head=target_head(target),
                         keep_ids=keep_ids, rngs=nnx.Rngs(seed))
    idx = np.arange(target.config.num_layers - arch.num_layers, target.config.num_layers)
    for name in draft.stacked_weight_names():
        getattr(draft, name).value = getattr(target, name).value[idx]
    draft.final_norm.value = jnp.copy(target.final_norm.value)  # a copy: training donates its params
    return draft


def save_feature_draft(out_dir: str | Path, draft: FeatureDraft, arch: FeatureArch, target_config: ModelConfig,
                       meta: dict | None = None, dtype=np.float16) -> Path:
    """draft.json (architecture, recipe, metrics) + weights.npz (own weights, kept ids)."""
    own = int(sum(v.size for v in trainable_state(draft).values()))
    info = {"format": FEATURE_FORMAT, "version": 1, "arch": dataclasses.asdict(arch),
            "target": {"name": target_config.name, "vocab_size": target_config.vocab_size,
                       "hidden_size": target_config.hidden_size, "num_layers": target_config.num_layers},
            "num_kept": draft.num_kept, "own_params": own, **(meta or {})}
    return _write_files(out_dir, draft, info, dtype)


def load_feature_draft(path: str | Path, target: Llama) -> FeatureDraft:
    """A feature draft saved by `save_feature_draft`, sharing `target`'s embedding and head."""
    info, weights, keep = _read_files(Path(path), FEATURE_FORMAT, "feature draft", target, FEATURE_REBUILD_COMMAND)
    arch = FeatureArch.from_dict(info["arch"])
    draft = FeatureDraft(feature_draft_config(target.config, arch.num_layers), embed=target.embed.value,
                         feature_layers=arch.layers_for(target.config), head=target_head(target), keep_ids=keep,
                         rngs=nnx.Rngs(0))
    return load_trainable_state(draft, weights)


def shipped_feature_draft_dir(target_name: str) -> Path:
    return shipped_draft_dir(target_name) / FEATURE_SUBDIR


def load_shipped_feature_draft(target: Llama) -> FeatureDraft:
    """The shipped feature draft (`--proposer draft --draft feature`) of `target`."""
    return load_feature_draft(shipped_feature_draft_dir(target.config.name), target)


