"""Strict YAML mappings for frozen config dataclasses: unknown keys are errors, not ignored."""

from __future__ import annotations

import dataclasses
from typing import Any


def check_fields(cls: type, values: Any, source: object) -> dict[str, Any]:
    """`values` as a dict of `cls`'s fields; raise ValueError naming `source` otherwise."""
    if not isinstance(values, dict):
        raise ValueError(f"{source}: expected a mapping of {cls.__name__} fields")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"{source}: unknown keys {unknown}; known: {sorted(known)}")
    return dict(values)
