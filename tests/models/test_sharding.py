"""The shardings of the real configs (docs/design.md, "Sharding"), read without allocating a weight:
global shapes from `jax.eval_shape` (`jaxspec.models.llama.serving_shapes`), per-device shapes from each
array's `NamedSharding.shard_shape`, on meshes of the 8 forced host devices (tests/conftest.py)."""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding

from jaxspec.mesh import MeshSpec, make_mesh
from jaxspec.models.config import QWEN25_15B, SMOLLM2_135M, ModelConfig
from jaxspec.models.llama import serving_shapes
from jaxspec.models.sharding import (
    ShardingError,
    TensorParallelLayout,
    cache_spec,
    padded_slots,
    param_spec,
    plan_layout,
    valid_model_sizes,
)

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices (tests/conftest.py forces 8 on CPU)")

SLOTS, MAX_LEN = 16, 2048  # the default menu's cache


def _per_device(config: ModelConfig, spec: MeshSpec) -> dict[str, tuple[tuple[int, ...], tuple[int, ...], int]]:
    """name -> (global shape, per-device shape, itemsize) of every serving weight and of one cache buffer."""
    mesh, layout = make_mesh(spec), plan_layout(config, spec.model)
    out = {}
    for name, shape in serving_shapes(config, layout).items():
        sharding = NamedSharding(mesh, param_spec(name, layout))
        out[name] = (shape.shape, sharding.shard_shape(shape.shape), shape.dtype.itemsize)
    cache = (padded_slots(SLOTS, spec.data), MAX_LEN, layout.kv_heads_for(config), config.head_dim)
    sharding = NamedSharding(mesh, cache_spec(tensor_parallel=spec.model > 1))
    out["cache"] = (cache, sharding.shard_shape(cache), np.dtype(config.dtype).itemsize)
    return out


def _bytes(entries, which: int, names) -> int:
    return sum(math.prod(entries[n][which]) * entries[n][2] for n in names)


LAYER = ("wqkv", "wo", "w_gate_up", "w_down")


@pytest.mark.parametrize("mesh", [MeshSpec(1, 2), MeshSpec(2, 4)], ids=str)
def test_qwen2_5_1_5b_shardings_and_bytes_per_device(mesh):
    c = QWEN25_15B.replace(dtype="bfloat16")
    m = mesh.model
    got = _per_device(c, mesh)
    group = (c.num_heads + 2 * max(c.num_kv_heads, m)) * c.head_dim // m  # kv heads repeated to M=4
    assert got["wqkv"][1] == (c.hidden_size, 1, group)
    assert got["bqkv"][1] == (1, group)
    assert got["wo"][1] == (c.num_heads // m, c.head_dim, c.hidden_size)
    assert got["w_gate_up"][1] == (c.hidden_size, 1, 2 * c.intermediate_size // m)
    assert got["w_down"][1] == (c.intermediate_size // m, c.hidden_size)
    assert got["embed"][1] == (c.vocab_size // m, c.hidden_size)
    assert got["attn_norm"][1] == got["attn_norm"][0]  # norms replicated
    kv_per_device = max(c.num_kv_heads, m) // m
    assert got["cache"][1] == (padded_slots(SLOTS, mesh.data) // mesh.data, MAX_LEN, kv_per_device, c.head_dim)
    # the big weights shrink by exactly M per device; the cache by D x (G / kv heads per device)
    assert _bytes(got, 1, LAYER + ("embed",)) * m == _bytes(got, 0, LAYER + ("embed",))
    unsharded_cache = (SLOTS + 1) * MAX_LEN * c.num_kv_heads * c.head_dim * 2
    assert _bytes(got, 1, ("cache",)) <= unsharded_cache / mesh.data / (c.num_kv_heads // kv_per_device) * 1.07


def test_qwen_model_4_repeats_its_two_kv_heads():
    layout = plan_layout(QWEN25_15B, 4)
    assert layout.kv_heads == 4 and any("2 kv heads repeated to 4" in n for n in layout.notes)
    assert valid_model_sizes(QWEN25_15B, up_to=8) == [1, 2, 4]


@pytest.mark.parametrize("mesh", [MeshSpec(1, 3), MeshSpec(2, 3)], ids=str)
def test_smollm2_shardings_and_bytes_per_device(mesh):
    c = SMOLLM2_135M
    got = _per_device(c, mesh)
    assert got["wqkv"][1] == (c.hidden_size, 1, (3 + 2 * 1) * c.head_dim)  # 3 query heads, 1 kv head each
    assert got["wo"][1] == (3, c.head_dim, c.hidden_size)
    assert got["w_down"][1] == (c.intermediate_size // 3, c.hidden_size)
    assert got["embed"][1] == (c.vocab_size // 3, c.hidden_size)
    assert got["cache"][1] == (padded_slots(SLOTS, mesh.data) // mesh.data, MAX_LEN, 1, c.head_dim)
    assert _bytes(got, 1, LAYER + ("embed",)) * 3 == _bytes(got, 0, LAYER + ("embed",))


@pytest.mark.parametrize("mesh", [MeshSpec(1, 2), MeshSpec(2, 4)], ids=str)
def test_smollm2_refuses_model_sizes_its_heads_do_not_divide(mesh):
    """9 query heads and 3 kv heads: the issue's (1, 2) and (2, 4) meshes are refused, naming 1 and 3."""
    with pytest.raises(ShardingError, match=r"9 query heads.*valid model sizes: 1, 3$"):
        plan_layout(SMOLLM2_135M, mesh.model)


def test_a_vocabulary_that_does_not_divide_is_replicated():
    config = SMOLLM2_135M.replace(vocab_size=49153)
    layout = plan_layout(config, 3)
    assert not layout.shard_vocab and any("replicated" in n for n in layout.notes)
    assert param_spec("embed", layout) == param_spec("final_norm", layout)  # PartitionSpec(): replicated


def test_one_device_is_the_plain_layout():
    assert plan_layout(SMOLLM2_135M, 1) == TensorParallelLayout(groups=1)
