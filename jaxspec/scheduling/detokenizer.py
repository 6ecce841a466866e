"""Incremental, UTF-8-safe detokenisation with stop strings (one instance per request).

Tokens arrive a few at a time; text is released only when it is final:

    token bytes ──utf-8 incremental decoder──> complete characters ──stop-string holdback──> released text

- A token may end inside a multi-byte character: its bytes wait in the UTF-8 decoder until the
  character completes (an invalid sequence becomes U+FFFD, exactly as a whole-text decode would).
- A stop string may span tokens and steps: the longest tail of the text that is a proper prefix of
  some stop string is held back until it either completes a stop string (the text ends before it)
  or can no longer become one (it is released).

So the concatenation of everything `push` and `finish` return equals the final `text`.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from typing import Protocol


class ByteTokenizer(Protocol):
    """What detokenisation needs from a tokenizer (jaxspec.models.loading.tokenizer.TextTokenizer has it).

    token_bytes(i):    the exact bytes token i contributes to decoded text (may be part of a character).
    special_token_ids: optional attribute; ids whose text is skipped (e.g. <|im_end|>).
    """

    def token_bytes(self, token_id: int) -> bytes: ...


class StopAfterFinishError(RuntimeError):
    """`push` after a stop string was found or after `finish`."""


class IncrementalDetokenizer:
    """Turns a stream of token ids into text, never splitting a character, cutting at stop strings."""

    def __init__(self, tokenizer: ByteTokenizer, stop_strings: Sequence[str] = (), skip_special_tokens: bool = True):
        if any(not s for s in stop_strings):
            raise ValueError("stop strings must be non-empty")
        self._tokenizer = tokenizer
        self._stops = tuple(stop_strings)
        self._skip = frozenset(getattr(tokenizer, "special_token_ids", ())) if skip_special_tokens else frozenset()
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._released: list[str] = []
        self._held = ""  # complete characters that might start a stop string
        self.stop_string: str | None = None  # the stop string that ended the text, if any
        self._closed = False

    @property
    def stopped(self) -> bool:
        """True once a stop string was found (the text then ends right before it)."""
        return self.stop_string is not None

    @property
    def text(self) -> str:
        """Everything released so far (the final text after `finish` or a stop)."""
        return "".join(self._released)

    def push(self, token_id: int) -> str:
        """Add one token; return the text it makes final (often '')."""
        if self._closed:
            raise StopAfterFinishError("detokenizer is finished (stop string found or finish() called)")
        if token_id in self._skip:
            return ""
        return self._advance(self._utf8.decode(self._tokenizer.token_bytes(token_id)))

    def finish(self) -> str:
        """End of stream: release the held tail (an incomplete character becomes U+FFFD)."""
        if self._closed:
            return ""
        out = self._advance(self._utf8.decode(b"", final=True))
        if not self._closed:  # no stop string completed: the held tail is final text
            out += self._held
            self._released.append(self._held)
            self._held = ""
            self._closed = True
        return out

    def _advance(self, new: str) -> str:
        buf = self._held + new
        if not self._stops:
            self._released.append(buf)
            self._held = ""
            return buf
        # Any stop occurrence lies inside `buf`: an earlier start would have been held back.
        hits = [(i, s) for s in self._stops if (i := buf.find(s)) >= 0]
        if hits:
            cut, stop = min(hits, key=lambda h: (h[0], -len(h[1])))
            self.stop_string = stop
            self._closed = True
            self._held = ""
            self._released.append(buf[:cut])
            return buf[:cut]
        hold = self._holdback(buf)
        out, self._held = buf[: len(buf) - hold], buf[len(buf) - hold:]
        self._released.append(out)
        return out

    def _holdback(self, buf: str) -> int:
        """Length of the longest tail of `buf` that is a proper prefix of some stop string."""
        best = 0
        for s in self._stops:
            for n in range(min(len(s) - 1, len(buf)), best, -1):
                if buf.endswith(s[:n]):
                    best = n
                    break
        return best
