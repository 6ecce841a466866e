"""Whether the compiled XLA:CPU kernels (models/csrc, built by setup.py where a C++17 compiler works) are here.

The kernels are optional: an install without a compiler has none, and the engine then runs the XLA form on CPU.
`load` imports one kernel's extension module or gives the reason it cannot; `note_xla_form` says so on stderr, once
per process, the first time an engine would have used a missing kernel.
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType

HOW_TO_GET_THEM = ("to get them, install a C++17 compiler (g++ or clang++) and reinstall jaxspec "
                   "(`pip install --force-reinstall --no-deps .`, or `pip install -e .` in a checkout)")

_missing: dict[str, str] = {}  # kernel module name -> why it is not available
_noted = False


def load(name: str) -> ModuleType | None:
    """The extension module `models.<name>` (e.g. `_cache_attention`), or None, with the reason recorded for
    `unavailable_reason(name)`, where it was not built or does not load."""
    try:
        return importlib.import_module(f"models.{name}")
    except ImportError as error:
        _missing[name] = f"models.{name} is not built ({error})"
        return None


def unavailable_reason(name: str) -> str | None:
    """Why the kernel module `name` is not available, or None if it is."""
    return _missing.get(name)


def note_xla_form() -> None:
    """Says once per process, on stderr, which kernels are missing, that the XLA form runs in their place and how
    to get them. Called where a missing kernel would have been used (XLA:CPU, float32, one device)."""
    global _noted
    if _noted or not _missing:
        return
    _noted = True
    reasons = "; ".join(_missing[name] for name in sorted(_missing))
    print(f"jaxspec: the XLA:CPU kernels are not available ({reasons}); running the XLA form on CPU instead "
          f"(slower steps); {HOW_TO_GET_THEM}.", file=sys.stderr, flush=True)


__all__ = ["HOW_TO_GET_THEM", "load", "note_xla_form", "unavailable_reason"]
