"""Incremental detokenisation: UTF-8 safety, special tokens, stop strings spanning pushes."""

import random

import pytest

from jaxspec.scheduling.detokenizer import IncrementalDetokenizer, StopAfterFinishError
from tests.fake_tokenizer import EOS, ascii_tokenizer, byte_tokenizer, multibyte_tokenizer

BYTES = byte_tokenizer()


def ids_of(text: str) -> list[int]:
    return BYTES.encode(text)


def stream(det: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    pieces = [det.push(i) for i in ids]
    return pieces + [det.finish()]


def push_until_stop(det: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    pieces = []
    for i in ids:
        pieces.append(det.push(i))
        if det.stopped:
            break
    return pieces


def test_multibyte_characters_are_never_split():
    text = "aé€😀z"
    det = IncrementalDetokenizer(BYTES)
    pieces = stream(det, ids_of(text))
    # 'é' is 2 bytes, '€' 3, '😀' 4: nothing is released until a character is complete
    assert pieces == ["a", "", "é", "", "", "€", "", "", "", "😀", "z", ""]
    assert "".join(pieces) == det.text == text
    assert "\ufffd" not in "".join(pieces)


def test_random_streams_match_whole_decode():
    tok = multibyte_tokenizer()
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(3, tok.vocab_size) for _ in range(rng.randrange(1, 30))]
        det = IncrementalDetokenizer(tok)
        assert "".join(stream(det, ids)) == tok.decode(ids)


def test_incomplete_character_at_end_becomes_replacement():
    det = IncrementalDetokenizer(BYTES)
    assert det.push(ids_of("a")[0]) == "a"
    assert det.push(0xE2 + 3) == ""  # first byte of a 3-byte character
    assert det.finish() == "\ufffd"


def test_special_tokens_are_skipped():
    det = IncrementalDetokenizer(BYTES)
    assert "".join(stream(det, [*ids_of("ab"), EOS, *ids_of("c")])) == "abc"


def test_stop_string_spanning_pushes_cuts_text_before_it():
    det = IncrementalDetokenizer(BYTES, stop_strings=("STOP",))
    released = push_until_stop(det, ids_of("hello STOP world"))
    assert "".join(released) == det.text == "hello "
    assert det.stop_string == "STOP"
    with pytest.raises(StopAfterFinishError):
        det.push(ids_of("x")[0])


def test_partial_stop_prefix_is_held_then_released():
    det = IncrementalDetokenizer(BYTES, stop_strings=("abc",))
    assert [det.push(i) for i in ids_of("xab")] == ["x", "", ""]
    assert det.push(ids_of("d")[0]) == "abd"  # 'ab' can no longer start 'abc'
    assert [det.push(i) for i in ids_of("ab")] == ["", ""]
    assert det.finish() == "ab"  # end of stream: the held tail is final text
    assert det.text == "xabdab" and not det.stopped


def test_earliest_stop_string_wins_and_overlapping_prefixes():
    det = IncrementalDetokenizer(BYTES, stop_strings=("lo w", "ell", "aab"))
    out = "".join(push_until_stop(det, ids_of("aaaheLLo hello world")))
    assert out == det.text == "aaaheLLo h" and det.stop_string == "ell"


def test_stop_string_over_multibyte_characters():
    det = IncrementalDetokenizer(BYTES, stop_strings=("€😀",))
    out = "".join(push_until_stop(det, ids_of("é€€😀tail")))
    assert out == "é€" and det.stopped


def test_stop_string_inside_one_token():
    tok = ascii_tokenizer()
    det = IncrementalDetokenizer(tok, stop_strings=("\n",))
    assert push_until_stop(det, tok.encode("ab\ncd")) == ["a", "b", ""]
    assert det.text == "ab"


def test_empty_stop_string_is_rejected():
    with pytest.raises(ValueError, match="non-empty"):
        IncrementalDetokenizer(BYTES, stop_strings=("",))
