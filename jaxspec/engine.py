"""The engine contract: prefill / step over a precompiled static-shape menu (DESIGN.md §4, §6).

Static (one executable each): batch bucket B, speculation length k, attention window W,
prefill chunk C. Traced: slot ids, lengths, per-row k caps, sampling parameters, seeds.
`warmup()` compiles the whole menu ahead of time; a shape outside it raises `MenuMissError`.
A step runs at the shape `jaxspec.policy.shape.step_shape` gives (the smallest menu k ≥ the
largest row cap, the window of max_i(len_i + cap_i) + 1): the function the policies price steps
and file their timings with.

One step, all inside one compiled call::

    propose (draft catch-up + k draft steps | n-gram lookup)  ->  d[B, k]
    score   target over [pending, d_1..d_k] at positions len..len+k   ->  logits[B, k+1, V]
    verify  greedy prefix / rejection sampling                ->  tokens[B, k+1], counts[B]
    commit  lengths += counts, pending = last token, history, draft lengths
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from jaxspec import sampling
from jaxspec.policy.shape import step_shape
from jaxspec.proposers.base import NoProposer, Proposer, StepContext, empty_proposals
from jaxspec.types import DecodeState, RowParams, SamplingParams, SlotParams, StepResult
from jaxspec.verify import RESIDUAL_KEY, verify
from models.kv_cache import init_cache
from models.llama import Llama, chain_inputs, serving_split


class MenuMissError(LookupError):
    """A shape was requested that the warm-up did not compile."""


class CapacityError(ValueError):
    """A request does not fit the cache (prompt + generation beyond max_len)."""


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """The static shape menu and cache size."""

    num_slots: int = 8
    max_len: int = 1024
    batch_buckets: tuple[int, ...] = (1, 4, 8)
    k_menu: tuple[int, ...] = (0, 1, 2, 3, 4, 5, 6, 8)
    window_buckets: tuple[int, ...] = (256, 1024)
    prefill_buckets: tuple[int, ...] = (32, 128)

    def __post_init__(self):
        for name in ("batch_buckets", "k_menu", "window_buckets", "prefill_buckets"):
            values = getattr(self, name)
            if not values or list(values) != sorted(set(values)):
                raise ValueError(f"{name} must be a non-empty increasing tuple, got {values}")
        if self.batch_buckets[-1] > self.num_slots:
            raise ValueError(f"largest batch bucket {self.batch_buckets[-1]} > num_slots {self.num_slots}")
        if self.window_buckets[-1] != self.max_len:
            raise ValueError(f"the largest window bucket must equal max_len={self.max_len}, "
                             f"got {self.window_buckets}")
        if self.k_menu[0] < 0:
            raise ValueError("k_menu values must be >= 0")
        if self.prefill_buckets[-1] > self.max_len:
            raise ValueError("prefill buckets must be <= max_len")

    @property
    def max_k(self) -> int:
        return self.k_menu[-1]

    def replace(self, **changes) -> "EngineConfig":
        return dataclasses.replace(self, **changes)


def smallest_at_least(buckets: Iterable[int], needed: int, what: str) -> int:
    for b in buckets:
        if b >= needed:
            return b
    raise MenuMissError(f"no {what} bucket >= {needed} in the menu {tuple(buckets)}")


def enable_compilation_cache(path: str | None = None) -> str:
    """Turn on JAX's persistent compilation cache (restarts skip recompiling the menu)."""
    path = path or os.environ.get("JAXSPEC_COMPILATION_CACHE",
                                  os.path.join(os.path.expanduser("~"), ".cache", "jaxspec", "xla"))
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path


@dataclasses.dataclass
class CatchUpTotals:
    """Running totals of lazy draft catch-up (calls, wall seconds) since the engine started."""

    calls: int = 0
    seconds: float = 0.0

    def add(self, calls: int, seconds: float) -> None:
        self.calls += calls
        self.seconds += seconds


class Engine:
    """Owns the device state and the compiled menu for one target (+ proposer)."""

    def __init__(self, target: Llama, proposer: Proposer | None = None, config: EngineConfig = EngineConfig()):
        self.config = config
        self.model_config = target.config
        self.proposer = proposer or NoProposer()
        if isinstance(self.proposer, NoProposer) and config.k_menu != (0,):
            # a plain engine can only take k = 0: compile just that (a k > 0 step then raises MenuMissError)
            config = config.replace(k_menu=(0,))
            self.config = config
        draft_config = getattr(self.proposer, "config", None)
        if draft_config is not None and draft_config.vocab_size != target.config.vocab_size:
            raise ValueError(
                f"draft vocabulary ({draft_config.vocab_size}) differs from the target's "
                f"({target.config.vocab_size}): target and draft must share a tokenizer")
        # per-layer weight arrays (unrolled layers, no per-step slice copies), stored once
        self._graphdef, self._params = serving_split(target)
        self._proposer_params = self.proposer.params()
        self._executables: dict[tuple, Callable] = {}
        self.lengths = np.zeros(config.num_slots, np.int64)  # host mirror of committed lengths
        self.proposer_lengths = np.zeros(config.num_slots, np.int64)  # host mirror: what the proposer saw
        self.catch_up_totals = CatchUpTotals()
        self.state = self._init_state()

    # --- state ---------------------------------------------------------------------

    def _init_state(self) -> DecodeState:
        c = self.config
        s1 = c.num_slots + 1
        return DecodeState(
            cache=init_cache(self.model_config, c.num_slots, c.max_len),
            pending=jnp.zeros((s1,), jnp.int32),
            history=jnp.zeros((s1, c.max_len), jnp.int32),
            n_generated=jnp.zeros((s1,), jnp.int32),
            params=SlotParams(temperature=jnp.zeros((s1,), jnp.float32), top_p=jnp.ones((s1,), jnp.float32),
                              top_k=jnp.zeros((s1,), jnp.int32), seed=jnp.zeros((s1,), jnp.int32)),
            proposer=self.proposer.init_state(c.num_slots, c.max_len),
        )

    @property
    def scratch_slot(self) -> int:
        return self.config.num_slots

    # --- traced bodies -------------------------------------------------------------

    def _rows(self, state: DecodeState, slot_ids: jax.Array) -> RowParams:
        p = state.params
        return RowParams(temperature=p.temperature[slot_ids], top_p=p.top_p[slot_ids], top_k=p.top_k[slot_ids],
                         keys=sampling.row_keys(p.seed[slot_ids], state.n_generated[slot_ids]))

    def _step_body(self, k: int, window: int):
        proposer = self.proposer
        scratch = self.scratch_slot

        def body(target_params, proposer_params, state: DecodeState, slot_ids, row_k):
            target, layers = nnx.merge(self._graphdef, target_params[0]), target_params[1]
            b = slot_ids.shape[0]
            start = state.cache.lengths[slot_ids]  # [B]
            pending = state.pending[slot_ids]  # [B]
            ctx = StepContext(slot_ids=slot_ids, start=start, history=state.history, rows=self._rows(state, slot_ids))
            if k > 0:
                proposals, pstate = proposer.propose(proposer_params, state.proposer, ctx, k, window)
                # per-request k: row b verifies at most row_k[b] proposals
                proposals = dataclasses.replace(proposals, lens=jnp.minimum(proposals.lens, row_k))
            else:  # plain decoding: the proposer's state is left alone (caught up lazily)
                proposals = empty_proposals(b)
                pstate = state.proposer
            # tokens_in: [B, k+1] = pending then the proposals
            tokens_in = jnp.concatenate([pending[:, None], proposals.token_ids], axis=1)
            logits, cache = target.forward_cached(chain_inputs(tokens_in, slot_ids, start), state.cache, window,
                                                  layers=layers)
            out, counts = verify(logits, proposals, ctx.rows)  # [B, k+1], [B]

            new_len = start + counts
            cache = cache.with_lengths(slot_ids, new_len)
            cache = cache.with_lengths(jnp.array([scratch]), jnp.zeros((1,), jnp.int32))
            new_pending = jnp.take_along_axis(out, (counts - 1)[:, None], axis=1)[:, 0]  # [B]
            # history[slot, start+1+j] = out[:, j]  (entries past counts are overwritten later)
            hist_pos = start[:, None] + 1 + jnp.arange(k + 1, dtype=jnp.int32)[None, :]  # [B, k+1]
            history = state.history.at[slot_ids[:, None], hist_pos].set(out, mode="drop")
            if k > 0:
                pstate = proposer.commit(pstate, ctx, k, counts - 1)
            new_state = DecodeState(
                cache=cache,
                pending=state.pending.at[slot_ids].set(new_pending),
                history=history,
                n_generated=state.n_generated.at[slot_ids].add(counts),
                params=state.params,
                proposer=pstate,
            )
            # packed: [B, k+3] = tokens | count | proposed  (one host copy per step)
            packed = jnp.concatenate([out, counts[:, None], proposals.lens[:, None]], axis=1)
            return new_state, packed

        return body

    def _prefill_body(self, chunk: int, window: int):
        proposer = self.proposer

        def body(target_params, proposer_params, state: DecodeState, slot, tokens, start, n_valid, is_last,
                 temperature, top_p, top_k, seed):
            # slot, start, n_valid: [1]; tokens: [1, C]; is_last: [] bool; sampling values: [1]
            target, layers = nnx.merge(self._graphdef, target_params[0]), target_params[1]
            params = SlotParams(temperature=state.params.temperature.at[slot].set(temperature),
                                top_p=state.params.top_p.at[slot].set(top_p),
                                top_k=state.params.top_k.at[slot].set(top_k),
                                seed=state.params.seed.at[slot].set(seed))
            inputs = chain_inputs(tokens, slot, start)
            logits, cache = target.forward_cached(inputs, state.cache, window, logits_at=(n_valid - 1)[:, None],
                                                  layers=layers)
            cache = cache.with_lengths(slot, start + n_valid)
            pstate = proposer.prefill(proposer_params, state.proposer, inputs, n_valid, window)
            positions = start[:, None] + jnp.arange(chunk, dtype=jnp.int32)[None, :]  # [1, C]
            history = state.history.at[slot[:, None], positions].set(tokens, mode="drop")
            # first generated token (used only when this is the prompt's last chunk)
            n_gen = jnp.zeros((1,), jnp.int32)
            rows = RowParams(temperature=temperature, top_p=top_p, top_k=top_k,
                             keys=sampling.row_keys(seed, n_gen))
            first = sampling.draw(logits[:, 0, :], rows, sampling.subkeys(rows.keys, RESIDUAL_KEY))[0]  # [1]
            first_pos = start + n_valid
            history = jnp.where(is_last, history.at[slot, first_pos].set(first, mode="drop"), history)
            new_state = DecodeState(
                cache=cache,
                pending=jnp.where(is_last, state.pending.at[slot].set(first), state.pending),
                history=history,
                n_generated=state.n_generated.at[slot].set(jnp.where(is_last, 1, 0)),
                params=params,
                proposer=pstate,
            )
            return new_state, first

        return body

    def _catch_up_body(self, chunk: int, window: int):
        """Feed a slot's committed history [start, start + n_valid) to the proposer's state."""
        proposer = self.proposer

        def body(proposer_params, state: DecodeState, slot, start, n_valid):
            # slot, start, n_valid: [1]; tokens: [1, C] gathered on device from the history
            idx = jnp.clip(start[:, None] + jnp.arange(chunk, dtype=jnp.int32)[None, :], 0, state.history.shape[1] - 1)
            tokens = state.history[slot[:, None], idx]
            pstate = proposer.prefill(proposer_params, state.proposer, chain_inputs(tokens, slot, start), n_valid,
                                      window)
            return dataclasses.replace(state, proposer=pstate)

        return body

    # --- compilation ---------------------------------------------------------------

    def menu(self, batch_buckets=None, k_menu=None) -> list[tuple]:
        """Every shape key of the menu: ('step', B, k, W) and ('prefill', C, W)."""
        c = self.config
        keys = [("step", b, k, w) for b in (batch_buckets or c.batch_buckets)
                for k in (k_menu or c.k_menu) for w in c.window_buckets]
        keys += [("prefill", ch, w) for ch in c.prefill_buckets for w in c.window_buckets if w >= ch]
        if self.proposer.tracks_context and any(k > 0 for k in (k_menu or c.k_menu)):
            keys += [("catchup", ch, w) for ch in c.prefill_buckets for w in c.window_buckets if w >= ch]
        return keys

    def _compile(self, key: tuple) -> Callable:
        i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
        f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
        if key[0] == "step":
            _, b, k, w = key
            fn = jax.jit(self._step_body(k, w), donate_argnums=(2,))
            lowered = fn.lower(self._params, self._proposer_params, self.state, i32(b), i32(b))
        elif key[0] == "catchup":
            _, ch, w = key
            fn = jax.jit(self._catch_up_body(ch, w), donate_argnums=(1,))
            lowered = fn.lower(self._proposer_params, self.state, i32(1), i32(1), i32(1))
        else:
            _, ch, w = key
            fn = jax.jit(self._prefill_body(ch, w), donate_argnums=(2,))
            lowered = fn.lower(self._params, self._proposer_params, self.state, i32(1), i32(1, ch), i32(1), i32(1),
                               jax.ShapeDtypeStruct((), jnp.bool_), f32(1), f32(1), i32(1), i32(1))
        return lowered.compile()

    def warmup(self, keys: list[tuple] | None = None, progress: bool = True) -> int:
        """Compile the menu ahead of time. Any failure raises. Returns the number compiled."""
        keys = [k for k in (keys or self.menu()) if k not in self._executables]
        for key in tqdm(keys, desc="compiling menu", unit="shape", disable=not progress or not keys,
                        leave=False):
            try:
                self._executables[key] = self._compile(key)
            except Exception as exc:  # re-raised with the shape that failed
                raise RuntimeError(f"compiling {key} failed: {exc}") from exc
        return len(keys)

    def _executable(self, key: tuple) -> Callable:
        try:
            return self._executables[key]
        except KeyError:
            raise MenuMissError(f"shape {key} was not compiled in warm-up (menu: "
                                f"B={self.config.batch_buckets}, k={self.config.k_menu}, "
                                f"W={self.config.window_buckets}, C={self.config.prefill_buckets})") from None

    # --- the contract ----------------------------------------------------------------

    def prefill_chunk(self, slot: int, tokens: np.ndarray, start: int, is_last: bool,
                      params: SamplingParams, seed: int) -> int | None:
        """Prefill `tokens` of a prompt into `slot` at positions start..; on the last chunk
        returns the first generated token (else None)."""
        n = len(tokens)
        chunk = smallest_at_least(self.config.prefill_buckets, n, "prefill")
        if start + n > self.config.max_len:
            raise CapacityError(f"prompt of {start + n} tokens exceeds max_len {self.config.max_len}")
        window = smallest_at_least(self.config.window_buckets, min(start + chunk, self.config.max_len), "window")
        padded = np.zeros((1, chunk), np.int32)
        padded[0, :n] = tokens
        fn = self._executable(("prefill", chunk, window))
        self.state, first = fn(
            self._params, self._proposer_params, self.state, np.array([slot], np.int32), padded,
            np.array([start], np.int32), np.array([n], np.int32), np.bool_(is_last),
            np.array([params.temperature], np.float32), np.array([params.top_p], np.float32),
            np.array([params.top_k], np.int32), np.array([seed], np.int32))
        self.lengths[slot] = start + n
        self.proposer_lengths[slot] = start + n
        return int(np.asarray(first)[0]) if is_last else None

    def prefill(self, slot: int, prompt: list[int], params: SamplingParams, seed: int | None = None) -> int:
        """Whole-prompt prefill in chunks of the largest bucket. Returns the first token.
        The PRNG seed is `seed`, else `params.seed`, else 0."""
        seed = seed if seed is not None else (params.seed if params.seed is not None else 0)
        if not prompt:
            raise ValueError("empty prompt")
        if len(prompt) + 1 > self.config.max_len:
            raise CapacityError(f"prompt of {len(prompt)} tokens does not fit max_len {self.config.max_len}")
        largest = self.config.prefill_buckets[-1]
        first = None
        for start in range(0, len(prompt), largest):
            piece = np.asarray(prompt[start:start + largest], np.int32)
            first = self.prefill_chunk(slot, piece, start, start + largest >= len(prompt), params, seed)
        return first

    def step(self, slot_ids: list[int], k: int, row_k: list[int] | None = None) -> StepResult:
        """One speculative step (k = 0: plain decoding) for the given slots.

        Row i verifies at most min(k, row_k[i]) proposals. The step runs at the shape
        `step_shape` gives: the smallest menu k ≥ every row's cap (rows all capped at 0 run the
        k = 0 executable, without draft catch-up) and the window of each row's own length + cap."""
        n, c = len(slot_ids), self.config
        b = smallest_at_least(c.batch_buckets, n, "batch")
        if k not in c.k_menu:
            raise MenuMissError(f"k={k} is not in the compiled menu k={c.k_menu}")
        shape = step_shape(self.lengths[list(slot_ids)], row_k, k, c.k_menu, c.window_buckets)
        if shape.needed > c.max_len:
            raise CapacityError(f"a slot needs {shape.needed} cache positions > max_len {c.max_len}")
        k_run = shape.k
        caps = np.zeros((b,), np.int32)  # padding rows (scratch slot) propose nothing
        caps[:n] = shape.caps
        fn = self._executable(("step", b, k_run, shape.window))
        catch_up_calls, catch_up_s = 0, 0.0
        if k_run > 0 and self.proposer.tracks_context:
            started = time.perf_counter()
            catch_up_calls = self._catch_up(slot_ids)
            if catch_up_calls:
                jax.block_until_ready(self.state)  # time the catch-up apart from the step
                catch_up_s = time.perf_counter() - started
                self.catch_up_totals.add(catch_up_calls, catch_up_s)
        slots = np.full((b,), self.scratch_slot, np.int32)
        slots[:n] = slot_ids
        self.state, packed = fn(self._params, self._proposer_params, self.state, slots, caps)
        packed = np.asarray(packed)[:n]  # the one host copy of this step
        result = StepResult(tokens=packed[:, : k_run + 1], counts=packed[:, k_run + 1], proposed=packed[:, k_run + 2],
                            catch_up_calls=catch_up_calls, catch_up_s=catch_up_s)
        if k_run > 0 and self.proposer.tracks_context:  # mirrors the proposer's commit
            self.proposer_lengths[list(slot_ids)] = (self.lengths[list(slot_ids)] + 1
                                                     + np.minimum(result.accepted, k_run - 1))
        self.lengths[list(slot_ids)] += result.counts
        return result

    def catch_up_plan(self, slot: int) -> list[tuple[int, int, int, int]]:
        """The catch-up calls a speculating step would first run for this slot: (start, n,
        chunk, window) each, feeding committed tokens the proposer missed during k = 0 steps in
        prefill-bucket chunks until only what `propose` feeds itself is left ([] if none)."""
        if not self.proposer.tracks_context:
            return []
        c, plan = self.config, []
        seen, length = int(self.proposer_lengths[slot]), int(self.lengths[slot])
        while length + 1 - seen > self.proposer.in_step_catch_up:
            missing = length - seen
            chunk = smallest_at_least(c.prefill_buckets, min(missing, c.prefill_buckets[-1]), "prefill")
            window = smallest_at_least(c.window_buckets, min(seen + chunk, c.max_len), "window")
            n = min(missing, chunk)
            plan.append((seen, n, chunk, window))
            seen += n
        return plan

    def _catch_up(self, slot_ids: list[int]) -> int:
        """Run every slot's catch-up plan; returns the number of calls."""
        calls = 0
        for slot in slot_ids:
            for start, n, chunk, window in self.catch_up_plan(slot):
                fn = self._executable(("catchup", chunk, window))
                self.state = fn(self._proposer_params, self.state, np.array([slot], np.int32),
                                np.array([start], np.int32), np.array([n], np.int32))
                self.proposer_lengths[slot] = start + n
                calls += 1
        return calls

    def reset(self) -> None:
        """Empty every slot with fresh device state (e.g. after a failed call left the donated
        state invalid). Compiled executables are kept."""
        self.state = self._init_state()
        self.lengths[:] = 0
        self.proposer_lengths[:] = 0

    def free(self, slot: int) -> None:
        """Forget a slot's contents (the next prefill overwrites it)."""
        self.lengths[slot] = 0
        self.proposer_lengths[slot] = 0

