"""Output processing of one request: EOS, stop ids, stop strings across steps, max tokens, text."""

from __future__ import annotations

import pytest

from jaxspec.scheduling.output import OutputDelta, OutputProcessor
from jaxspec.scheduling.requests import FinishReason
from jaxspec.types import SamplingParams
from tests.fake_tokenizer import EOS, ascii_tokenizer

TOK = ascii_tokenizer()


def ids(text: str) -> list[int]:
    return TOK.encode(text)


def processor(max_new=20, tokenizer=TOK, **params) -> OutputProcessor:
    return OutputProcessor(SamplingParams(**params), (EOS,), max_new, tokenizer)


def test_tokens_and_text_without_a_finish():
    out = processor()
    assert out.push(ids("ab")) == OutputDelta(tuple(ids("ab")), "ab", None)
    assert out.push(ids("c")) == (tuple(ids("c")), "c", None)
    assert out.token_ids == tuple(ids("abc")) and out.text == "abc" and out.remaining == 17
    assert out.finish() == ""


def test_eos_is_kept_as_the_last_id_and_later_tokens_are_dropped():
    out = processor()
    delta = out.push([*ids("ab"), EOS, *ids("cd")])
    assert delta == OutputDelta((*ids("ab"), EOS), "ab", FinishReason.EOS)
    assert out.token_ids == (*ids("ab"), EOS) and out.finish_reason is FinishReason.EOS
    with pytest.raises(RuntimeError, match="already finished"):
        out.push(ids("x"))


def test_ignore_eos_keeps_going_and_eos_adds_no_text():
    out = processor(ignore_eos=True)
    assert out.push([*ids("a"), EOS, *ids("b")]) == ((*ids("a"), EOS, *ids("b")), "ab", None)


def test_eos_ids_are_what_the_caller_gives():
    out = OutputProcessor(SamplingParams(), eos_token_ids=ids("b"), max_new=20, tokenizer=TOK)
    assert out.push([*ids("a"), EOS, *ids("bc")]) == ((*ids("a"), EOS, *ids("b")), "a", FinishReason.EOS)


def test_stop_token_id_is_kept_and_adds_no_text():
    out = processor(stop_token_ids=tuple(ids("c")))
    assert out.push(ids("abcd")) == (tuple(ids("abc")), "ab", FinishReason.STOP)


def test_stop_string_spanning_two_steps():
    out = processor(stop_strings=("cd",))
    assert out.push(ids("abc")) == (tuple(ids("abc")), "ab", None)  # 'c' is held: it may start "cd"
    assert out.push(ids("dez")) == (tuple(ids("d")), "", FinishReason.STOP)
    assert out.text == "ab" and out.finish() == ""


def test_held_text_is_released_when_the_stop_string_cannot_complete():
    out = processor(max_new=3, stop_strings=("cd",))
    assert out.push(ids("abc")) == (tuple(ids("abc")), "ab", FinishReason.LENGTH)
    assert out.finish() == "c" and out.text == "abc"


def test_max_tokens_ends_mid_step():
    out = processor(max_new=4)
    assert out.push(ids("ab")).finish_reason is None
    assert out.push(ids("cdef")) == (tuple(ids("cd")), "cd", FinishReason.LENGTH)
    assert out.remaining == 0


def test_a_finish_on_the_last_allowed_token_is_that_finish():
    out = processor(max_new=2, stop_token_ids=tuple(ids("b")))
    assert out.push(ids("ab")).finish_reason is FinishReason.STOP


def test_without_a_tokenizer_ids_only():
    out = OutputProcessor(SamplingParams(stop_token_ids=(7,)), (EOS,), 10, None)
    assert out.push([5, 6, 7, 8]) == ((5, 6, 7), "", FinishReason.STOP)
    assert out.text is None and out.finish() == ""
    with pytest.raises(ValueError, match="need a tokenizer"):
        OutputProcessor(SamplingParams(stop_strings=("x",)), (EOS,), 10, None)
    with pytest.raises(ValueError, match="max_new"):
        OutputProcessor(SamplingParams(), (EOS,), 0, None)
