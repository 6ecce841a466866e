"""A fake engine with hand-checkable arithmetic: the engine contract (`jaxspec.engine.api`) without XLA.

The "model" continues every sequence by counting: the token after t is (t + 1) mod V, so the
first generated token is the prompt's last token + 1 and a request's output is fully predictable.
The "proposer" is right about the first `accept` proposals of every row and wrong after them, so
a row verifying c proposals commits min(accept, c) + 1 tokens: the output is the same for every k
(the lossless property, by construction) while the acceptance is whatever a test asks for.

With `logprobs` N > 0 every emitted token t comes with hand-checkable log-probabilities: alternative j
(0 = t itself) is (t + j) mod V with log-probability -(j + 1) / 4 (`fake_logprobs`).

Everything else is the real engine's contract: the same menu arithmetic (`jaxspec.menu.Menu`), the same page
pool (`jaxspec.engine.pages`: admission, prefix caching, PagesExhaustedError when a step cannot get its pages),
MenuMissError for a shape that was not warmed up, CapacityError past max_len, lazy draft catch-up
plans when `tracks_context`, free/reset, split steps (`dispatch_step`: the arithmetic runs at dispatch, the
host-visible lengths move when the step is read, as the real engine's mirror does). `calls` records every
call for assertions.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from jaxspec.engine.pages import PagePool, PageStats
from jaxspec.engine.pending import SlotMirror
from jaxspec.menu import CapacityError, CatchUpCall, Menu, MenuMissError, ShapeKey, StepKey
from jaxspec.mesh import MeshSpec
from jaxspec.models.kernel_plan import XLA_PLAN
from jaxspec.types import SamplingParams, StepResult, TokenLogprobs


@dataclasses.dataclass(frozen=True)
class FakeCall:
    """One call the fake engine served: kind ('prefill' | 'step' | 'catch_up'), its shape key, slots."""

    kind: str
    key: ShapeKey
    slots: tuple[int, ...]


class FakeEngine:
    """The engine contract over counting arithmetic (see the module doc).

    accept:           proposals each row gets right (an int, or f(slot) -> int).
    tracks_context:   the proposer keeps per-slot context (a draft model): plans lazy catch-up.
    in_step_catch_up: tokens a speculating step feeds the proposer itself (as a draft's propose).
    logprobs:         0, or N: steps and prefills return log-probabilities with N alternatives (`fake_logprobs`).
    prefix_cache:     the page pool shares cached prompt prefixes.
    """

    def __init__(self, menu: Menu, *, vocab_size: int = 64, eos_token_ids: Sequence[int] = (),
                 accept: int | Callable[[int], int] = 0, model_name: str = "fake", proposer_name: str = "fake",
                 dtype: str = "float32", tracks_context: bool = False, in_step_catch_up: int = 2,
                 logprobs: int = 0, prefix_cache: bool = True):
        self.menu = menu
        self.model_name = model_name
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.proposer_name = proposer_name
        self.dtype = dtype
        self.mesh_spec = MeshSpec()  # counts on the host: no devices
        self.kernels = XLA_PLAN  # no attention at all; the profile key's default
        self.accept = accept
        self.logprobs = logprobs
        self.tracks_context = tracks_context
        self.in_step_catch_up = in_step_catch_up
        self.compiled: set[ShapeKey] = set()
        self.calls: list[FakeCall] = []
        self.lost = False  # a test sets it to simulate a failed call that consumed the device state
        self.pages = PagePool(menu.pool_pages, menu.page_size, menu.num_slots, menu.max_len,
                              prefix_cache=prefix_cache, scope=f"{model_name}/{dtype}/{proposer_name}")
        self.reset()

    # --- the contract -------------------------------------------------------------------

    def shape_keys(self) -> list[ShapeKey]:
        m = self.menu
        keys: list[ShapeKey] = [*m.step_keys(), *m.prefill_keys()]
        if self.tracks_context and m.max_k > 0:
            keys += m.catch_up_keys()
        return keys

    def warmup(self, keys: Sequence[ShapeKey] | None = None, progress: bool = True) -> int:
        new = [k for k in (keys or self.shape_keys()) if k not in self.compiled]
        self.compiled.update(new)
        return len(new)

    def admit(self, slot: int, prompt: Sequence[int]) -> int | None:
        self.free(slot)
        cached = self.pages.admit(slot, prompt)
        if cached:  # the shared prefix is in the "cache"
            self._history[slot] = [int(t) for t in prompt[:cached]]
            self._lengths[slot] = self._mirror.lengths[slot] = cached
        return cached

    def page_stats(self) -> PageStats:
        return self.pages.stats()

    def prefill_chunk(self, slot: int, tokens: np.ndarray, start: int, is_last: bool,
                      params: SamplingParams, seed: int, generated: int = 0) -> int | None:
        n = len(tokens)
        if start + n > self.menu.max_len:
            raise CapacityError(f"prompt of {start + n} tokens exceeds max_len {self.menu.max_len}")
        key = self._ready(self.menu.prefill_key(start, n))
        cached = self.pages.cached_prefix(slot) if start > 0 else []
        self.pages.write_prompt(slot, tokens, start)
        self.calls.append(FakeCall("prefill", key, (slot,)))
        self._history[slot][start:] = [int(t) for t in tokens]
        self.pages.publish(slot)
        self._lengths[slot] = self._mirror.lengths[slot] = start + n
        if start == 0 or cached:  # the draft sees the prompt lazily, in the first speculating step's catch-up
            self._seen[slot] = 0
        if not is_last:
            return None
        self._pending[slot] = self._next(self._history[slot][-1])
        return self._pending[slot]

    def first_token_logprobs(self, slot: int) -> TokenLogprobs:
        if not self.logprobs:
            raise ValueError("the engine's logprobs option is 0")
        return fake_logprobs(self._pending[slot], self.logprobs, self.vocab_size)

    def step(self, slot_ids: Sequence[int], k: int, row_k: Sequence[int] | None = None) -> StepResult:
        return self.dispatch_step(slot_ids, k, row_k).result()

    def dispatch_step(self, slot_ids: Sequence[int], k: int, row_k: Sequence[int] | None = None) -> FakeStep:
        slots = [int(s) for s in slot_ids]
        shape = self.menu.step_shape(self._mirror.bound(slots), row_k, k)  # as the real engine: the host's bound
        key = self._ready(StepKey(self.menu.batch_bucket(len(slots)), shape.k, shape.window))
        catch_up = catch_up_tokens = 0
        if key.k > 0 and self.tracks_context:
            for slot in slots:
                for call in self.catch_up_plan(slot):
                    self.calls.append(FakeCall("catch_up", self._ready(call.key), (slot,)))
                    self._seen[slot] = call.start + call.n
                    catch_up += 1
                    catch_up_tokens += call.key.chunk
        self.pages.grow(slots, self._mirror.bound(slots) + np.asarray(shape.caps, np.int64) + 1)
        self.calls.append(FakeCall("step", key, tuple(slots)))
        tokens = np.zeros((len(slots), key.k + 1), np.int64)  # [B, k+1]
        counts = np.zeros(len(slots), np.int64)  # [B]
        for row, (slot, cap) in enumerate(zip(slots, shape.caps, strict=True)):
            accepted = min(self._accepted(slot), cap)
            out = []
            for _ in range(accepted + 1):
                self._history[slot].append(self._pending[slot])
                self._pending[slot] = self._next(self._pending[slot])
                out.append(self._pending[slot])
            tokens[row, : accepted + 1] = out
            counts[row] = accepted + 1
            if key.k > 0 and self.tracks_context:  # the draft saw pending and the accepted proposals
                self._seen[slot] = self._lengths[slot] + 1 + min(accepted, key.k - 1)
            self._lengths[slot] += accepted + 1
        result = StepResult(tokens=tokens, counts=counts, proposed=np.asarray(shape.caps, np.int64),
                            catch_up_calls=catch_up, catch_up_tokens=catch_up_tokens)
        if self.logprobs:  # [B, k+1], [B, k+1, N], [B, k+1, N]
            alternatives = np.arange(self.logprobs)
            top_ids = (tokens[:, :, None] + alternatives) % self.vocab_size
            top_logprobs = np.broadcast_to(-(alternatives + 1) / 4, top_ids.shape).astype(np.float32)
            result = dataclasses.replace(result, logprobs=np.full(tokens.shape, -0.25, np.float32),
                                         top_logprobs=top_logprobs, top_ids=top_ids)
        step = FakeStep(self, slots, self._mirror.dispatched(slots, shape.caps), shape.caps, result)
        self._in_flight.append(step)
        return step

    def length(self, slot: int) -> int:
        return int(self._mirror.bound([slot])[0])

    def room(self, slot: int) -> int:
        return self.menu.room(self.length(slot))

    def catch_up_plan(self, slot: int) -> list[CatchUpCall]:
        if not self.tracks_context:
            return []
        return self.menu.catch_up_plan(self._seen[slot], self._lengths[slot], self.in_step_catch_up)

    def state_lost(self) -> bool:
        return self.lost

    def free(self, slot: int) -> None:
        self._lengths[slot] = self._seen[slot] = 0
        self._history[slot] = []
        self._mirror.free(slot)
        self.pages.release(slot)

    def reset(self) -> None:
        slots = self.menu.num_slots
        self._lengths = [0] * slots
        self._seen = [0] * slots  # tokens the proposer has seen (catch-up)
        self._pending = [0] * slots
        self._history: list[list[int]] = [[] for _ in range(slots)]
        self._mirror = SlotMirror(slots)  # what the host has read (lengths) and the bound of what it has not
        self._in_flight: list[FakeStep] = []
        self.pages.reset()
        self.lost = False

    def read_through(self, step: FakeStep) -> None:
        """Read the steps in flight up to `step`, in dispatch order (as the real engine): their counts reach
        the host-visible lengths of the slots not freed meanwhile."""
        if step not in self._in_flight:  # dropped by reset: it touches nothing
            step.read = True
            return
        while self._in_flight and not step.read:
            first = self._in_flight.pop(0)
            self._mirror.read(first.slots, first.epochs, first.caps, first.computed.counts)
            first.read = True
        step.read = True

    def in_flight(self) -> int:
        """Steps dispatched and not read yet."""
        return len(self._in_flight)

    # --- for tests ------------------------------------------------------------------------

    def expected_output(self, prompt: Sequence[int], n: int) -> list[int]:
        """The first n generated tokens for `prompt`: last + 1, last + 2, ... (mod V)."""
        return [(int(prompt[-1]) + 1 + i) % self.vocab_size for i in range(n)]

    def history(self, slot: int) -> list[int]:
        """Committed tokens of `slot` (prompt, then generated tokens already in the 'cache')."""
        return list(self._history[slot])

    def _next(self, token: int) -> int:
        return (int(token) + 1) % self.vocab_size

    def _accepted(self, slot: int) -> int:
        return int(self.accept(slot) if callable(self.accept) else self.accept)

    def _ready(self, key: ShapeKey) -> ShapeKey:
        if key not in self.compiled:
            raise MenuMissError(f"shape {key} was not compiled in warm-up")
        return key


@dataclasses.dataclass(eq=False)
class FakeStep:
    """A step the fake engine dispatched (computed already); reading it moves the host-visible lengths."""

    engine: FakeEngine
    slots: list[int]
    epochs: np.ndarray
    caps: tuple[int, ...]
    computed: StepResult
    read: bool = False

    @property
    def catch_up_s(self) -> float:
        return self.computed.catch_up_s

    def result(self) -> StepResult:
        if not self.read:
            self.engine.read_through(self)
        return self.computed


def fake_logprobs(token: int, n_top: int, vocab_size: int) -> TokenLogprobs:
    """The fake engine's log-probabilities of an emitted `token` with `n_top` alternatives."""
    return TokenLogprobs(int(token), -0.25, tuple(((int(token) + j) % vocab_size, -(j + 1) / 4) for j in range(n_top)))
