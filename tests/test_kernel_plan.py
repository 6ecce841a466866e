"""The kernel plan (jaxspec/models/kernel_plan.py; docs/design.md, "The kernel plan"): chosen from the flag, the
environment or 'auto'; resolved per backend; carried by `--json` stats; `auto` and `xla` decode the same."""

from __future__ import annotations

import json

import pytest

from jaxspec.engine.args import EngineArgs
from jaxspec.models.config import SMOLLM2_135M, TINY
from jaxspec.models.kernel_plan import KERNELS_ENV, KernelPlan, kernel_choice, resolve_kernel_plan
from tests.conftest import needs_cpu_kernels
from tests.test_cli import jaxspec


def test_the_choice_comes_from_the_flag_then_the_environment_then_auto(monkeypatch):
    monkeypatch.delenv(KERNELS_ENV, raising=False)
    assert kernel_choice(None) == "auto" and kernel_choice("xla") == "xla"
    monkeypatch.setenv(KERNELS_ENV, "xla")
    assert kernel_choice(None) == "xla" and kernel_choice("auto") == "auto"
    monkeypatch.setenv(KERNELS_ENV, "fast")
    with pytest.raises(ValueError, match=r"\$JAXSPEC_KERNELS must be one of auto, xla, got 'fast'"):
        kernel_choice(None)
    with pytest.raises(ValueError, match="--kernels must be one of auto, xla"):
        EngineArgs(kernels="pallas")


def test_the_plan_per_backend():
    def plan(backend, dtype="float32", **changes):
        return resolve_kernel_plan(TINY, backend, dtype, **{"mesh_size": 1, "cache_kv_heads": TINY.num_kv_heads,
                                                            "tensor_parallel": False, **changes})

    assert plan("cpu", choice="xla") == KernelPlan(xla_block_diagonal=True, notes=("--kernels xla",))
    assert plan("tpu").attention == "xla" and plan("tpu").matmul == "xla" and "tpu" in plan("tpu").notes[0]
    assert plan("cpu", tensor_parallel=True).xla_block_diagonal is False  # split kv heads: the grouped einsum
    assert plan("gpu").attention == "xla" and "head_dim 8" in plan("gpu").notes[0]  # TINY's heads are too small


@needs_cpu_kernels
def test_the_default_model_on_cpu_takes_every_cpu_kernel():
    plan = resolve_kernel_plan(SMOLLM2_135M, "cpu", "float32", 1, SMOLLM2_135M.num_kv_heads, False)
    assert (plan.attention, plan.matmul, plan.lm_head, plan.notes) == ("cpu-cache-kernel", "cpu-panels",
                                                                        "cpu-table", ())
    assert plan.to_json()["attention_max_rows"] == 64 and "attention=cpu-cache-kernel" in plan.describe()


@pytest.mark.slow
def test_auto_and_xla_give_the_same_greedy_tokens_on_the_default_model():
    runs = {}
    for choice in ("auto", "xla"):
        result = jaxspec("generate", "--chat", "What is the capital of France?", "--max-tokens", "24", "--json",
                         "--kernels", choice, timeout=900)
        assert result.returncode == 0, result.stderr[-2000:]
        runs[choice] = json.loads(result.stdout)
        assert f"kernels: attention={'cpu-cache-kernel' if choice == 'auto' else 'xla'}" in result.stderr
    assert runs["auto"]["token_ids"] == runs["xla"]["token_ids"]
    assert runs["auto"]["stats"]["kernels"]["matmul"] != runs["xla"]["stats"]["kernels"]["matmul"]
    assert "Paris" in runs["auto"]["text"]
