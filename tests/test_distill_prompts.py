"""Training prompts of `jaxspec distill`: every user turn with its history, and prompts carried as token ids
to a machine without the data packages (--save-prompts / --prompts-file)."""

from __future__ import annotations

import argparse

import pytest

from jaxspec.serving.toy_tokenizer import byte_tokenizer
from jaxspec.training import cli as distill_cli
from jaxspec.training import distill_data as dd
from jaxspec.training.prompts import prompt_flags, training_prompts

ONE_MB = 1 << 20


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    distill_cli.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_all_turns_adds_later_user_turns_after_their_history():
    tok = byte_tokenizer()
    first = dd.chat_prompts(tok, "train", 10**6, 10**6, max_bytes=ONE_MB)
    every = dd.chat_prompts(tok, "train", 10**6, 10**6, all_turns=True, max_bytes=ONE_MB)
    assert first and len(every) > len(first)
    assert all(p in every for p in first)  # the first turns are still there, in order among the others
    later = [tok.decode(p) for p in every if p not in first]
    # a later turn's prompt holds an assistant answer before it and ends asking for the next one
    assert all(text.startswith("user: ") and "\nassistant: " in text[:-len("assistant: ")] for text in later)
    assert all(text.endswith("\nassistant: ") for text in later)


def test_the_held_out_split_and_the_length_cap_hold_for_every_turn():
    tok = byte_tokenizer()
    train = dd.chat_prompts(tok, "train", 10**6, 400, all_turns=True, max_bytes=ONE_MB)
    heldout = dd.chat_prompts(tok, "heldout", 10**6, 400, all_turns=True, max_bytes=ONE_MB)
    assert train and heldout and not set(map(tuple, train)) & set(map(tuple, heldout))
    assert max(map(len, train + heldout)) <= 400


def test_prompt_ids_round_trip_and_refuse_another_vocabulary(tmp_path):
    prompts = [[5, 6, 7], [1], [258, 3, 4, 5]]
    path = tmp_path / "prompts.npz"
    dd.save_prompt_ids(path, prompts, vocab_size=259)
    assert dd.load_prompt_ids(path, vocab_size=259) == prompts
    with pytest.raises(ValueError, match="vocabulary of 259 ids, the target has 300"):
        dd.load_prompt_ids(path, vocab_size=300)


def test_training_prompts_from_a_prompts_file(tmp_path, capsys):
    tok = byte_tokenizer()
    path = tmp_path / "prompts.npz"
    prompts = [[3 + i, 4 + i, 5 + i] for i in range(10)]
    dd.save_prompt_ids(path, prompts, tok.vocab_size)
    got = training_prompts(tok, _args("--prompts-file", str(path), "--prompts", "4", "--prompt-len", "3"))
    assert len(got) == 4 and sorted(got) == prompts[:4]  # the first 4 of the file, shuffled
    got = training_prompts(tok, _args("--prompts-file", str(path), "--prompts", "20", "--prompt-len", "3"))
    assert sorted(got) == prompts
    assert "10 training prompts of the 20 asked for" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="a prompt of 3 tokens > --prompt-len 2"):
        training_prompts(tok, _args("--prompts-file", str(path), "--prompt-len", "2"))
    with pytest.raises(SystemExit, match="--prompts-file .*: .*vocabulary"):
        dd.save_prompt_ids(path, prompts, 64)
        training_prompts(tok, _args("--prompts-file", str(path), "--prompt-len", "3"))


def test_the_recorded_recipe_names_the_prompt_flags():
    assert prompt_flags(_args()) == " --prompt-len 112 --rows 16"
    assert prompt_flags(_args("--all-turns", "--sharegpt-mb", "125", "--prompt-len", "256")) == \
        " --prompt-len 256 --rows 16 --all-turns --sharegpt-mb 125"
    assert prompt_flags(_args("--prompts-file", "p.npz")).endswith(" --prompts-file p.npz")
