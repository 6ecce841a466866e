"""The panel and table matmul kernels (jaxspec/models/panel_matmul.py,
jaxspec/models/csrc/panel_matmul.cc): the products they
compute, rows independent to the bit, the packing, their errors, and the serving layers and LM head that use
them."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.models.config import TINY, TINY_QWEN
from jaxspec.models.kernel_plan import XLA_PLAN, KernelPlan, resolve_kernel_plan
from jaxspec.models.llama import random_model, serving_split
from jaxspec.models.panel_matmul import (
    PANEL,
    TABLE_TARGET,
    TARGET,
    PanelWeight,
    dense,
    pack_panels,
    panel_matmul,
    table_matmul,
    unpack_panels,
)
from jaxspec.models.sharding import Placement
from tests.conftest import needs_cpu_kernels

pytestmark = needs_cpu_kernels  # every test here runs the compiled kernels

# (K, N): whole panels, a last panel partly padding, a single narrow panel, a weight large enough to be split
# over threads (≥ 1 MB), and a long contraction
SHAPES = [(64, 128), (100, 70), (8, 3), (576, 960), (1536, 576)]
ROWS = [1, 2, 6, 7, 9, 13, 40]  # one group, a full group, groups of unequal sizes


def _weight(k_len: int, n_len: int, seed: int = 0) -> PanelWeight:
    w = np.random.default_rng(seed).standard_normal((k_len, n_len)).astype(np.float32)
    return PanelWeight(jnp.asarray(pack_panels(w)[0]), (k_len, n_len))


@pytest.mark.parametrize("k_len,n_len", SHAPES)
def test_the_product_matches_float64(k_len, n_len):
    weight = _weight(k_len, n_len)
    w = np.asarray(unpack_panels(weight), np.float64)  # [K, N]
    product = jax.jit(panel_matmul)
    for m_rows in ROWS:
        x = np.random.default_rng(m_rows).standard_normal((m_rows, k_len)).astype(np.float32)
        got = np.asarray(product(jnp.asarray(x), weight))  # [M, N]
        expected = x.astype(np.float64) @ w
        assert got.shape == (m_rows, n_len)
        np.testing.assert_allclose(got, expected, rtol=0, atol=2e-6 * np.sqrt(k_len) * np.abs(expected).max())


@pytest.mark.parametrize("k_len,n_len", [(100, 70), (576, 960)])
def test_each_row_is_the_same_bits_whatever_the_other_rows(k_len, n_len):
    """A verify step's rows and a plain step's single row give bitwise equal products: each output is summed
    in one order whatever M, the row's group or the thread split."""
    weight = _weight(k_len, n_len, seed=1)
    product = jax.jit(panel_matmul)
    x = np.random.default_rng(2).standard_normal((40, k_len)).astype(np.float32)
    alone = np.stack([np.asarray(product(jnp.asarray(x[m:m + 1]), weight))[0] for m in range(40)])  # [40, N]
    for m_rows in ROWS:
        np.testing.assert_array_equal(np.asarray(product(jnp.asarray(x[:m_rows]), weight)), alone[:m_rows])
    other = x.copy()
    other[1:] = np.random.default_rng(3).standard_normal((39, k_len))
    np.testing.assert_array_equal(np.asarray(product(jnp.asarray(other), weight))[0], alone[0])


def test_packing_flattens_the_contracted_dims_and_round_trips():
    wo = np.random.default_rng(4).standard_normal((3, 8, 20)).astype(np.float32)  # [N, H, D]: (N, H) contracted
    panels, shape = pack_panels(wo, contracted_dims=2)
    assert panels.shape == (1, 24, PANEL) and shape == (24, 20)
    assert not panels[:, :, 20:].any()  # columns past N are zero
    weight = PanelWeight(jnp.asarray(panels), shape)
    np.testing.assert_array_equal(np.asarray(unpack_panels(weight)), wo.reshape(24, 20))
    wqkv = np.random.default_rng(5).standard_normal((16, 1, 96)).astype(np.float32)  # [D, P, E/P]
    panels, shape = pack_panels(wqkv)
    assert panels.shape == (2, 16, PANEL) and shape == (16, 1, 96)
    x = np.random.default_rng(6).standard_normal((2, 3, 16)).astype(np.float32)  # [B, T, D]
    got = np.asarray(dense(jnp.asarray(x), PanelWeight(jnp.asarray(panels), shape), "BTD,DPE->BTPE"))
    np.testing.assert_allclose(got, np.einsum("BTD,DPE->BTPE", x, wqkv), rtol=1e-5, atol=1e-5)


def test_bad_shapes_are_refused():
    weight = _weight(32, 70)
    with pytest.raises(ValueError, match="x has 31 columns, the weight 32 rows"):
        panel_matmul(jnp.ones((2, 31), jnp.float32), weight)
    wrong_n = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((2, 130), jnp.float32))  # 2 panels hold ≤ 128
    with pytest.raises(Exception, match="do not agree"):
        jax.block_until_ready(wrong_n(jnp.ones((2, 32), jnp.float32), weight.panels))


def test_panels_only_on_xla_cpu_float32_one_device():
    def plan(backend="cpu", dtype="float32", mesh_size=1, choice="auto"):
        return resolve_kernel_plan(TINY, backend, dtype, mesh_size, TINY.num_kv_heads, False, choice)

    assert plan().panels
    assert not plan(dtype="bfloat16").panels
    assert not plan(mesh_size=2).panels
    assert not plan(backend="gpu").panels
    assert not plan(choice="xla").panels


@pytest.mark.parametrize("config", [TINY, TINY_QWEN], ids=["llama", "qwen-bias"])
def test_serving_layers_on_panels_compute_what_xla_layers_do(config):
    model = random_model(config.replace(name=f"panels-{config.name}"), seed=7)
    _, (_, panel_layers) = serving_split(model, Placement(panels=True))
    _, (_, xla_layers) = serving_split(model, Placement())
    assert all(isinstance(panel_layers[0][name], PanelWeight) for name in ("wqkv", "wo", "w_gate_up", "w_down"))
    assert not any(isinstance(w, PanelWeight) for w in xla_layers[0].values())
    tokens = np.arange(10, dtype=np.int32)[None, :] % config.vocab_size  # [1, 10]
    got = np.asarray(jax.jit(lambda t, layers: model(t, layers))(tokens, panel_layers))  # [1, 10, V]
    ref = np.asarray(jax.jit(lambda t, layers: model(t, layers))(tokens, xla_layers))
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-5 * np.abs(ref).max())


# (V, D) of the table: whole blocks of 64 rows and D a multiple of 64, a last block partly filled and a D tail
# past the last 64, a tiny table, and one large enough to be split over threads
TABLES = [(128, 64), (100, 70), (3, 8), (4096, 576)]


@pytest.mark.parametrize("v_len,d_len", TABLES)
def test_the_table_product_matches_float64(v_len, d_len):
    table = np.random.default_rng(8).standard_normal((v_len, d_len)).astype(np.float32)  # [V, D]
    product = jax.jit(table_matmul)
    for m_rows in ROWS:
        x = np.random.default_rng(m_rows).standard_normal((m_rows, d_len)).astype(np.float32)  # [M, D]
        got = np.asarray(product(jnp.asarray(x), jnp.asarray(table)))  # [M, V]
        expected = x.astype(np.float64) @ table.astype(np.float64).T
        assert got.shape == (m_rows, v_len)
        np.testing.assert_allclose(got, expected, rtol=0, atol=2e-6 * np.sqrt(d_len) * np.abs(expected).max())


@pytest.mark.parametrize("v_len,d_len", [(100, 70), (4096, 576)])
def test_each_table_row_is_the_same_bits_whatever_the_other_rows(v_len, d_len):
    """Logits of a plain step's single row and of a verify step's rows are bitwise equal for equal hidden states."""
    table = jnp.asarray(np.random.default_rng(9).standard_normal((v_len, d_len)).astype(np.float32))
    product = jax.jit(table_matmul)
    x = np.random.default_rng(10).standard_normal((40, d_len)).astype(np.float32)
    alone = np.stack([np.asarray(product(jnp.asarray(x[m:m + 1]), table))[0] for m in range(40)])  # [40, V]
    for m_rows in ROWS:
        np.testing.assert_array_equal(np.asarray(product(jnp.asarray(x[:m_rows]), table)), alone[:m_rows])


def test_bad_table_shapes_are_refused():
    with pytest.raises(ValueError, match="do not agree"):
        table_matmul(jnp.ones((2, 31), jnp.float32), jnp.ones((10, 32), jnp.float32))
    with pytest.raises(ValueError, match="float32 table"):
        table_matmul(jnp.ones((2, 32), jnp.float32), jnp.ones((10, 32), jnp.bfloat16))
    wrong_v = jax.ffi.ffi_call(TABLE_TARGET, jax.ShapeDtypeStruct((2, 11), jnp.float32))
    with pytest.raises(Exception, match="do not agree"):
        jax.block_until_ready(wrong_v(jnp.ones((2, 32), jnp.float32), jnp.ones((10, 32), jnp.float32)))


def test_the_table_head_computes_the_xla_head():
    model = random_model(TINY.replace(name="table-head", tie_embeddings=True), seed=11)
    assert model.config.tie_embeddings
    hidden = jnp.asarray(np.random.default_rng(12).standard_normal((2, 3, TINY.hidden_size)).astype(np.float32))
    got = np.asarray(jax.jit(lambda h: model.unembed(h, KernelPlan(lm_head="cpu-table")))(hidden))  # [2, 3, V]
    ref = np.asarray(jax.jit(lambda h: model.unembed(h, XLA_PLAN))(hidden))
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-5 * np.abs(ref).max())


def test_the_table_head_needs_a_tied_embedding():
    model = random_model(TINY.replace(name="untied-head", tie_embeddings=False), seed=13)
    with pytest.raises(ValueError, match="needs a tied embedding"):
        model.unembed(jnp.ones((1, 1, TINY.hidden_size), jnp.float32), KernelPlan(lm_head="cpu-table"))



def test_a_random_sweep_of_shapes_matches_float64():
    """Random (seeded) M ≤ 64 rows, K and N / D and V of no particular multiple, both kernels against float64."""
    rng = np.random.default_rng(14)
    for _ in range(8):
        m_rows, k_len, n_len = (int(rng.integers(1, hi)) for hi in (65, 300, 300))
        x = rng.standard_normal((m_rows, k_len)).astype(np.float32)  # [M, K]
        w = rng.standard_normal((k_len, n_len)).astype(np.float32)  # [K, N]
        expected = x.astype(np.float64) @ w.astype(np.float64)  # [M, N]
        tolerance = 2e-6 * np.sqrt(k_len) * np.abs(expected).max()
        got = np.asarray(jax.jit(panel_matmul)(jnp.asarray(x), PanelWeight(jnp.asarray(pack_panels(w)[0]), w.shape)))
        np.testing.assert_allclose(got, expected, rtol=0, atol=tolerance, err_msg=f"panels {x.shape, w.shape}")
        got = np.asarray(jax.jit(table_matmul)(jnp.asarray(x), jnp.asarray(np.ascontiguousarray(w.T))))  # table [N, K]
        np.testing.assert_allclose(got, expected, rtol=0, atol=tolerance, err_msg=f"table {x.shape, w.shape}")
