"""The one exception every loader raises."""

from __future__ import annotations


class ModelLoadError(Exception):
    """A model, tokenizer or checkpoint could not be loaded.

    The message is one human-readable line naming the file and what is wrong with it.
    """
