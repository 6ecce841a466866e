"""Output processing of one request: where its generated tokens end, and their text.

A step gives a row several tokens at once; `OutputProcessor.push` takes them in order and stops at
the first one that ends the request:

    eos id (unless ignore_eos)  -> EOS    the id is kept as the last token, it adds no text
    a stop token id             -> STOP   the id is kept as the last token, it adds no text
    a stop string in the text   -> STOP   the text ends before it (jaxspec.scheduling.detokenizer)
    max new tokens reached      -> LENGTH

Tokens after the one that ended the request (same step) are dropped. Text is released incrementally
and UTF-8 safe; `finish()` releases what is still held back at the end.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from jaxspec.scheduling.detokenizer import ByteTokenizer, IncrementalDetokenizer
from jaxspec.scheduling.requests import FinishReason
from jaxspec.types import SamplingParams


class OutputDelta(NamedTuple):
    """What one `push` adds: the tokens kept, the text they make final, and why the request ended (or None)."""

    token_ids: tuple[int, ...]
    text: str
    finish_reason: FinishReason | None


class OutputProcessor:
    """Per-request output state (one thread at a time).

    max_new:    tokens the request may generate (already capped to the cache room).
    tokenizer:  gives text and stop strings; None = ids only (`text` is then None).
    """

    def __init__(self, params: SamplingParams, eos_token_ids: Iterable[int], max_new: int,
                 tokenizer: ByteTokenizer | None = None):
        if max_new < 1:
            raise ValueError(f"max_new must be >= 1, got {max_new}")
        if params.stop_strings and tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        self._eos = frozenset() if params.ignore_eos else frozenset(int(t) for t in eos_token_ids)
        self._stop_ids = frozenset(int(t) for t in params.stop_token_ids)
        self.max_new = max_new
        self._detok = IncrementalDetokenizer(tokenizer, params.stop_strings) if tokenizer is not None else None
        self._tokens: list[int] = []
        self.finish_reason: FinishReason | None = None

    @property
    def token_ids(self) -> tuple[int, ...]:
        """Every token kept so far."""
        return tuple(self._tokens)

    @property
    def remaining(self) -> int:
        """Tokens the request may still generate."""
        return self.max_new - len(self._tokens)

    @property
    def text(self) -> str | None:
        """The text released so far (None without a tokenizer)."""
        return self._detok.text if self._detok is not None else None

    def push(self, tokens: Iterable[int]) -> OutputDelta:
        """Take a row's new tokens in order up to the first one that ends the request."""
        if self.finish_reason is not None:
            raise RuntimeError(f"the request already finished ({self.finish_reason.value})")
        new, text, reason = [], [], None
        for token in tokens:
            token = int(token)
            new.append(token)
            if token in self._eos:
                reason = FinishReason.EOS
            elif token in self._stop_ids:
                reason = FinishReason.STOP
            elif self._detok is not None:
                text.append(self._detok.push(token))
                if self._detok.stopped:
                    reason = FinishReason.STOP
            if reason is None and len(self._tokens) + len(new) >= self.max_new:
                reason = FinishReason.LENGTH
            if reason is not None:
                break
        self._tokens.extend(new)
        self.finish_reason = reason
        return OutputDelta(tuple(new), "".join(text), reason)

    def finish(self) -> str:
        """End of the request (for whatever reason): the text still held back, now final."""
        return self._detok.finish() if self._detok is not None else ""
