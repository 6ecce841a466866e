"""The `jaxspec` command: bad input is one line on stderr and exit code 2; a real generate run."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxspec.cli import build_parser
from jaxspec.engine.args import EngineArgs

ROOT = Path(__file__).resolve().parent.parent


def jaxspec(*argv: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "jaxspec.cli", *argv], capture_output=True, text=True,
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
    (("generate", "hi", "--mesh", "data=0"), "mesh axis data must be a positive integer"),
    (("generate", "hi", "--mesh", "tensor=2"), "expected data=D,model=M"),
    (("generate", "hi", "--model", "tiny", "--tokenizer", "ascii", "--menu", "tiny", "--mesh", "model=3"),
     "valid model sizes: 1, 2, 4"),
    (("generate", "hi", "--model", "tiny", "--tokenizer", "ascii", "--menu", "tiny", "--mesh", "data=4,model=4"),
     "needs 16 devices"),
    (("generate", "hi", "--proposer", "ngram", "--tree", "4:9"), "1 <= depth <= nodes"),
    (("generate", "hi", "--proposer", "ngram", "--tree", "x"), "expected N or N:D"),
    (("generate", "hi", "--tree", "4"), "--tree needs --proposer ngram, draft or suffix"),
    (("generate", "hi", "--proposer", "draft", "--draft", "feature", "--tree", "4"),
     "feature draft is not implemented"),
    (("generate", "hi", "--proposer", "ngram", "--tree", "4", "--policy", "goodput-per-request"),
     "goodput-per-request"),
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
    assert result.returncode == 2 and "max_len 256" in result.stderr and "Traceback" not in result.stderr


def test_generate_on_the_tiny_preset_with_a_toy_tokenizer():
    """Nothing to download: random weights, the ascii tokenizer, the tiny menu."""
    result = jaxspec("generate", "hi", "--model", "tiny", "--tokenizer", "ascii", "--menu", "tiny", "--max-tokens", "5",
                     "--json")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["stats"]["model"] == "tiny" and 1 <= len(out["token_ids"]) <= 5
    missing = jaxspec("generate", "hi", "--model", "tiny", "--menu", "tiny")
    assert missing.returncode == 2 and "--tokenizer ascii" in missing.stderr


# --- the engine flags: one declaration for every command -------------------------------------------


def _actions(command: str) -> dict[str, argparse.Action]:
    """The flags of `jaxspec COMMAND`, by destination."""
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {a.dest: a for a in sub.choices[command]._actions}


@pytest.mark.parametrize("command", ["generate", "batch", "serve", "profile", "bench"])
def test_engine_flags_are_generated_from_engine_args(command):
    actions = _actions(command)
    fields = {f.name: f for f in dataclasses.fields(EngineArgs)}
    shared = sorted(set(actions) & set(fields))
    assert {"model", "draft"} <= set(shared)
    for name in shared:  # each flag's help text is its field's
        assert actions[name].help.startswith(fields[name].metadata["help"]), (command, name)
    assert ("policy" in actions) == (command in ("generate", "batch", "serve"))


def test_engine_args_from_flags():
    parser = argparse.ArgumentParser()
    EngineArgs.add_arguments(parser, default_menu="generate")
    flags = ["--proposer", "ngram", "--ngram", "2,4", "--policy", "fixed:2"]
    args = EngineArgs.from_namespace(parser.parse_args(flags))
    assert args == EngineArgs(proposer="ngram", ngram=(2, 4), policy="fixed:2", menu="generate")
    assert str(args.policy_spec()) == "fixed:2"
    assert EngineArgs(proposer="draft").policy_spec().name == "goodput"  # the default with a proposer
    with pytest.raises(SystemExit):
        parser.parse_args(["--ngram", "3,1"])
    overrides = argparse.ArgumentParser()
    EngineArgs.add_arguments(overrides, only=("model", "menu"), overrides=True)
    assert EngineArgs.given(overrides.parse_args(["--menu", "tiny"]), ("model", "menu")) == {"menu": "tiny"}
    for bad, message in ((dict(policy="goodput"), "needs a proposer"), (dict(proposer="beam"), "unknown proposer"),
                         (dict(tokenizer="sentencepiece"), "unknown tokenizer"), (dict(ngram=(0, 2)), "ngram")):
        with pytest.raises(ValueError, match=message):
            EngineArgs(**bad)


def test_generate_on_a_mesh_prints_the_same_tokens(tmp_path):
    """--mesh data=2,model=2 (8 forced host devices, tests/conftest.py) and the engine config's `mesh:` key
    give the single-device tokens; --mesh overrides the config."""
    base = ("generate", "hello mesh", "--model", "tiny", "--tokenizer", "ascii", "--menu", "tiny", "--max-tokens",
            "12", "--json")
    single = jaxspec(*base)
    sharded = jaxspec(*base, "--mesh", "data=2,model=2")
    assert single.returncode == 0 and sharded.returncode == 0, single.stderr + sharded.stderr
    assert json.loads(sharded.stdout)["token_ids"] == json.loads(single.stdout)["token_ids"]
    assert "mesh data=2,model=2: 4 cpu devices" in sharded.stderr
    from jaxspec.engine.build import load_menu, load_mesh

    config = tmp_path / "menu.yaml"
    config.write_text("num_slots: 8\nmax_len: 128\nbatch_buckets: [1]\nk_menu: [0]\nwindow_buckets: [128]\n"
                      "prefill_buckets: [32]\nmesh: {data: 1, model: 2}\n")
    assert str(load_mesh(str(config))) == "data=1,model=2" and load_menu(str(config)).num_slots == 8
    assert str(EngineArgs(menu=str(config), mesh="model=4").mesh_spec()) == "data=1,model=4"
    from_config = jaxspec(*base[:7], str(config), *base[8:])
    assert from_config.returncode == 0, from_config.stderr
    assert json.loads(from_config.stdout)["token_ids"] == json.loads(single.stdout)["token_ids"]
    assert "mesh data=1,model=2: 2 cpu devices" in from_config.stderr


def test_generate_with_a_tree_under_goodput_marks_the_tree_steps(tmp_path, monkeypatch):
    """Under goodput, the steps at the tree's k run the tree and are marked with it; the others are chains.

    The cost profile is written here, so whether the tree is tried does not hang on this machine's timings:
    the tree's k costs a quarter of the chains' 1 ms, so the first step (no online evidence yet, the untried
    tree priced at depth + 1 tokens, the chains at k + 1) runs the tree."""
    from jaxspec.engine.profiler import device_kind
    from jaxspec.policy.cost_model import CostEntry, CostProfile, ProfileKey

    profiles = tmp_path / "profiles"
    monkeypatch.setenv("JAXSPEC_PROFILE_DIR", str(profiles))
    menu = tmp_path / "menu.yaml"  # a lean menu: one batch bucket, k in {0, 2, 4}, the tree at 4
    menu.write_text("num_slots: 1\nmax_len: 128\nbatch_buckets: [1]\nk_menu: [0, 2, 4]\nwindow_buckets: [128]\n"
                    "prefill_buckets: [32]\n")
    key = ProfileKey(device_kind=device_kind(), model="tiny", draft="ngram+tree4:2", batch_buckets=(1,),
                     k_menu=(0, 2, 4), window_buckets=(128,), attention="cpu-cache-kernel")
    entries = tuple(CostEntry(1, k, 128, 2.5e-4 if k == 4 else 1e-3, samples=5) for k in (0, 2, 4))
    CostProfile(key, entries).save(profiles / key.filename())
    result = jaxspec("generate", "abcabcabcabcabcab", "--model", "tiny", "--tokenizer", "ascii", "--menu", str(menu),
                     "--proposer", "ngram", "--tree", "4:2", "--max-tokens", "24", "--json")
    assert result.returncode == 0, result.stderr
    assert "profiling once" not in result.stderr  # the profile above was the one used
    stats = json.loads(result.stdout)["stats"]
    assert stats["policy"] == "goodput" and stats["completion_tokens"] == 24
    assert all(("tree" in step) == (step["k"] == 4) for step in stats["per_step"])
    assert stats["per_step"][0]["tree"] == "4:2"  # the tree was tried
