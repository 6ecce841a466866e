"""Whether the compiled XLA:CPU kernels (jaxspec/models/csrc, built by setup.py where a C++17 compiler works) are here.

The kernels are optional: an install without a compiler has none, and the engine then runs the XLA form on CPU.
Each kernel module imports its extension and `record_missing` keeps the reason when it cannot; `note_xla_form`
says so on stderr, once per process, when a kernel plan would have used a missing kernel.
"""

from __future__ import annotations

import sys

HOW_TO_GET_THEM = ("to get them, install a C++17 compiler (g++ or clang++) and reinstall jaxspec "
                   "(`pip install --force-reinstall --no-deps .`, or `pip install -e .` in a checkout)")

_missing: dict[str, str] = {}  # kernel module name -> why it is not available
_noted = False


def record_missing(name: str, error: ImportError) -> None:
    """Record why the extension module `jaxspec.models.<name>` (e.g. `_cache_attention`) did not import."""
    _missing[name] = f"jaxspec.models.{name} is not built ({error})"


def unavailable_reason(name: str) -> str | None:
    """Why the kernel module `name` is not available, or None if it is."""
    return _missing.get(name)


def note_xla_form() -> None:
    """Says once per process, on stderr, which kernels are missing, that the XLA form runs in their place and how
    to get them. Called where a kernel plan would have taken a missing kernel (XLA:CPU, float32, one device)."""
    global _noted
    if _noted or not _missing:
        return
    _noted = True
    reasons = "; ".join(_missing[name] for name in sorted(_missing))
    print(f"jaxspec: the XLA:CPU kernels are not available ({reasons}); running the XLA form on CPU instead "
          f"(slower steps); {HOW_TO_GET_THEM}.", file=sys.stderr, flush=True)


__all__ = ["HOW_TO_GET_THEM", "note_xla_form", "record_missing", "unavailable_reason"]
