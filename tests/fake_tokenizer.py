"""Hand-checkable tokenizers for scheduler, detokenizer and batch-job tests.

Same method names as models.loading.tokenizer.TextTokenizer (encode, decode, token_bytes,
eos_token_ids, special_token_ids, apply_chat_template). Ids 0 (pad), 1 (eos), 2 (unk) are special.
"""

from __future__ import annotations

from typing import Any, Sequence

PAD, EOS, UNK = 0, 1, 2
SPECIAL = (PAD, EOS, UNK)
ASCII_ALPHABET = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ .,:\n!?-'"  # 61 chars: ids 3..63


class FakeTokenizer:
    """Token id -> a fixed byte string; encode is a greedy longest match over those pieces."""

    def __init__(self, pieces: Sequence[bytes]):
        self.pieces = [b"<pad>", b"<eos>", b"<unk>", *pieces]
        self.eos_token_ids: tuple[int, ...] = (EOS,)
        self.bos_token_id = None
        self.special_token_ids = frozenset(SPECIAL)
        self._lookup = {p: i for i, p in enumerate(self.pieces) if i not in SPECIAL}
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

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs) -> str:
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        return text + ("assistant: " if add_generation_prompt else "")


def ascii_tokenizer() -> FakeTokenizer:
    """64 ids: specials then one printable ASCII character each (fits the TINY model's vocab)."""
    return FakeTokenizer([c.encode() for c in ASCII_ALPHABET])


def byte_tokenizer() -> FakeTokenizer:
    """259 ids: token id = byte value + 3 (every UTF-8 character of 2+ bytes spans tokens)."""
    return FakeTokenizer([bytes([b]) for b in range(256)])


def multibyte_tokenizer() -> FakeTokenizer:
    """64 ids whose pieces are 1-3 byte slices of multi-byte UTF-8 text, cut across characters."""
    data = "é€😀ñ中文ü→ab".encode("utf-8")
    pieces = []
    for i in range(61):
        start, size = (i * 2) % len(data), 1 + i % 3
        pieces.append(data[start:start + size] or data[:1])
    return FakeTokenizer(pieces)
