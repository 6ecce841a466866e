"""Toy tokenizers for random-weight presets (`jaxspec serve --model tiny --tokenizer ascii`).

A preset such as `tiny` has no tokenizer of its own; these give it one without any file, with the
method names of jaxspec.models.loading.tokenizer.TextTokenizer that serving uses (encode, decode,
token_bytes, eos_token_ids, special_token_ids, apply_chat_template). Ids 0 (pad), 1 (eos) and
2 (unk) are special; a character with no piece encodes as unk.

    ascii   64 ids: the specials, then one id per character of ASCII_ALPHABET (fits vocab 64)
    bytes  259 ids: the specials, then id = byte value + 3 (any UTF-8 text round-trips)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

PAD, EOS, UNK = 0, 1, 2
ASCII_ALPHABET = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ .,:\n!?-'"  # 61 characters


class ToyTokenizer:
    """Token id -> a fixed byte string; `encode` is a greedy longest match over those pieces."""

    def __init__(self, name: str, pieces: Sequence[bytes]):
        self.name = name
        self.pieces = [b"<pad>", b"<eos>", b"<unk>", *pieces]
        self.eos_token_ids: tuple[int, ...] = (EOS,)
        self.bos_token_id = None
        self.special_token_ids = frozenset((PAD, EOS, UNK))
        self._lookup = {p: i for i, p in enumerate(self.pieces) if i not in self.special_token_ids}
        self._longest = max(len(p) for p in pieces)

    @property
    def vocab_size(self) -> int:
        return len(self.pieces)

    def token_bytes(self, token_id: int) -> bytes:
        return self.pieces[token_id]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        data, ids, i = text.encode("utf-8"), [], 0
        while i < len(data):
            for n in range(min(self._longest, len(data) - i), 0, -1):
                if data[i:i + n] in self._lookup:
                    ids.append(self._lookup[data[i:i + n]])
                    i += n
                    break
            else:
                ids.append(UNK)
                i += 1
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        skip = self.special_token_ids if skip_special_tokens else frozenset()
        return b"".join(self.pieces[i] for i in ids if i not in skip).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        """`role: content` lines, then `assistant: ` when a generation prompt is asked for."""
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        return text + ("assistant: " if add_generation_prompt else "")


def ascii_tokenizer() -> ToyTokenizer:
    return ToyTokenizer("ascii", [c.encode() for c in ASCII_ALPHABET])


def byte_tokenizer() -> ToyTokenizer:
    return ToyTokenizer("bytes", [bytes([b]) for b in range(256)])


TOY_TOKENIZERS = {"ascii": ascii_tokenizer, "bytes": byte_tokenizer}
