"""Split steps: a step dispatched now and read later (docs/design.md, "The overlapped loop").

`EngineAPI.dispatch_step` starts a step and returns a `PendingStep` at once; its `result()` waits for the
step and copies the tokens to the host. Between the two the host is free (JAX dispatch is asynchronous), and
a driver may dispatch the next step from the device-resident state before it reads this one.

While steps are in flight their counts are unknown to the host, so an engine tracks each slot's length
as `SlotMirror` does: the committed length as of the steps read so far, plus an upper bound on what the
unread steps commit (cap + 1 tokens each). Shapes (the attention window) and cache room are chosen from
that bound, so a dispatched step never depends on counts not read yet; a slot freed while a step that
holds it is in flight gets a new epoch, and reading that step later leaves the slot alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import numpy as np

from jaxspec.types import StepResult


@runtime_checkable
class PendingStep(Protocol):
    """A dispatched step. `result()` waits for it (the first call) and returns its `StepResult`; later calls
    return the same value. Reading a step first reads every step its engine dispatched before it.
    `catch_up_s`: the wall seconds of lazy draft catch-up its dispatch ran before the step (known once dispatched;
    `result().catch_up_s` too): the scheduler places them in time (`Scheduler._read`)."""

    catch_up_s: float

    def result(self) -> StepResult:
        """The step's tokens and counts (device errors of the step surface here)."""


class DoneStep:
    """A `PendingStep` whose result is already known (an engine that computes on the host)."""

    def __init__(self, result: StepResult):
        self._result = result
        self.catch_up_s = result.catch_up_s

    def result(self) -> StepResult:
        return self._result


class SlotMirror:
    """The host's view of each slot's length with steps in flight.

    lengths[s]: committed tokens of slot s per the steps read so far (and prefill).
    unread[s]:  upper bound on the tokens the dispatched, unread steps commit to s (cap + 1 per step).
    epoch[s]:   bumped when s is freed or reset: a step read later updates only rows of its own epoch.
    """

    def __init__(self, num_slots: int):
        self.lengths = np.zeros(num_slots, np.int64)
        self.unread = np.zeros(num_slots, np.int64)
        self.epoch = np.zeros(num_slots, np.int64)

    def bound(self, slots: Sequence[int]) -> np.ndarray:
        """[n] the largest length each slot can have once every dispatched step has run."""
        slots = list(slots)
        return self.lengths[slots] + self.unread[slots]

    def dispatched(self, slots: Sequence[int], caps: Sequence[int]) -> np.ndarray:
        """Record a step that commits at most caps[i] + 1 tokens to slots[i]; returns the rows' epochs [n]."""
        slots = list(slots)
        self.unread[slots] += np.asarray(caps, np.int64) + 1
        return self.epoch[slots].copy()

    def read(self, slots: Sequence[int], epochs: np.ndarray, caps: Sequence[int], counts: np.ndarray) -> np.ndarray:
        """Apply a step's counts [n] to the rows still of their dispatch epoch; returns which rows those are [n]."""
        slots = np.asarray(list(slots), np.int64)
        current = self.epoch[slots] == epochs  # [n]
        live = slots[current]
        self.lengths[live] += np.asarray(counts, np.int64)[current]
        self.unread[live] -= np.asarray(caps, np.int64)[current] + 1
        return current

    def free(self, slot: int) -> None:
        self.lengths[slot] = 0
        self.unread[slot] = 0
        self.epoch[slot] += 1

    def reset(self) -> None:
        self.lengths[:] = 0
        self.unread[:] = 0
        self.epoch += 1


__all__ = ["DoneStep", "PendingStep", "SlotMirror"]
