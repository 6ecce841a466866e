"""The XLA:CPU kernels are optional (jaxspec/models/cpu_kernels.py): without their extension modules (an install with no
C++ compiler) the package imports, says why the kernels are missing, and the engine runs the XLA form, noting it
once on stderr."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from jaxspec.models import cpu_kernels

REPO = Path(__file__).resolve().parents[2]

# run in a fresh interpreter where importing either extension module fails, as where setup.py could not build them
WITHOUT_KERNELS = r"""
import sys
sys.modules["jaxspec.models._cache_attention"] = None  # `import` raises ImportError for these
sys.modules["jaxspec.models._panel_matmul"] = None
from tests.conftest import decode, random_prompts, reference_greedy
from jaxspec.engine.engine import Engine
from jaxspec.menu import Menu
from jaxspec.models import cache_attention, panel_matmul
from jaxspec.models.config import TINY
from jaxspec.models.llama import random_model

assert not cache_attention.kernel_available() and not panel_matmul.kernel_available()
assert "jaxspec.models._cache_attention is not built" in cache_attention.kernel_unavailable_reason()
assert "jaxspec.models._panel_matmul is not built" in panel_matmul.kernel_unavailable_reason()
model = random_model(TINY.replace(tie_embeddings=True), seed=0)
menu = Menu(num_slots=2, max_len=64, batch_buckets=(2,), k_menu=(0,), window_buckets=(64,), prefill_buckets=(16,))
engine = Engine(model, None, menu)
engine.warmup(progress=False)
assert engine.kernels.attention == "xla" and not engine.kernels.table_head and not engine.kernels.panels
prompts = random_prompts((5, 11), TINY.vocab_size, seed=1)
outputs, _ = decode(engine, prompts, 0, 6)
assert outputs == [reference_greedy(model, p, 6) for p in prompts], outputs
Engine(model, None, menu)  # a second engine: no second note
try:
    cache_attention.cache_attention(*([None] * 5))
except RuntimeError as error:
    assert "C++17 compiler" in str(error), error
else:
    raise AssertionError("cache_attention ran without its kernel")
print("ok")
"""


def test_without_the_kernels_the_engine_runs_the_xla_form_and_says_so_once():
    env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu")
    run = subprocess.run([sys.executable, "-c", WITHOUT_KERNELS], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-3000:]
    notes = [line for line in run.stderr.splitlines() if "the XLA:CPU kernels are not available" in line]
    assert len(notes) == 1, run.stderr[-3000:]
    assert "_cache_attention" in notes[0] and "_panel_matmul" in notes[0] and "install a C++17 compiler" in notes[0]


def test_the_note_names_every_missing_kernel_and_comes_once(monkeypatch, capsys):
    missing = {"_panel_matmul": "jaxspec.models._panel_matmul is not built (reason)"}
    monkeypatch.setattr(cpu_kernels, "_missing", missing)
    monkeypatch.setattr(cpu_kernels, "_noted", False)
    assert cpu_kernels.unavailable_reason("_panel_matmul") == "jaxspec.models._panel_matmul is not built (reason)"
    assert cpu_kernels.unavailable_reason("_cache_attention") is None
    cpu_kernels.note_xla_form()
    cpu_kernels.note_xla_form()
    err = capsys.readouterr().err
    assert err.count("jaxspec: the XLA:CPU kernels are not available") == 1
    assert "jaxspec.models._panel_matmul is not built (reason)" in err and cpu_kernels.HOW_TO_GET_THEM in err


def test_with_every_kernel_built_there_is_no_note(monkeypatch, capsys):
    monkeypatch.setattr(cpu_kernels, "_missing", {})
    monkeypatch.setattr(cpu_kernels, "_noted", False)
    cpu_kernels.note_xla_form()
    assert capsys.readouterr().err == ""
