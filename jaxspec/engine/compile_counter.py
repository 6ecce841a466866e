"""Counts XLA backend compilations in this process (docs/design.md, "Static shapes").

After warm-up the serving loop must compile nothing: every step and prefill runs an
executable compiled ahead of time. Any jit or eager op that reaches the backend compiler
bumps this counter, so a test (or the metrics endpoint) can prove it stays flat.
"""

from __future__ import annotations

import threading

from jax import monitoring

_BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_lock = threading.Lock()
_count = 0
_installed = False


def _on_event(event: str, duration_secs: float, **kwargs) -> None:
    global _count
    if event == _BACKEND_COMPILE_EVENT:
        with _lock:
            _count += 1


def install() -> None:
    """Start counting (idempotent)."""
    global _installed
    with _lock:
        if not _installed:
            monitoring.register_event_duration_secs_listener(_on_event)
            _installed = True


def count() -> int:
    """Backend compilations seen since `install()`."""
    return _count
