"""The compiled shape a decode step runs at: one function for the engine, the policies and the profiler.

A step is asked for at a padded k (a menu value) with per-row caps. Row i verifies
c_i = min(k, cap_i) proposals and writes its pending token plus them at positions
len_i .. len_i + c_i; what a row writes past its cap is padding, never attended. So

    k_run  = the smallest menu value ≥ max_i c_i         (k itself when some row takes k)
    needed = max_i (len_i + c_i) + 1                      cache positions the step attends over
    window = the smallest window bucket ≥ needed          (None: no bucket is large enough)

A batch whose rows are all capped at 0 runs the k = 0 executable (and no draft catch-up); a
long row capped at a small k does not push the window, so it does not take large k from the
other rows. The engine runs exactly this shape, and the policies price and file their timings
under it.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence


@dataclasses.dataclass(frozen=True)
class StepShape:
    """k: the padded k that runs. window: its attention window (None if none fits).
    needed: max_i (len_i + caps_i) + 1. caps: per-row verified proposals min(k, cap_i)."""

    k: int
    window: int | None
    needed: int
    caps: tuple[int, ...]

    @property
    def real_tokens(self) -> int:
        """Σ_i (caps_i + 1): verified token slots the live rows use."""
        return sum(c + 1 for c in self.caps)


def step_shape(context_lens: Sequence[int], row_caps: Sequence[int] | None, k: int, k_menu: Sequence[int],
               window_buckets: Sequence[int] | None) -> StepShape:
    """The shape of a step at padded k with per-row caps (None: every row at k); see the module doc.

    window_buckets None means an unbucketed window (W = needed). Raises ValueError for an empty
    batch, a k outside the menu, a negative cap or caps of another length than the batch."""
    lens = [int(n) for n in context_lens]
    if not lens:
        raise ValueError("a step needs at least one row")
    menu = sorted(int(m) for m in k_menu)
    if k not in menu:
        raise ValueError(f"k={k} is not in the menu {tuple(menu)}")
    limits = [k] * len(lens) if row_caps is None else [int(c) for c in row_caps]
    if len(limits) != len(lens):
        raise ValueError(f"{len(limits)} row caps for {len(lens)} rows")
    if any(c < 0 for c in limits):
        raise ValueError(f"row caps must be >= 0, got {tuple(limits)}")
    caps = tuple(min(k, c) for c in limits)
    k_run = next(m for m in menu if m >= max(caps))  # exists: k itself is ≥ every cap
    needed = max(n + c for n, c in zip(lens, caps)) + 1
    if window_buckets is None:
        window = needed
    else:
        window = next((w for w in sorted(window_buckets) if w >= needed), None)
    return StepShape(k=k_run, window=window, needed=needed, caps=caps)
