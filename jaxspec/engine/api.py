"""The engine contract: what the scheduler, the profiler and the servers may ask of an engine.

Two engines satisfy it: `jaxspec.engine.engine.Engine` (the compiled JAX engine) and
`jaxspec.engine.fake.FakeEngine` (hand-checkable arithmetic, no XLA, for fast tests of everything
above the engine). Anything not named here is an engine's own business (docs/design.md, "The engine
contract").

A slot holds one request. Its *length* is the number of committed tokens in the cache; the newest
sampled token is pending (not yet in the cache). A step over some slots verifies up to k proposals per
row (each row capped by its own `row_k`) and commits the accepted ones plus one bonus token. A step may be
split: `dispatch_step` starts it and returns a `PendingStep` whose `result()` reads it, so a driver can
dispatch the next step before it reads this one (docs/design.md, "The overlapped loop"); while steps are in
flight `length` is an upper bound (jaxspec.engine.pending).

The target's KV cache is paged (docs/design.md, "Paged KV cache"): `admit` gives a slot its prompt's pages
(sharing a cached prefix) or says the pool cannot hold it now; a step takes the pages it may write and raises
`PagesExhaustedError`, taking nothing, when the pool has too few (the driver preempts a request and retries).

Shape keys (`StepKey`, `PrefillKey`, `CatchUpKey`) and the errors a driver must handle
(`MenuMissError`, `CapacityError`, `PagesExhaustedError`) live in `jaxspec.menu` and `jaxspec.engine.pages`
and are re-exported here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import numpy as np

from jaxspec.engine.pages import PagesExhaustedError, PageStats
from jaxspec.engine.pending import PendingStep
from jaxspec.menu import CapacityError, CatchUpCall, CatchUpKey, Menu, MenuMissError, PrefillKey, ShapeKey, StepKey
from jaxspec.mesh import MeshSpec
from jaxspec.models.kernel_plan import KernelPlan
from jaxspec.types import SamplingParams, StepResult, TokenLogprobs

# --- the contract -----------------------------------------------------------------------


@runtime_checkable
class EngineAPI(Protocol):
    """The engine as its drivers see it (JetStream's `engine_api.Engine` in spirit).

    menu:           the static shapes (buckets, k values, windows) and their arithmetic.
    model_name:     the target model's name (names the cost profile).
    vocab_size:     token ids are in [0, vocab_size).
    eos_token_ids:  the model's end-of-sequence ids.
    proposer_name:  "none", "ngram", "draft:<draft model>", ...; names the cost profile.
    dtype:          the weights' and KV cache's dtype ('float32', 'bfloat16'); names the cost profile.
    mesh_spec:      the device mesh it runs on (jaxspec.mesh.MeshSpec); names the cost profile.
    kernels:        the kernel plan its steps trace with (jaxspec.models.kernel_plan); its attention form names
                    the cost profile.
    logprobs:       0, or N: steps return the emitted tokens' log-probabilities under the target and their top N
                    alternatives (StepResult.logprobs), the last prefill chunk its token's (`first_token_logprobs`).
    """

    menu: Menu
    model_name: str
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    proposer_name: str
    dtype: str
    mesh_spec: MeshSpec
    kernels: KernelPlan
    logprobs: int

    def warmup(self, keys: Sequence[ShapeKey] | None = None, progress: bool = True) -> int:
        """Make every shape of the menu (or `keys`) ready; returns how many were built."""

    def shape_keys(self) -> list[ShapeKey]:
        """Every shape the menu holds."""

    def admit(self, slot: int, prompt: Sequence[int]) -> int | None:
        """Empty `slot` and give it the pages of `prompt` (and its first generated position), sharing the longest
        cached prefix of full pages. Returns the prompt tokens served from the cache (prefill starts there), or
        None when the pool cannot hold the prompt now."""

    def page_stats(self) -> PageStats:
        """The target's page pool: pages in use, cached for reuse, free."""

    def prefill_chunk(self, slot: int, tokens: np.ndarray, start: int, is_last: bool,
                      params: SamplingParams, seed: int, generated: int = 0) -> int | None:
        """Write prompt tokens at positions start.. of `slot` (a chunk at 0 starts a new prompt; after `admit`,
        prefill starts at its cached count); on the last chunk return the next token, the request's token
        number `generated` (0 for a new request; a preempted request's prompt holds what it had generated), else
        None. Returns once the chunk has run. A context-tracking draft does not see the prompt here: it is in the
        slot's `catch_up_plan`. Raises CapacityError past max_len, PagesExhaustedError without admission when the
        pool is full."""

    def first_token_logprobs(self, slot: int) -> TokenLogprobs:
        """The log-probabilities of the token the slot's last prefill drew (logprobs > 0; else ValueError)."""

    def step(self, slot_ids: Sequence[int], k: int, row_k: Sequence[int] | None = None) -> StepResult:
        """One step at padded k (a menu value) with optional per-row caps ≤ k. Raises MenuMissError
        for a shape outside the menu and CapacityError when a row has no room."""

    def dispatch_step(self, slot_ids: Sequence[int], k: int, row_k: Sequence[int] | None = None) -> PendingStep:
        """`step` split in two: start the step and return at once; `result()` of what it returns waits for
        it. The step's shape is chosen from each row's `length` (an upper bound while steps are in flight);
        a slot freed before the step is read keeps nothing of it. Raises as `step` does, and
        PagesExhaustedError (nothing started) when the pool has too few pages for what the rows may write."""

    def length(self, slot: int) -> int:
        """Committed tokens of `slot`; with steps in flight (dispatched, not read), an upper bound: the
        length read so far plus cap + 1 per unread step."""

    def room(self, slot: int) -> int:
        """The largest k this slot can verify in one step (cache positions left minus the bonus)."""

    def catch_up_plan(self, slot: int) -> list[CatchUpCall]:
        """The catch-up calls a speculating step would first run for `slot` ([] if none)."""

    def state_lost(self) -> bool:
        """True when a failed call consumed the device state; `reset()` is then required."""

    def free(self, slot: int) -> None:
        """Forget a slot's contents and give back its pages (its cached prefix pages stay cached)."""

    def reset(self) -> None:
        """Empty every slot with fresh state (kept: whatever was compiled)."""


def prefill_prompt(engine: EngineAPI, slot: int, prompt: Sequence[int], params: SamplingParams, seed: int) -> int:
    """Prefill a whole prompt in chunks of the menu's largest prefill bucket; returns the first token."""
    if not engine.menu.fits_prompt(len(prompt)):
        raise CapacityError(f"prompt of {len(prompt)} tokens does not fit max_len {engine.menu.max_len}")
    largest, first = engine.menu.largest_chunk, None
    for start in range(0, len(prompt), largest):
        piece = np.asarray(prompt[start:start + largest], np.int32)
        first = engine.prefill_chunk(slot, piece, start, start + largest >= len(prompt), params, seed)
    return first


__all__ = ["CapacityError", "CatchUpCall", "CatchUpKey", "EngineAPI", "Menu", "MenuMissError", "PageStats",
           "PagesExhaustedError", "PendingStep", "PrefillKey", "ShapeKey", "StepKey", "prefill_prompt"]
