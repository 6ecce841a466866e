"""Shared helpers for the loading and tokenizer tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from jaxspec.models.loading import ModelLoadError
from jaxspec.models.loading.registry import DEFAULT_MODEL, PACKAGED, packaged_path


def default_gguf_path() -> Path:
    """The embedded default GGUF, or skip the test when its package is not installed."""
    try:
        return packaged_path(PACKAGED[DEFAULT_MODEL])
    except ModelLoadError as exc:
        pytest.skip(str(exc))
