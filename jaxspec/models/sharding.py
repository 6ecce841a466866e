"""How a model's serving weights and caches are split over a device mesh (docs/design.md, "Sharding").

The mesh has two axes: `data` (cache slots) and `model` (tensor parallel, Megatron-style). With M
devices on `model`:

    weight                         serving shape        split over `model`
    embed (and a tied LM head)     [V, D]               V (vocabulary)
    lm_head                        [D, V]               V
    wqkv   (column parallel)       [D, P, E_p]          P = M groups, each its own q | k | v heads
    bqkv                           [P, E_p]             P
    wo     (row parallel)          [N, H, D]            N: one all-reduce after attention
    w_gate_up (column parallel)    [D, P, 2F/P]         P, each group its own gate | up columns
    w_down (row parallel)          [F, D]               F: one all-reduce after the MLP
    norms, final_norm              [D]                  replicated
    target KV pages, per layer     [I', X, G', H]       pages over `data`, kv heads over `model`
    draft KV cache, per layer      [S', M, G, H]        slots over `data`

Grouping the fused projections by shard (`P` groups) keeps every device's q, k and v heads (and
its gate and up columns) in one contiguous block, so a column split needs no communication.

When a dimension does not divide M the layout says what it does instead (`TensorParallelLayout.notes`):
kv heads fewer than M are repeated until there are M (an exactly equivalent model: every query head
reads the same keys and values), a vocabulary that does not divide M is replicated; query heads or
the FFN width that do not divide M are refused with the list of M values that work.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as PS

from jaxspec.models.config import ModelConfig
from jaxspec.models.kernel_plan import KernelPlan
from jaxspec.models.panel_matmul import CONTRACTED_DIMS, PanelWeight, pack_panels

DATA, MODEL = "data", "model"  # mesh axis names


class ShardingError(ValueError):
    """A model cannot be split over the requested mesh."""


@dataclasses.dataclass(frozen=True)
class TensorParallelLayout:
    """How one model is split over `groups` devices of the `model` axis.

    groups:      P = the `model` axis size for the layers (1: the layers are replicated).
    kv_heads:    G' kv heads the serving weights and cache hold (G, or G repeated up to P).
    shard_vocab: embedding / LM head split over the vocabulary on `model` (else replicated); a draft
                 with replicated layers still splits the embedding it shares with its target.
    notes:       what was padded or replicated, in words (printed when an engine is built).
    """

    groups: int = 1
    kv_heads: int | None = None
    shard_vocab: bool = True
    notes: tuple[str, ...] = ()

    def kv_heads_for(self, config: ModelConfig) -> int:
        return config.num_kv_heads if self.kv_heads is None else self.kv_heads


def _reasons(config: ModelConfig, m: int) -> list[str]:
    """Why `config` cannot take M = m on `model` (empty: it can)."""
    c, why = config, []
    if c.num_heads % m:
        why.append(f"{c.num_heads} query heads")
    if c.intermediate_size % m:
        why.append(f"FFN width {c.intermediate_size}")
    if c.num_kv_heads % m and m % c.num_kv_heads:
        why.append(f"{c.num_kv_heads} kv heads (neither a multiple nor a divisor of {m})")
    return why


def valid_model_sizes(config: ModelConfig, up_to: int = 64) -> list[int]:
    """Every `model` axis size in 1..up_to this config can be split over."""
    return [m for m in range(1, up_to + 1) if not _reasons(config, m)]


def plan_layout(config: ModelConfig, model_size: int) -> TensorParallelLayout:
    """The tensor-parallel layout of `config` over `model_size` devices; ShardingError (naming the
    sizes that work) when its query heads or FFN width do not divide."""
    if model_size < 1:
        raise ShardingError(f"the model axis needs at least 1 device, got {model_size}")
    why = _reasons(config, model_size)
    if why:
        raise ShardingError(
            f"{config.name} cannot be split over model={model_size}: {', '.join(why)} cannot be split "
            f"{model_size} ways; valid model sizes: {', '.join(map(str, valid_model_sizes(config)))}")
    notes = []
    kv_heads = config.num_kv_heads
    if kv_heads < model_size:
        notes.append(f"{kv_heads} kv heads repeated to {model_size} (each device holds the kv head its query heads "
                     f"read; KV cache {model_size // kv_heads}x larger in total)")
        kv_heads = model_size
    shard_vocab = config.vocab_size % model_size == 0
    if not shard_vocab:
        notes.append(f"vocabulary {config.vocab_size} does not divide {model_size}: embedding and LM head replicated")
    return TensorParallelLayout(groups=model_size, kv_heads=kv_heads if kv_heads != config.num_kv_heads else None,
                                shard_vocab=shard_vocab, notes=tuple(notes))


def replicated_layout(config: ModelConfig, model_size: int) -> TensorParallelLayout:
    """A draft's layout: layers replicated (small; splitting them would add two all-reduces per layer to
    every drafted token), the embedding split over the vocabulary when it divides, like its target's."""
    return TensorParallelLayout(shard_vocab=config.vocab_size % model_size == 0)


def padded_slots(num_slots: int, data_size: int) -> int:
    """Cache slot rows S' ≥ S + 1 (serving slots + scratch), a multiple of the `data` axis size."""
    return math.ceil((num_slots + 1) / data_size) * data_size


def param_spec(name: str, layout: TensorParallelLayout) -> PS:
    """PartitionSpec of a serving weight by its name (a key of a layer dict, or embed / lm_head /
    final_norm / a stacked placeholder)."""
    if name == "embed":
        return PS(MODEL, None) if layout.shard_vocab else PS()
    if name == "lm_head":
        return PS(None, MODEL) if layout.shard_vocab else PS()
    if layout.groups == 1:
        return PS()
    return {"wqkv": PS(None, MODEL, None), "bqkv": PS(MODEL, None), "wo": PS(MODEL, None, None),
            "w_gate_up": PS(None, MODEL, None), "w_down": PS(MODEL, None)}.get(name, PS())


def cache_spec(tensor_parallel: bool) -> PS:
    """A per-layer cache buffer (the target's pages [I', X, G', H], a draft's slots [S', M, G, H]): its first axis
    over `data`, kv heads over `model` (or replicated)."""
    return PS(DATA, None, MODEL if tensor_parallel else None, None)


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where arrays go: a mesh (None: jax's default device, no sharding) and a model's layout on it.
    `panels`: the layers' matmul weights are stored as column panels (`jaxspec.models.panel_matmul`; XLA:CPU,
    float32, one device: `serving_placement` decides)."""

    mesh: Mesh | None = None
    layout: TensorParallelLayout = TensorParallelLayout()
    panels: bool = False

    def sharding(self, spec: PS) -> jax.sharding.Sharding | None:
        return None if self.mesh is None else NamedSharding(self.mesh, spec)

    def put(self, value, spec: PS) -> jax.Array:
        """`value` (numpy or a jax array) as a global array with `spec`; each process materialises only the
        shards its devices hold (works unchanged with several processes)."""
        if self.mesh is None:
            return jax.numpy.asarray(value)
        sharding = NamedSharding(self.mesh, spec)
        if isinstance(value, jax.Array) and value.sharding == sharding:
            return value  # already placed so (a draft's embedding shared with its target): no copy
        if isinstance(value, jax.Array) and not value.is_fully_addressable:  # already global: reshard it
            return jax.device_put(value, sharding)
        host = np.asarray(value)
        return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])

    def put_param(self, name: str, value) -> jax.Array | PanelWeight:
        """A serving weight by its name, placed by its `param_spec`; a layer's matmul weight as a PanelWeight
        when `panels`."""
        if self.panels and name in CONTRACTED_DIMS:
            panels, shape = pack_panels(value, CONTRACTED_DIMS[name])  # [Q, K, 64]
            return PanelWeight(self.put(panels, PS()), shape)
        return self.put(value, param_spec(name, self.layout))


def serving_placement(mesh: Mesh, layout: TensorParallelLayout, kernels: KernelPlan) -> Placement:
    """The placement of a model's serving weights on `mesh`: column panels where the kernel plan says so."""
    return Placement(mesh, layout, panels=kernels.panels)


__all__ = ["DATA", "MODEL", "Placement", "ShardingError", "TensorParallelLayout", "cache_spec",
           "padded_slots", "param_spec", "plan_layout", "replicated_layout", "serving_placement",
           "valid_model_sizes"]
