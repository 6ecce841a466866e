"""The compiled JAX engine: prefill / step over a precompiled static-shape menu.

It satisfies the engine contract (`jaxspec.engine.api.EngineAPI`; docs/design.md, "The engine
contract" and "The speculative step"). It runs on one device or a mesh (docs/design.md, "Sharding"):
the target tensor parallel over `model`, the proposer replicated, KV caches split by slot over `data`,
every executable compiled with explicit input and output shardings.

Static (one executable each): batch bucket B, speculation length k, attention window W,
prefill chunk C. Traced: slot ids, lengths, per-row k caps, sampling parameters, seeds.
`warmup()` compiles the whole menu ahead of time; a shape outside it raises `MenuMissError`.
A step runs at the shape `jaxspec.menu.Menu.step_shape` gives (the smallest menu k ≥ the
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
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.engine.api import prefill_prompt
from jaxspec.engine.executables import CompiledMenu
from jaxspec.engine.kernels import kernel_plan_for
from jaxspec.engine.pages import PagePool, PageStats
from jaxspec.engine.pending import SlotMirror
from jaxspec.engine.step_bodies import PrefillInputs, StepBodies
from jaxspec.menu import CapacityError, CatchUpCall, CatchUpKey, Menu, PrefillKey, ShapeKey, StepKey, TreeEnvelope
from jaxspec.mesh import MeshSpec, make_mesh
from jaxspec.models.kernel_plan import KernelChoice
from jaxspec.models.kv_cache import init_paged_cache
from jaxspec.models.llama import Llama, serving_split
from jaxspec.models.sharding import cache_spec, padded_slots, plan_layout, replicated_layout, serving_placement
from jaxspec.speculation.proposers.base import NoProposer, Proposer
from jaxspec.types import (
    MAX_LOGPROBS,
    DecodeState,
    HostProposals,
    SamplingParams,
    SlotParams,
    StepResult,
    TokenLogprobs,
    token_logprobs,
)


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
    """Owns the device state and the compiled menu for one target (+ proposer); an `EngineAPI`.

    logprobs: 0, or N in [1, MAX_LOGPROBS]: every step and last prefill chunk also return the emitted tokens'
    log-probabilities under the target and their top N alternatives (StepResult.logprobs,
    `first_token_logprobs`); static, so the default engine compiles the same executables as without it.
    prefix_cache: share the cached pages of prompt prefixes between requests (jaxspec.engine.pages); a feature
    draft turns it off (it reads the target's features of every prompt position, which a shared prefix skips).
    """

    def __init__(self, target: Llama, proposer: Proposer | None = None, menu: Menu = Menu(),
                 mesh: MeshSpec = MeshSpec(), kernels: KernelChoice = "auto", logprobs: int = 0,
                 prefix_cache: bool = True):
        if not 0 <= logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {logprobs}")
        self.logprobs = logprobs
        self.model_config = target.config
        self.proposer = proposer or NoProposer()
        if isinstance(self.proposer, NoProposer) and menu.k_menu != (0,):
            # a plain engine can only take k = 0: compile just that (a k > 0 step then raises MenuMissError)
            menu = menu.with_k_menu((0,))
        if menu.tree_envelopes and not self.proposer.builds_trees:
            raise ValueError(f"the menu's tree envelopes ({', '.join(map(str, menu.tree_envelopes))}) need a proposer "
                             f"that builds token trees; {self.proposer.name!r} does not (use the ngram or draft "
                             f"proposer)")
        self.menu = menu
        self.model_name = target.config.name
        self.dtype = target.config.dtype  # weights and KV cache (jaxspec.dtypes); names the cost profile
        self.vocab_size = target.config.vocab_size
        self.eos_token_ids = tuple(target.config.eos_token_ids)
        draft_config = getattr(self.proposer, "config", None)  # a draft model's
        self.proposer_name = self.proposer.name if draft_config is None else f"{self.proposer.name}:{draft_config.name}"
        if draft_config is not None and draft_config.vocab_size != target.config.vocab_size:
            raise ValueError(
                f"draft vocabulary ({draft_config.vocab_size}) differs from the target's "
                f"({target.config.vocab_size}): target and draft must share a tokenizer")
        # the mesh (docs/design.md, "Sharding"): the target tensor parallel over `model`, the proposer
        # replicated, KV caches split by slot over `data`
        self.mesh_spec = mesh
        self.mesh = make_mesh(mesh)
        layout = plan_layout(target.config, mesh.model)
        self.sharding_notes = layout.notes
        # the kernel plan (jaxspec.models.kernel_plan; docs/design.md, "The kernel plan"): resolved once here, passed
        # to every traced body; a model loaded for another plan's weight layout is refused by serving_split
        self.kernels = kernel_plan_for(target.config, mesh, kernels, page_size=menu.page_size)
        self._placement = serving_placement(self.mesh, layout, self.kernels)
        self._replicated = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
        self._cache_config = target.config.replace(num_kv_heads=layout.kv_heads_for(target.config))
        # per-layer weight arrays (unrolled layers, no per-step slice copies), stored once
        self._graphdef, self._params = serving_split(target, self._placement)
        # the proposer's layers are replicated (small); an embedding it shares with the target stays the target's;
        # its head is XLA's dot (a draft's is pruned; the table head is for the target's verify logits)
        self.proposer_kernels = dataclasses.replace(
            kernel_plan_for(draft_config or target.config, mesh, kernels, tensor_parallel=False, max_len=menu.max_len),
            lm_head="xla")
        self.proposer = self.proposer.with_kernels(self.proposer_kernels)
        self.proposer_placement = serving_placement(self.mesh, replicated_layout(target.config, mesh.model),
                                                    self.proposer_kernels)
        self._proposer_params = self.proposer.params(self.proposer_placement)
        #: the host structure a proposer with `host_proposals` proposes from (the scheduler feeds it), else None
        self.suffix_index = getattr(self.proposer, "index", None) if self.proposer.host_proposals else None
        self.bodies = StepBodies(self._graphdef, self.proposer, menu, self.kernels, logprobs)
        self._first_logprobs: dict[int, TokenLogprobs] = {}  # slot -> its first token's (logprobs > 0)
        # the paged KV cache's host side (docs/design.md, "Paged KV cache"): who holds which page, the prefix cache
        self.prefix_cache_note = ("prefix caching is off: the feature draft reads the target's features of every "
                                  "prompt position" if prefix_cache and self.proposer.feature_layers else None)
        self.pages = PagePool(menu.pool_pages, menu.page_size, menu.num_slots, menu.max_len,
                              prefix_cache=prefix_cache and not self.proposer.feature_layers,
                              scope=f"{self.model_name}/{self.dtype}/{self.proposer_name}")
        self.executables = CompiledMenu(menu, self._lower)
        # host mirror of committed lengths, with an upper bound for steps in flight (jaxspec.engine.pending)
        self._mirror = SlotMirror(menu.num_slots)
        self.lengths = self._mirror.lengths  # committed lengths as of the steps read so far
        self._in_flight: list[DispatchedStep] = []  # dispatched, not read yet, in dispatch order
        self.proposer_lengths = np.zeros(menu.num_slots, np.int64)  # host mirror: what the proposer saw
        # whether a slot's last dispatched step ran the draft (k > 0): its draft is then in step after it however
        # many tokens it commits, so a speculating step behind it needs no read (`dispatch_step`)
        self._draft_ran = np.zeros(menu.num_slots, bool)
        self.catch_up_totals = CatchUpTotals()
        self._state_shardings = jax.tree_util.tree_map_with_path(self._state_sharding,
                                                                 jax.eval_shape(self._fresh_state))
        self._init_state = jax.jit(self._fresh_state, out_shardings=self._state_shardings)
        self.state = self._init_state()

    # --- state ---------------------------------------------------------------------

    def _fresh_state(self) -> DecodeState:
        """Empty device state (traced under jit with the state's shardings as its output shardings)."""
        c = self.menu
        s1 = c.num_slots + 1
        slot_rows = padded_slots(c.num_slots, self.mesh_spec.data)  # S' cache rows: S + scratch, padded to `data`
        pool_rows = padded_slots(c.pool_pages - 1, self.mesh_spec.data)  # I' pages, padded to `data`
        return DecodeState(
            cache=init_paged_cache(self._cache_config, pool_rows, c.page_size, slot_rows - 1),
            pending=jnp.zeros((s1,), jnp.int32),
            history=jnp.zeros((s1, c.max_len), jnp.int32),
            n_generated=jnp.zeros((s1,), jnp.int32),
            params=SlotParams(temperature=jnp.zeros((s1,), jnp.float32), top_p=jnp.ones((s1,), jnp.float32),
                              top_k=jnp.zeros((s1,), jnp.int32), seed=jnp.zeros((s1,), jnp.int32)),
            proposer=self.proposer.init_state(slot_rows - 1, c.max_len),
        )

    def _state_sharding(self, path: tuple, leaf) -> jax.sharding.NamedSharding:
        """KV cache buffers (the `k` / `v` fields of a cache: the target's pages [I', X, G, H], a draft's slots
        [S', M, G, H]): pages or slots over `data`, and the target's kv heads over `model` (the proposer's cache is
        replicated over `model`); the rest replicated."""
        names = [getattr(entry, "name", None) for entry in path]
        if not ({"k", "v"} & set(names)):
            return self._replicated
        spec = cache_spec(tensor_parallel=names[0] == "cache" and self._placement.layout.groups > 1)
        return jax.sharding.NamedSharding(self.mesh, spec)

    def placed_weights(self) -> tuple[dict[str, jax.Array], tuple[dict[str, jax.Array], ...]]:
        """The target's serving weights as placed on the mesh: embedding / final norm / LM head by name,
        and one dict per layer (jaxspec.models.llama.fuse_layer names)."""
        params, layers = self._params
        return {str(path[-1]): v.value for path, v in params.flat_state() if v.value.size}, layers

    @property
    def scratch_slot(self) -> int:
        return self.menu.num_slots

    # --- compilation ---------------------------------------------------------------

    def shape_keys(self, batch_buckets: Sequence[int] | None = None,
                   k_menu: Sequence[int] | None = None) -> list[ShapeKey]:
        """Every shape of the menu (or of the given batch buckets / k values): steps, prefill
        chunks, and draft catch-up chunks when the proposer tracks context and some k > 0."""
        m = self.menu
        keys: list[ShapeKey] = [*m.step_keys(batch_buckets, k_menu), *m.prefill_keys()]
        if self.proposer.tracks_context and any(k > 0 for k in (k_menu or m.k_menu)):
            keys += m.catch_up_keys()
        return keys

    def _lower(self, key: ShapeKey):
        """The jitted body of one menu shape (jaxspec.engine.step_bodies), lowered with its shardings."""
        i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
        rep, state = self._replicated, self._state_shardings
        params, proposer_params = jax.tree.map(lambda x: x.sharding, (self._params, self._proposer_params))
        if isinstance(key, StepKey):
            host = (rep,) if self.proposer.host_proposals else ()  # host proposals: one more input
            fn = jax.jit(self.bodies.step(key.k, key.window), donate_argnums=(2,),
                         in_shardings=(params, proposer_params, state, rep, rep, rep, *host),
                         out_shardings=self._outputs(state))
            return fn.lower(self._params, self._proposer_params, self.state, i32(key.batch), i32(key.batch),
                            i32(key.batch, self.menu.pages_for(key.window)),
                            *self._host_inputs(key.batch, key.k, spec=True))
        if isinstance(key, CatchUpKey):
            fn = jax.jit(self.bodies.catch_up(key.chunk, key.window), donate_argnums=(1,),
                         in_shardings=(proposer_params, state, rep, rep, rep), out_shardings=state)
            return fn.lower(self._proposer_params, self.state, i32(1), i32(1), i32(1))
        if isinstance(key, PrefillKey):
            fn = jax.jit(self.bodies.prefill(key.chunk, key.window), donate_argnums=(2,),
                         in_shardings=(params, proposer_params, state, rep), out_shardings=self._outputs(state))
            return fn.lower(self._params, self._proposer_params, self.state,
                            PrefillInputs.spec(key.chunk, self.menu.pages_for(key.window), self.menu.max_len))
        raise TypeError(f"not a shape key: {key!r}")

    def _outputs(self, state) -> tuple:
        """Output shardings of a step or prefill: (state, packed[, logprobs])."""
        return (state, self._replicated, self._replicated) if self.logprobs else (state, self._replicated)

    def warmup(self, keys: Sequence[ShapeKey] | None = None, progress: bool = True, workers: int | None = None) -> int:
        """Compile the menu ahead of time (`workers` threads: jaxspec.engine.executables) and run each new shape
        once (`_run_once`). Any failure raises. Returns the number compiled."""
        return self.executables.warmup(keys or self.shape_keys(), self._run_once, progress, workers)

    def _run_once(self, key: ShapeKey) -> None:
        """Run a new executable once on the scratch slot (every row of it), touching no request's slot. The
        first run of an executable pays one-time setup (0.25–0.4 s for a B = 8 step on XLA:CPU): left to
        serving, it lands in a request's latency and in the cost model's evidence for that shape."""
        fn, scratch = self.executables.get(key), np.full((1,), self.scratch_slot, np.int32)
        zero = np.zeros((1,), np.int32)
        if isinstance(key, StepKey):  # padding rows: the scratch slot (and page), proposing nothing
            rows = np.full((key.batch,), self.scratch_slot, np.int32)
            self.state = fn(self._params, self._proposer_params, self.state, rows, np.zeros_like(rows),
                            self.pages.block_table(rows, key.window), *self._host_inputs(key.batch, key.k))[0]
        elif isinstance(key, CatchUpKey):
            self.state = fn(self._proposer_params, self.state, scratch, zero, zero)
        else:  # PrefillKey: one token at position 0 of the scratch slot, not the prompt's last chunk
            chunk_in = PrefillInputs(slot=scratch, tokens=np.zeros((1, key.chunk), np.int32), start=zero,
                                     n_valid=np.ones((1,), np.int32), is_last=np.bool_(False),
                                     temperature=np.zeros((1,), np.float32), top_p=np.ones((1,), np.float32),
                                     top_k=zero, seed=zero, block_table=self.pages.block_table(scratch, key.window),
                                     prefix=np.zeros((1, self.menu.max_len), np.int32), n_prefix=zero, generated=zero)
            self.state = fn(self._params, self._proposer_params, self.state, chunk_in)[0]
        jax.block_until_ready(self.state)

    def compiled_text(self, key: ShapeKey) -> str:
        """The optimised HLO of a warmed-up shape (what runs on the device, collectives included)."""
        return self.executables.get(key).as_text()

    def run_step_executable(self, key: StepKey, slot_ids: np.ndarray, caps: np.ndarray) -> jax.Array:
        """Run the compiled step `key` on slot ids [B] with caps [B] (padding rows: the scratch slot) and nothing
        else: no catch-up, no host mirrors. Returns the packed result [B, k+4] on the device, not copied (for
        benchmarks that time the executable alone: jaxspec.bench.floor, benchmarks/host_overhead.py)."""
        slot_ids, caps = np.asarray(slot_ids, np.int32), np.asarray(caps, np.int32)
        real = slot_ids != self.scratch_slot
        self.pages.grow(slot_ids[real], self._mirror.bound(slot_ids[real]) + caps[real] + 1)
        self.state, packed = self.executables.get(key)(self._params, self._proposer_params, self.state, slot_ids,
                                                      caps, self.pages.block_table(slot_ids, key.window),
                                                      *self._host_inputs(key.batch, key.k))[:2]
        return packed

    def _host_inputs(self, batch: int, k: int, proposals: HostProposals | None = None, spec: bool = False) -> tuple:
        """The step's host-proposal input for a proposer with `host_proposals` (else none): `proposals` ([n, ≥ k]
        per row, n ≤ batch) cut to k columns and padded to `batch` rows proposing nothing; zeros when None;
        abstract shapes with `spec`."""
        if not self.proposer.host_proposals:
            return ()
        if spec:
            i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
            return (HostProposals(token_ids=i32(batch, k), lens=i32(batch), parents=i32(batch, k),
                                  depth=i32(batch, k)),)
        padded = HostProposals(token_ids=np.zeros((batch, k), np.int32), lens=np.zeros((batch,), np.int32),
                               parents=np.zeros((batch, k), np.int32), depth=np.zeros((batch, k), np.int32))
        if proposals is not None:
            n = len(proposals.lens)
            for name in ("token_ids", "parents", "depth"):  # [n, ≥ k] -> [B, k]
                values = np.asarray(getattr(proposals, name), np.int32)
                if values.shape[0] != n or values.shape[1] < k:
                    raise ValueError(f"host proposals' {name} has shape {values.shape}; need ({n}, >= {k})")
                getattr(padded, name)[:n] = values[:, :k]
            padded.lens[:n] = np.minimum(np.asarray(proposals.lens, np.int32), k)
        return (padded,)

    def set_length(self, slot: int, length: int) -> None:
        """Set a slot's committed length on the device and in the host mirror (positions past it are ignored
        and overwritten): a benchmark holds a slot at one context this way."""
        self.pages.grow([slot], [length])
        lengths = self.state.cache.lengths.at[slot].set(length)  # [S'+1]
        self.state = dataclasses.replace(self.state, cache=dataclasses.replace(self.state.cache, lengths=lengths))
        self.lengths[slot] = length

    # --- the contract ----------------------------------------------------------------

    def admit(self, slot: int, prompt: Sequence[int]) -> int | None:
        """Give `slot` (emptied first) the pages of `prompt`, sharing its cached prefix (jaxspec.engine.pages).
        Returns the prompt tokens served from the prefix cache (prefill starts there), or None when the pool cannot
        hold the prompt now."""
        self.free(slot)
        return self.pages.admit(slot, prompt)

    def clear_prefix_cache(self) -> None:
        """Forget every cached prompt prefix (benchmark runs that must start alike; jaxspec.engine.pages)."""
        self.pages.clear_prefix_cache()

    def page_stats(self) -> PageStats:
        """The target's pool: pages in use, cached for reuse, free."""
        return self.pages.stats()

    def prefill_chunk(self, slot: int, tokens: np.ndarray, start: int, is_last: bool,
                      params: SamplingParams, seed: int, generated: int = 0) -> int | None:
        """Prefill `tokens` of a prompt into `slot` at positions start..; on the last chunk
        returns the request's next token (else None): its token number `generated` (0, or what a preempted
        request had generated before its prompt was recomputed). Returns once the chunk has run. A chunk at
        0 starts a new prompt; a chunk at `admit`'s cached count continues the shared prefix."""
        n = len(tokens)
        if start + n > self.menu.max_len:
            raise CapacityError(f"prompt of {start + n} tokens exceeds max_len {self.menu.max_len}")
        key = self.menu.prefill_key(start, n)
        prefix = np.zeros((1, self.menu.max_len), np.int32)  # [1, M]: a shared prefix's tokens, for the history
        cached = self.pages.cached_prefix(slot) if start > 0 else ()
        prefix[0, :len(cached)] = cached
        self.pages.write_prompt(slot, tokens, start)
        padded = np.zeros((1, key.chunk), np.int32)  # [1, C]
        padded[0, :n] = tokens
        chunk_in = PrefillInputs(
            slot=np.array([slot], np.int32), tokens=padded, start=np.array([start], np.int32),
            n_valid=np.array([n], np.int32), is_last=np.bool_(is_last),
            temperature=np.array([params.temperature], np.float32), top_p=np.array([params.top_p], np.float32),
            top_k=np.array([params.top_k], np.int32), seed=np.array([seed], np.int32),
            block_table=self.pages.block_table([slot], key.window), prefix=prefix,
            n_prefix=np.array([len(cached)], np.int32), generated=np.array([generated], np.int32))
        self.state, first, *logprobs = self.executables.get(key)(self._params, self._proposer_params, self.state,
                                                                 chunk_in)
        self.pages.publish(slot)
        self.lengths[slot] = start + n
        if start == 0 or cached:  # a new prompt: the draft has seen none of it (it catches up before speculating)
            self.proposer_lengths[slot] = 0
            self._draft_ran[slot] = False
        if not is_last:
            # a chunk is done when this returns, like the last one (whose token is read back): left in
            # flight, its compute would land in the next step's timing and the cost model would charge
            # a 64-token prefill to a decode shape (docs/design.md, "The goodput policy").
            jax.block_until_ready(self.state)
            return None
        first = int(np.asarray(first)[0])
        if logprobs:  # values [1, 1, 1+N], ids [1, 1, N]
            values, ids = (np.asarray(a)[0, 0] for a in logprobs[0])
            self._first_logprobs[slot] = token_logprobs(first, values[0], ids, values[1:], self.logprobs)
        return first

    def first_token_logprobs(self, slot: int) -> TokenLogprobs:
        """The log-probabilities of the first token the slot's last prefill drew (engines with logprobs > 0)."""
        if slot not in self._first_logprobs:
            raise ValueError(f"no log-probabilities for slot {slot}: the engine's logprobs option is 0, or the slot "
                             "has no finished prefill")
        return self._first_logprobs[slot]

    def prefill(self, slot: int, prompt: Sequence[int], params: SamplingParams, seed: int | None = None) -> int:
        """Whole-prompt prefill (`engine_api.prefill_prompt`). Returns the first token.
        The PRNG seed is `seed`, else `params.seed`, else 0."""
        if not prompt:
            raise ValueError("empty prompt")
        seed = seed if seed is not None else (params.seed if params.seed is not None else 0)
        return prefill_prompt(self, slot, prompt, params, seed)

    def step(self, slot_ids: Sequence[int], k: int, row_k: Sequence[int] | None = None,
             host_proposals: Callable[[int, TreeEnvelope | None], HostProposals] | None = None) -> StepResult:
        """One speculative step (k = 0: plain decoding) for the given slots: `dispatch_step(...).result()`."""
        return self.dispatch_step(slot_ids, k, row_k, host_proposals).result()

    def dispatch_step(self, slot_ids: Sequence[int], k: int, row_k: Sequence[int] | None = None,
                      host_proposals: Callable[[int, TreeEnvelope | None], HostProposals] | None = None,
                      proposals_ahead: bool = False) -> DispatchedStep:
        """Start one speculative step (k = 0: plain decoding) for the given slots; returns without waiting.

        Row i verifies at most min(k, row_k[i]) proposals. The step runs at the shape `Menu.step_shape` gives
        for each row's length bound (`length`: exact when no step is in flight, else the read length plus
        cap + 1 per unread step) and cap: the smallest menu k ≥ every row's cap (rows all capped at 0 run the
        k = 0 executable, without draft catch-up) and the window of max(bound + cap) + 1. A speculating step
        of a context-tracking draft first reads the steps in flight when a row's catch-up depends on what they
        commit (its last step ran k = 0) or a catch-up is to run (it is timed on its own); behind a speculating
        step its rows' drafts are in step, and it is dispatched without a read (docs/design.md, "The overlapped
        loop").

        A proposer with `host_proposals` needs `host_proposals(k_run, tree)`: each row's proposals ([n, k_run]
        numpy arrays; a tree inside the envelope `tree` when the step runs one), called once the step's shape is
        known and only when k_run > 0, after the steps in flight are read (the proposals continue what they
        committed) unless `proposals_ahead` says the chains were made for the context the steps in flight are
        guessed to commit (the overlapped loop; docs/design.md, "The overlapped loop"): any proposal is only a
        guess the step verifies, so a wrong one costs acceptance, never output. A tree step reads them always."""
        slots = [int(s) for s in slot_ids]
        n = len(slots)
        b = self.menu.batch_bucket(n)
        shape = self.menu.step_shape(self._mirror.bound(slots), row_k, k)
        catch_up_calls, catch_up_tokens, catch_up_s = 0, 0, 0.0
        if shape.k > 0 and self.proposer.tracks_context:
            unread = bool(self._in_flight)
            if unread and self._catch_up_unknown(slots):
                self.settle()
            plans = [(slot, self.catch_up_plan(slot)) for slot in slots]  # exact: no row's depends on a step unread
            if self._in_flight and any(plan for _, plan in plans):  # timed on its own, not with a step in flight
                self.settle()
            if unread and not self._in_flight:  # read: the exact lengths may give a smaller window
                shape = self.menu.step_shape(self._mirror.bound(slots), row_k, k)
            fn = self.executables.get(StepKey(b, shape.k, shape.window))  # a miss raises before any catch-up
            catch_up_tokens = sum(call.key.chunk for _, plan in plans for call in plan)
            started = time.perf_counter()
            catch_up_calls = self._run_catch_up(plans)
            if catch_up_calls:
                jax.block_until_ready(self.state)  # time the catch-up apart from the step
                catch_up_s = time.perf_counter() - started
                self.catch_up_totals.add(catch_up_calls, catch_up_s)
        else:
            fn = self.executables.get(StepKey(b, shape.k, shape.window))
        host = None
        if self.proposer.host_proposals and shape.k > 0:
            if host_proposals is None:
                raise ValueError(f"the {self.proposer.name!r} proposer proposes on the host: step() needs "
                                 f"host_proposals")
            tree = self.menu.tree_at(shape.k)
            if self._mirror.unread[slots].any() and (tree is not None or not proposals_ahead):
                self.settle()
                shape = self.menu.step_shape(self._mirror.bound(slots), row_k, k)
                fn = self.executables.get(StepKey(b, shape.k, shape.window))
                tree = self.menu.tree_at(shape.k)
            host = host_proposals(shape.k, tree)
        # the pages the step may write: each row's k + 1 positions past its bound (raises before anything runs)
        self.pages.grow(slots, self._mirror.bound(slots) + np.asarray(shape.caps, np.int64) + 1)
        caps = np.zeros((b,), np.int32)  # [B] padding rows (scratch slot) propose nothing
        caps[:n] = shape.caps
        padded = np.full((b,), self.scratch_slot, np.int32)  # [B]
        padded[:n] = slots
        self.state, packed, *logprobs = fn(self._params, self._proposer_params, self.state, padded, caps,
                                           self.pages.block_table(padded, shape.window),
                                           *self._host_inputs(b, shape.k, host))
        epochs = self._mirror.dispatched(slots, shape.caps)
        self._draft_ran[slots] = shape.k > 0
        step = DispatchedStep(self, slots, epochs, np.asarray(shape.caps, np.int64), shape.k, packed,
                              catch_up_calls, catch_up_tokens, catch_up_s, logprobs[0] if logprobs else None)
        self._in_flight.append(step)
        return step

    def settle(self) -> None:
        """Read every step in flight (the host mirrors are then exact)."""
        if self._in_flight:
            self._in_flight[-1].result()

    def _read_through(self, step: DispatchedStep) -> None:
        """Read the steps in flight up to `step` in dispatch order (or `step` alone if it is no longer in flight:
        dropped by `reset`), setting each one's result."""
        if step not in self._in_flight:
            step.done = self._read(step)
            return
        while self._in_flight:
            first = self._in_flight.pop(0)
            first.done = self._read(first)
            if first is step:
                return

    def _read(self, step: DispatchedStep) -> StepResult:
        """The one host copy of a step; applies its counts to the rows whose slots were not freed meanwhile."""
        n, k_run = len(step.slots), step.k_run
        packed = np.asarray(step.packed)[:n]  # [n, k+4]: waits for the step
        result = StepResult(tokens=packed[:, : k_run + 1], counts=packed[:, k_run + 1], proposed=packed[:, k_run + 2],
                            catch_up_calls=step.catch_up_calls, catch_up_s=step.catch_up_s,
                            catch_up_tokens=step.catch_up_tokens)
        current = self._mirror.read(step.slots, step.epochs, step.caps, result.counts)  # [n]
        if step.logprobs is not None:  # values [B, k+1, 1+N], ids [B, k+1, N]
            values, ids = (np.asarray(x)[:n] for x in step.logprobs)
            result = dataclasses.replace(result, logprobs=values[:, :, 0], top_logprobs=values[:, :, 1:], top_ids=ids)
        if self.proposer.tracks_context:  # what the draft holds now, as its commit left it
            self.proposer_lengths[np.asarray(step.slots)[current]] = packed[current, k_run + 3]
        return result

    def catch_up_plan(self, slot: int) -> list[CatchUpCall]:
        """The catch-up calls a speculating step would first run for this slot: committed tokens
        the proposer missed during k = 0 steps, in catch-up chunks, until only what `propose` feeds itself is
        left ([] if none). With steps in flight it is exact when the slot's last step ran the draft (nothing
        to catch up), else a bound (`length` is)."""
        if not self.proposer.tracks_context or (self._mirror.unread[slot] and self._draft_ran[slot]):
            return []
        return self.menu.catch_up_plan(int(self.proposer_lengths[slot]), self.length(slot),
                                       self.proposer.in_step_catch_up)

    def _catch_up_unknown(self, slots: Sequence[int]) -> bool:
        """Whether some slot's catch-up depends on steps in flight: its last step, unread, ran k = 0 (the draft
        did not run, and how far it fell behind is what the step commits). After a step that ran the draft the
        draft holds all but at most `in_step_catch_up` - 1 committed tokens, whatever the step accepted
        (`Proposer.commit`), so its plan is empty."""
        return bool((self._mirror.unread[slots] > 0)[~self._draft_ran[slots]].any())

    def catch_up(self, slot_ids: Sequence[int]) -> int:
        """Run every slot's catch-up plan (what a speculating step runs first); returns the number of calls."""
        return self._run_catch_up([(slot, self.catch_up_plan(slot)) for slot in slot_ids])

    def _run_catch_up(self, plans: Sequence[tuple[int, list[CatchUpCall]]]) -> int:
        """Run (slot, its catch-up plan) pairs; returns the number of calls."""
        calls = 0
        for slot, plan in plans:
            for call in plan:
                run = self.executables.get(call.key)
                self.state = run(self._proposer_params, self.state, np.array([slot], np.int32),
                                 np.array([call.start], np.int32), np.array([call.n], np.int32))
                self.proposer_lengths[slot] = call.start + call.n
                calls += 1
        return calls

    def length(self, slot: int) -> int:
        """Committed tokens of `slot`: exact with no step in flight, else an upper bound (`dispatch_step`)."""
        return int(self._mirror.bound([slot])[0])

    def room(self, slot: int) -> int:
        return self.menu.room(self.length(slot))

    def state_lost(self) -> bool:
        """True if a failed call consumed (donated) the device state."""
        return any(getattr(x, "is_deleted", lambda: False)() for x in jax.tree.leaves(self.state))

    def reset(self) -> None:
        """Empty every slot with fresh device state (e.g. after a failed call left the donated
        state invalid). Compiled executables are kept."""
        self.state = self._init_state()
        self._in_flight.clear()  # their results can still be read; they no longer touch any slot
        self._mirror.reset()
        self.pages.reset()  # the fresh pool holds no prefix
        self.proposer_lengths[:] = 0
        self._draft_ran[:] = False
        self._first_logprobs.clear()

    def free(self, slot: int) -> None:
        """Forget a slot's contents (the next prefill overwrites it). A step in flight that holds the slot
        still runs; reading it leaves the slot alone."""
        self._mirror.free(slot)
        self.pages.release(slot)  # a step in flight that wrote its pages ran before any later call that reuses them
        self.proposer_lengths[slot] = 0
        self._draft_ran[slot] = False
        self._first_logprobs.pop(slot, None)



@dataclasses.dataclass(eq=False)
class DispatchedStep:
    """A step `Engine.dispatch_step` started (a `jaxspec.engine.pending.PendingStep`).

    slots [n], epochs [n] (the slots' epochs at dispatch), caps [n], k_run: the step's rows and shape;
    packed: [B, k_run+4] on the device, read by the first `result()` (with `logprobs` when the engine has them)."""

    engine: Engine
    slots: list[int]
    epochs: np.ndarray
    caps: np.ndarray
    k_run: int
    packed: jax.Array
    catch_up_calls: int
    catch_up_tokens: int  # the catch-up chunks' padded tokens
    catch_up_s: float
    logprobs: tuple[jax.Array, jax.Array] | None  # (values [B, k+1, 1+N], ids [B, k+1, N]) with logprobs N > 0
    done: StepResult | None = None

    def result(self) -> StepResult:
        if self.done is None:
            self.engine._read_through(self)
        return self.done
