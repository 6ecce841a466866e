"""The `jaxspec` command: bad input is one line on stderr and exit code 2; a real generate run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def jaxspec(*argv: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "serving.cli", *argv], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)


@pytest.mark.parametrize("argv,message", [
    (("generate", ""), "prompt is empty"),
    (("generate", "hi", "--model", "no-such-model"), "unknown model"),
    (("generate", "hi", "--temperature", "-1"), "temperature"),
    (("generate", "hi", "--top-p", "1.5"), "top_p"),
    (("generate", "hi", "--max-tokens", "0"), "max_tokens"),
    (("generate", "hi", "--proposer", "ngram", "--policy", "fixed:x"), "fixed:K"),
    (("generate", "hi", "--policy", "goodput"), "needs a proposer"),
    (("generate", "hi", "--menu", "missing.yaml"), "does not exist"),
])
def test_bad_input_is_one_line_and_exit_2(argv, message):
    result = jaxspec(*argv)
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in result.stderr


def test_unreadable_checkpoint(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"not a gguf file")
    result = jaxspec("generate", "hi", "--model", str(bad))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert str(bad) in result.stderr


def test_models_lists_the_default():
    result = jaxspec("models")
    assert result.returncode == 0
    assert "smollm2-135m" in result.stdout


@pytest.fixture
def small_menu(tmp_path) -> str:
    path = tmp_path / "menu.yaml"
    path.write_text("num_slots: 1\nmax_len: 256\nbatch_buckets: [1]\nk_menu: [0, 2]\n"
                    "window_buckets: [256]\nprefill_buckets: [64]\n")
    return str(path)


@pytest.mark.slow
def test_generate_json_on_the_default_model(small_menu):
    plain = jaxspec("generate", "List three colours of the rainbow.", "--chat", "--max-tokens", "12",
                    "--menu", small_menu, "--json")
    assert plain.returncode == 0, plain.stderr
    out = json.loads(plain.stdout)
    assert out["text"] and len(out["token_ids"]) <= 12 and out["stats"]["completion_tokens"] == len(out["token_ids"])
    spec = jaxspec("generate", "List three colours of the rainbow.", "--chat", "--max-tokens", "12",
                   "--menu", small_menu, "--json", "--proposer", "ngram", "--policy", "fixed:2")
    assert spec.returncode == 0, spec.stderr
    spec_out = json.loads(spec.stdout)
    assert spec_out["token_ids"] == out["token_ids"]  # lossless at temperature 0
    assert all(step["k"] <= 2 for step in spec_out["stats"]["per_step"])


@pytest.mark.slow
def test_prompt_longer_than_the_context(small_menu):
    result = jaxspec("generate", "word " * 400, "--menu", small_menu)
    assert result.returncode == 2 and "context holds 256" in result.stderr and "Traceback" not in result.stderr
