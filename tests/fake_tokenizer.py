"""Hand-checkable tokenizers for scheduler, detokenizer and batch-job tests.

The ascii / byte tokenizers are serving's toy tokenizers (jaxspec/serving/toy_tokenizer.py); this adds
one whose pieces cut multi-byte UTF-8 characters apart, for streaming tests.
"""

from __future__ import annotations

from jaxspec.serving.toy_tokenizer import ASCII_ALPHABET, EOS, PAD, UNK, ToyTokenizer, ascii_tokenizer, byte_tokenizer

FakeTokenizer = ToyTokenizer
SPECIAL = (PAD, EOS, UNK)

__all__ = ["ASCII_ALPHABET", "EOS", "FakeTokenizer", "SPECIAL", "ascii_tokenizer", "byte_tokenizer",
           "multibyte_tokenizer"]


def multibyte_tokenizer() -> ToyTokenizer:
    """64 ids whose pieces are 1-3 byte slices of multi-byte UTF-8 text, cut across characters."""
    data = "é€😀ñ中文ü→ab".encode()
    pieces = []
    for i in range(61):
        start, size = (i * 2) % len(data), 1 + i % 3
        pieces.append(data[start:start + size] or data[:1])
    return ToyTokenizer("multibyte", pieces)
