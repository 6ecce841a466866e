"""Which token ids end a generation."""

from __future__ import annotations

from collections.abc import Callable, Iterable

# End-of-turn markers of common chat formats. One counts as a stop token when the chat
# template writes it and the vocabulary has it.
CHAT_END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|end_of_turn|>")


def stop_token_ids(
    eos_ids: Iterable[int | None],
    chat_template: str | None,
    token_to_id: Callable[[str], int | None],
) -> tuple[int, ...]:
    """`eos_ids` (in order, without None or repeats) plus the chat end tokens `chat_template` uses."""
    ids: list[int] = []
    for i in eos_ids:
        if i is not None and int(i) not in ids:
            ids.append(int(i))
    for token in CHAT_END_TOKENS:
        if chat_template and token in chat_template:
            i = token_to_id(token)
            if i is not None and i not in ids:
                ids.append(i)
    return tuple(ids)
