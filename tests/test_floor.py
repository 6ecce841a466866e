"""The floor reference (jaxspec/bench/floor.py): the bare chain computes what its docstring says, and the
step-vs-bare table and window growth cover every (k, W) of the menu with consistent arithmetic."""

from __future__ import annotations

import numpy as np
import pytest

from jaxspec.bench.floor import bare_chain, kv_window_mb, step_vs_bare, uses_panels, window_growth
from jaxspec.engine.engine import Engine
from jaxspec.menu import Menu
from jaxspec.models.panel_matmul import PanelWeight, unpack_panels
from jaxspec.speculation.proposers.prompt_lookup import PromptLookupProposer


@pytest.fixture(scope="module")
def engine(tiny_model):
    return Engine(tiny_model, PromptLookupProposer(), Menu(num_slots=1, max_len=64, batch_buckets=(1,),
                                                           k_menu=(0, 2), window_buckets=(32, 64),
                                                           prefill_buckets=(16,)))


def _matrix(w) -> np.ndarray:
    """A chain operand as a float64 [K, N] matrix (panels unpacked)."""
    if isinstance(w, PanelWeight):
        return np.asarray(unpack_panels(w), np.float64).reshape(w.k_len, -1)
    return np.asarray(w, np.float64)


@pytest.mark.parametrize("xla_dot", [False, True], ids=["engine-form", "xla-dot"])
def test_the_bare_chain_is_the_model_matmuls_without_norms_or_attention(engine, xla_dot):
    fn, (x, mats, head) = bare_chain(engine, 3, xla_dot)
    # the engine's weights on XLA:CPU float32 are panels; the XLA-dot chain takes plain copies
    assert uses_panels(engine) and all(isinstance(w, PanelWeight) != xla_dot for w in mats[0])
    expected = np.asarray(x, np.float64)
    c = engine.model_config
    nh, f = c.num_heads * c.head_dim, c.intermediate_size
    for wqkv, wo, w_gate_up, w_down in mats:  # the same recurrence in float64 numpy
        expected = expected + (expected @ _matrix(wqkv))[:, :nh] @ _matrix(wo)
        expected = expected + (expected @ _matrix(w_gate_up))[:, :f] @ _matrix(w_down)
    expected = expected @ (np.asarray(head).T if c.tie_embeddings else np.asarray(head))
    got = np.asarray(fn(x, mats, head))
    assert got.shape == (3, c.vocab_size)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)


def test_step_vs_bare_rows_and_window_growth(engine):
    rows = step_vs_bare(engine, repeats=2)
    assert [(r["k"], r["W"], r["T"]) for r in rows] == [(0, 32, 1), (0, 64, 1), (2, 32, 3), (2, 64, 3)]
    for r in rows:
        assert r["engine_ms"] > 0 and r["bare_ms"] > 0
        assert r["ratio"] == pytest.approx(r["engine_ms"] / r["bare_ms"])
        assert r["xla_bare_ms"] > 0  # the panel engine's rows also time XLA's dot chain
    growth = window_growth(engine, rows)
    assert [g["k"] for g in growth] == [0, 2]
    c = engine.model_config
    for g in growth:
        assert g["added_kv_mb"] == pytest.approx(2 * c.num_layers * 32 * c.num_kv_heads * c.head_dim * 4 / 1e6)
        assert g["added_kv_mb"] == pytest.approx(kv_window_mb(engine, 64) - kv_window_mb(engine, 32))
        assert g["ratio"] == pytest.approx(g["added_ms"] / (g["added_kv_mb"] / g["bandwidth_gb_s"]))
    assert engine.length(0) == 0  # the engine is reset afterwards


def test_step_trace_splits_the_step_into_the_bare_chains_matmuls_and_the_rest(tiny_model):
    """benchmarks/step_trace.py on the tiny model: every traced kernel is one of its program's HLO kernels; the
    bare chain is all weight matmuls (no attention); the step has the same weight matmuls plus attention."""
    from benchmarks.step_trace import trace_step

    result = trace_step(tiny_model, k=1, window=32, calls=3)
    engine, bare = result["engine"], result["bare"]
    assert bare["summary"]["attention"] == 0 and bare["summary"]["weight matmul"] > 0
    assert engine["summary"]["attention"] > 0 and engine["summary"]["weight matmul"] > 0
    kernel_rows = [r for r in engine["kernels"] if r["kind"] == "cache attention kernel"]  # one per layer
    assert [(r["category"], r["count"]) for r in kernel_rows] == [("attention", tiny_model.config.num_layers)]
    bare_matmuls = sorted((r["shape"], r["count"]) for r in bare["kernels"] if r["category"] == "weight matmul")
    engine_matmuls = sorted((r["shape"], r["count"]) for r in engine["kernels"] if r["category"] == "weight matmul")
    assert sum(n for _, n in engine_matmuls) == sum(n for _, n in bare_matmuls), (engine_matmuls, bare_matmuls)
