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
from flax import nnx
from tqdm import tqdm

from jaxspec.engine.api import prefill_prompt
from jaxspec.menu import CapacityError, CatchUpCall, CatchUpKey, Menu, MenuMissError, PrefillKey, ShapeKey, StepKey
from jaxspec.mesh import MeshSpec, make_mesh
from jaxspec.models.cache_attention import kernel_allowed, reads_cache_in_place
from jaxspec.models.kv_cache import init_cache
from jaxspec.models.llama import Llama, StepInputs, chain_inputs, serving_split
from jaxspec.models.sharding import cache_spec, padded_slots, plan_layout, replicated_layout, serving_placement
from jaxspec.speculation import sampling
from jaxspec.speculation import tree as tree_lib
from jaxspec.speculation.proposers.base import NoProposer, Proposer, StepContext, empty_proposals
from jaxspec.speculation.verify import RESIDUAL_KEY, verify, verify_tree
from jaxspec.types import DecodeState, RowParams, SamplingParams, SlotParams, StepResult


def enable_compilation_cache(path: str | None = None) -> str:
    """Turn on JAX's persistent compilation cache (restarts skip recompiling the menu)."""
    path = path or os.environ.get("JAXSPEC_COMPILATION_CACHE",
                                  os.path.join(os.path.expanduser("~"), ".cache", "jaxspec", "xla"))
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PrefillInputs:
    """One prompt chunk for one slot, as the prefill executable takes it.

    slot, start, n_valid: [1] int32 (cache slot, first position, real tokens in the chunk);
    tokens: [1, C] int32 (padded past n_valid); is_last: [] bool (the prompt's last chunk: draw
    the first token); temperature, top_p: [1] float32; top_k, seed: [1] int32.
    """

    slot: jax.Array
    tokens: jax.Array
    start: jax.Array
    n_valid: jax.Array
    is_last: jax.Array
    temperature: jax.Array
    top_p: jax.Array
    top_k: jax.Array
    seed: jax.Array

    @classmethod
    def spec(cls, chunk: int) -> PrefillInputs:
        """Abstract shapes for compiling the chunk-C executable."""
        i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
        f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
        return cls(slot=i32(1), tokens=i32(1, chunk), start=i32(1), n_valid=i32(1),
                   is_last=jax.ShapeDtypeStruct((), jnp.bool_), temperature=f32(1), top_p=f32(1), top_k=i32(1),
                   seed=i32(1))


@dataclasses.dataclass
class CatchUpTotals:
    """Running totals of lazy draft catch-up (calls, wall seconds) since the engine started."""

    calls: int = 0
    seconds: float = 0.0

    def add(self, calls: int, seconds: float) -> None:
        self.calls += calls
        self.seconds += seconds


class Engine:
    """Owns the device state and the compiled menu for one target (+ proposer); an `EngineAPI`."""

    def __init__(self, target: Llama, proposer: Proposer | None = None, menu: Menu = Menu(),
                 mesh: MeshSpec = MeshSpec()):
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
        draft_config = getattr(self.proposer, "config", None)
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
        # the layers' matmul weights as column panels on XLA:CPU (jaxspec/models/panel_matmul.py; docs/design.md,
        # "Matmuls on XLA:CPU"): a model loaded for another placement is refused by serving_split
        self._placement = serving_placement(self.mesh, layout, target.config.dtype)
        self._replicated = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
        self._cache_config = target.config.replace(num_kv_heads=layout.kv_heads_for(target.config))
        # per-layer weight arrays (unrolled layers, no per-step slice copies), stored once
        self._graphdef, self._params = serving_split(target, self._placement)
        # weights in column panels: the tied LM head reads the embedding with the table kernel too (batch-invariant
        # logits; docs/design.md, "Matmuls on XLA:CPU")
        self.table_head = self._placement.panels and target.config.tie_embeddings
        # the proposer's layers are replicated (small); an embedding it shares with the target stays the target's
        self.proposer_placement = serving_placement(self.mesh, replicated_layout(target.config, mesh.model),
                                                    target.config.dtype)
        self._proposer_params = self.proposer.params(self.proposer_placement)
        self._executables: dict[ShapeKey, Callable] = {}
        self.lengths = np.zeros(menu.num_slots, np.int64)  # host mirror of committed lengths
        self.proposer_lengths = np.zeros(menu.num_slots, np.int64)  # host mirror: what the proposer saw
        self.catch_up_totals = CatchUpTotals()
        self._state_shardings = jax.tree_util.tree_map_with_path(self._state_sharding,
                                                                 jax.eval_shape(self._fresh_state))
        self._init_state = jax.jit(self._fresh_state, out_shardings=self._state_shardings)
        self.state = self._init_state()
        # steps read the cache in place on XLA:CPU (jaxspec/models/cache_attention.py); decided here (inside
        # `xla_form_only`: 'xla') and held for every executable `_compile` traces
        self.attention = "cache-kernel" if reads_cache_in_place(self.state.cache.k[0], 1) else "xla"

    # --- state ---------------------------------------------------------------------

    def _fresh_state(self) -> DecodeState:
        """Empty device state (traced under jit with the state's shardings as its output shardings)."""
        c = self.menu
        s1 = c.num_slots + 1
        slot_rows = padded_slots(c.num_slots, self.mesh_spec.data)  # S' cache rows: S + scratch, padded to `data`
        return DecodeState(
            cache=init_cache(self._cache_config, slot_rows - 1, c.max_len),
            pending=jnp.zeros((s1,), jnp.int32),
            history=jnp.zeros((s1, c.max_len), jnp.int32),
            n_generated=jnp.zeros((s1,), jnp.int32),
            params=SlotParams(temperature=jnp.zeros((s1,), jnp.float32), top_p=jnp.ones((s1,), jnp.float32),
                              top_k=jnp.zeros((s1,), jnp.int32), seed=jnp.zeros((s1,), jnp.int32)),
            proposer=self.proposer.init_state(slot_rows - 1, c.max_len),
        )

    def _state_sharding(self, path: tuple, leaf) -> jax.sharding.NamedSharding:
        """KV cache buffers (the `k` / `v` fields of a KVCache, [S', M, G, H]): slots over `data`, and the
        target's kv heads over `model` (the proposer's cache is replicated over `model`); the rest replicated."""
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

    # --- traced bodies -------------------------------------------------------------

    def _rows(self, state: DecodeState, slot_ids: jax.Array) -> RowParams:
        p = state.params
        return RowParams(temperature=p.temperature[slot_ids], top_p=p.top_p[slot_ids], top_k=p.top_k[slot_ids],
                         keys=sampling.row_keys(p.seed[slot_ids], state.n_generated[slot_ids]))

    def _step_body(self, k: int, window: int):
        proposer = self.proposer
        scratch = self.scratch_slot
        tree = self.menu.tree_at(k)

        def body(target_params, proposer_params, state: DecodeState, slot_ids, row_k):
            target, layers = nnx.merge(self._graphdef, target_params[0]), target_params[1]
            b = slot_ids.shape[0]
            start = state.cache.lengths[slot_ids]  # [B]
            pending = state.pending[slot_ids]  # [B]
            ctx = StepContext(slot_ids=slot_ids, start=start, history=state.history, rows=self._rows(state, slot_ids))
            if tree is not None:  # a token tree of k nodes (jaxspec/speculation/tree.py)
                nodes, pstate = proposer.propose_tree(proposer_params, state.proposer, ctx, tree, window)
                # row b verifies nodes 1 .. min(lens, row_k[b]): a parent-closed prefix at most that deep
                valid = jnp.arange(k)[None, :] < jnp.minimum(nodes.lens, row_k)[:, None]  # [B, k]
                rooted = tree_lib.with_root(nodes, valid)  # tokens, parents, depth: [B, k+1]
                logits, cache = target.forward_cached(
                    tree_lib.tree_inputs(pending, rooted, slot_ids, start, tree.depth), state.cache, window,
                    layers=layers)  # [B, k+1, V]
                out, counts, path = verify_tree(logits, *rooted, ctx.rows, tree.depth)
                cache = tree_lib.compact(cache, slot_ids, start, path)  # the accepted path where a chain has it
                proposed = jnp.sum(valid, axis=1).astype(jnp.int32)  # [B]
            else:
                if k > 0:
                    proposals, pstate = proposer.propose(proposer_params, state.proposer, ctx, k, window)
                    # per-request k: row b verifies at most row_k[b] proposals
                    proposals = dataclasses.replace(proposals, lens=jnp.minimum(proposals.lens, row_k))
                else:  # plain decoding: the proposer's state is left alone (caught up lazily)
                    proposals = empty_proposals(b)
                    pstate = state.proposer
                # tokens_in: [B, k+1] = pending then the proposals
                tokens_in = jnp.concatenate([pending[:, None], proposals.token_ids], axis=1)
                hidden, features, cache = self._target_pass(target, chain_inputs(tokens_in, slot_ids, start),
                                                            state.cache, window, layers)  # [B, k+1, D], [B, k+1, n·D]
                logits = target.unembed(hidden, self.table_head)  # [B, k+1, V]
                out, counts = verify(logits, proposals, ctx.rows)  # [B, k+1], [B]
                proposed = proposals.lens
                if proposer.feature_layers:  # every committed position's feature, k = 0 included
                    pstate = proposer.record_features(pstate, slot_ids, start, features)

            new_len = start + counts
            cache = cache.with_lengths(slot_ids, new_len)
            cache = cache.with_lengths(jnp.array([scratch]), jnp.zeros((1,), jnp.int32))
            new_pending = jnp.take_along_axis(out, (counts - 1)[:, None], axis=1)[:, 0]  # [B]
            # history[slot, start+1+j] = out[:, j]  (entries past counts are overwritten later)
            hist_pos = start[:, None] + 1 + jnp.arange(k + 1, dtype=jnp.int32)[None, :]  # [B, k+1]
            history = state.history.at[slot_ids[:, None], hist_pos].set(out, mode="drop")
            if tree is not None:
                pstate = proposer.commit_tree(proposer_params, pstate, dataclasses.replace(ctx, history=history),
                                              nodes, path, counts - 1, window)
            elif k > 0:
                pstate = proposer.commit(proposer_params, pstate, dataclasses.replace(ctx, history=history), k,
                                         counts - 1, window)
            new_state = DecodeState(
                cache=cache,
                pending=state.pending.at[slot_ids].set(new_pending),
                history=history,
                n_generated=state.n_generated.at[slot_ids].add(counts),
                params=state.params,
                proposer=pstate,
            )
            # packed: [B, k+4] = tokens | count | proposed | proposer's context length  (one host copy per step)
            packed = jnp.concatenate([out, counts[:, None], proposed[:, None],
                                      proposer.context_lengths(pstate, slot_ids)[:, None]], axis=1)
            return new_state, packed

        return body

    def _target_pass(self, target, inputs: StepInputs, cache, window: int, layers):
        """The target over `inputs`: (hidden [B, T, D], the proposer's features [B, T, n·D] or None, cache)."""
        if self.proposer.feature_layers:
            return target.forward_cached_features(inputs, cache, window, self.proposer.feature_layers, layers=layers)
        hidden, cache = target.forward_cached_hidden(inputs, cache, window, layers=layers)
        return hidden, None, cache

    def _prefill_body(self, chunk: int, window: int):
        proposer = self.proposer

        def body(target_params, proposer_params, state: DecodeState, chunk_in: PrefillInputs):
            slot, tokens, start, n_valid, is_last = (chunk_in.slot, chunk_in.tokens, chunk_in.start,
                                                     chunk_in.n_valid, chunk_in.is_last)  # see PrefillInputs
            temperature, top_p, top_k, seed = chunk_in.temperature, chunk_in.top_p, chunk_in.top_k, chunk_in.seed
            target, layers = nnx.merge(self._graphdef, target_params[0]), target_params[1]
            params = SlotParams(temperature=state.params.temperature.at[slot].set(temperature),
                                top_p=state.params.top_p.at[slot].set(top_p),
                                top_k=state.params.top_k.at[slot].set(top_k),
                                seed=state.params.seed.at[slot].set(seed))
            inputs = chain_inputs(tokens, slot, start)
            hidden, features, cache = self._target_pass(target, inputs, state.cache, window, layers)  # [1, C, D|n·D]
            # logits: [1, 1, V] after the chunk's last real token
            logits = target.unembed(jnp.take_along_axis(hidden, (n_valid - 1)[:, None, None], axis=1), self.table_head)
            cache = cache.with_lengths(slot, start + n_valid)
            pstate = state.proposer
            if proposer.feature_layers:  # stored for the draft's catch-up (it reads them)
                pstate = proposer.record_features(pstate, slot, start, features)
            if proposer.tracks_context:  # a draft sees the prompt lazily (catch-up): it holds nothing yet
                pstate = proposer.forget(pstate, slot)
            else:
                pstate = proposer.prefill(proposer_params, pstate, inputs, n_valid, window)
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

    def shape_keys(self, batch_buckets: Sequence[int] | None = None,
                   k_menu: Sequence[int] | None = None) -> list[ShapeKey]:
        """Every shape of the menu (or of the given batch buckets / k values): steps, prefill
        chunks, and draft catch-up chunks when the proposer tracks context and some k > 0."""
        m = self.menu
        keys: list[ShapeKey] = [*m.step_keys(batch_buckets, k_menu), *m.prefill_keys()]
        if self.proposer.tracks_context and any(k > 0 for k in (k_menu or m.k_menu)):
            keys += m.catch_up_keys()
        return keys

    def _compile(self, key: ShapeKey) -> Callable:
        """One menu executable, with explicit input and output shardings (state in = state out)."""
        with kernel_allowed(self.attention == "cache-kernel"):  # the form chosen in __init__, wherever compiled
            return self._lower(key).compile()

    def _lower(self, key: ShapeKey):
        """The jitted body of one menu shape, lowered with its shardings (not yet compiled)."""
        i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
        rep, state = self._replicated, self._state_shardings
        params, proposer_params = jax.tree.map(lambda x: x.sharding, (self._params, self._proposer_params))
        if isinstance(key, StepKey):
            fn = jax.jit(self._step_body(key.k, key.window), donate_argnums=(2,),
                         in_shardings=(params, proposer_params, state, rep, rep), out_shardings=(state, rep))
            lowered = fn.lower(self._params, self._proposer_params, self.state, i32(key.batch), i32(key.batch))
        elif isinstance(key, CatchUpKey):
            fn = jax.jit(self._catch_up_body(key.chunk, key.window), donate_argnums=(1,),
                         in_shardings=(proposer_params, state, rep, rep, rep), out_shardings=state)
            lowered = fn.lower(self._proposer_params, self.state, i32(1), i32(1), i32(1))
        elif isinstance(key, PrefillKey):
            fn = jax.jit(self._prefill_body(key.chunk, key.window), donate_argnums=(2,),
                         in_shardings=(params, proposer_params, state, rep), out_shardings=(state, rep))
            lowered = fn.lower(self._params, self._proposer_params, self.state, PrefillInputs.spec(key.chunk))
        else:
            raise TypeError(f"not a shape key: {key!r}")
        return lowered

    def warmup(self, keys: Sequence[ShapeKey] | None = None, progress: bool = True) -> int:
        """Compile the menu ahead of time and run each new shape once (`_run_once`). Any failure raises.
        Returns the number compiled."""
        keys = [k for k in (keys or self.shape_keys()) if k not in self._executables]
        for key in tqdm(keys, desc="compiling menu", unit="shape", disable=not progress or not keys,
                        leave=False):
            try:
                self._executables[key] = self._compile(key)
                self._run_once(key)
            except Exception as exc:  # re-raised with the shape that failed
                raise RuntimeError(f"warming up {key} (compile, first run) failed: {exc}") from exc
        return len(keys)

    def _run_once(self, key: ShapeKey) -> None:
        """Run a new executable once on the scratch slot (every row of it), touching no request's slot. The
        first run of an executable pays one-time setup (0.25–0.4 s for a B = 8 step on XLA:CPU): left to
        serving, it lands in a request's latency and in the cost model's evidence for that shape."""
        fn, scratch = self._executables[key], np.full((1,), self.scratch_slot, np.int32)
        zero = np.zeros((1,), np.int32)
        if isinstance(key, StepKey):  # padding rows: the scratch slot, proposing nothing
            rows = np.full((key.batch,), self.scratch_slot, np.int32)
            self.state, _ = fn(self._params, self._proposer_params, self.state, rows, np.zeros_like(rows))
        elif isinstance(key, CatchUpKey):
            self.state = fn(self._proposer_params, self.state, scratch, zero, zero)
        else:  # PrefillKey: one token at position 0 of the scratch slot, not the prompt's last chunk
            chunk_in = PrefillInputs(slot=scratch, tokens=np.zeros((1, key.chunk), np.int32), start=zero,
                                     n_valid=np.ones((1,), np.int32), is_last=np.bool_(False),
                                     temperature=np.zeros((1,), np.float32), top_p=np.ones((1,), np.float32),
                                     top_k=zero, seed=zero)
            self.state, _ = fn(self._params, self._proposer_params, self.state, chunk_in)
        jax.block_until_ready(self.state)

    def compiled_text(self, key: ShapeKey) -> str:
        """The optimised HLO of a warmed-up shape (what runs on the device, collectives included)."""
        return self._executable(key).as_text()

    def _executable(self, key: ShapeKey) -> Callable:
        try:
            return self._executables[key]
        except KeyError:
            m = self.menu
            raise MenuMissError(f"shape {key} was not compiled in warm-up (menu: B={m.batch_buckets}, "
                                f"k={m.k_menu}, W={m.window_buckets}, C={m.prefill_buckets})") from None

    # --- the contract ----------------------------------------------------------------

    def prefill_chunk(self, slot: int, tokens: np.ndarray, start: int, is_last: bool,
                      params: SamplingParams, seed: int) -> int | None:
        """Prefill `tokens` of a prompt into `slot` at positions start..; on the last chunk
        returns the first generated token (else None). Returns once the chunk has run."""
        n = len(tokens)
        if start + n > self.menu.max_len:
            raise CapacityError(f"prompt of {start + n} tokens exceeds max_len {self.menu.max_len}")
        key = self.menu.prefill_key(start, n)
        padded = np.zeros((1, key.chunk), np.int32)  # [1, C]
        padded[0, :n] = tokens
        chunk_in = PrefillInputs(
            slot=np.array([slot], np.int32), tokens=padded, start=np.array([start], np.int32),
            n_valid=np.array([n], np.int32), is_last=np.bool_(is_last),
            temperature=np.array([params.temperature], np.float32), top_p=np.array([params.top_p], np.float32),
            top_k=np.array([params.top_k], np.int32), seed=np.array([seed], np.int32))
        self.state, first = self._executable(key)(self._params, self._proposer_params, self.state, chunk_in)
        self.lengths[slot] = start + n
        if start == 0:  # a new prompt: the draft has seen none of it (it catches up before speculating)
            self.proposer_lengths[slot] = 0
        if not is_last:
            # a chunk is done when this returns, like the last one (whose token is read back): left in
            # flight, its compute would land in the next step's timing and the cost model would charge
            # a 64-token prefill to a decode shape (docs/design.md, "The goodput policy").
            jax.block_until_ready(self.state)
            return None
        return int(np.asarray(first)[0])

    def prefill(self, slot: int, prompt: Sequence[int], params: SamplingParams, seed: int | None = None) -> int:
        """Whole-prompt prefill (`engine_api.prefill_prompt`). Returns the first token.
        The PRNG seed is `seed`, else `params.seed`, else 0."""
        if not prompt:
            raise ValueError("empty prompt")
        seed = seed if seed is not None else (params.seed if params.seed is not None else 0)
        return prefill_prompt(self, slot, prompt, params, seed)

    def step(self, slot_ids: Sequence[int], k: int, row_k: Sequence[int] | None = None) -> StepResult:
        """One speculative step (k = 0: plain decoding) for the given slots.

        Row i verifies at most min(k, row_k[i]) proposals. The step runs at the shape
        `Menu.step_shape` gives: the smallest menu k ≥ every row's cap (rows all capped at 0 run the
        k = 0 executable, without draft catch-up) and the window of each row's own length + cap."""
        n = len(slot_ids)
        b = self.menu.batch_bucket(n)
        shape = self.menu.step_shape(self.lengths[list(slot_ids)], row_k, k)
        k_run = shape.k
        caps = np.zeros((b,), np.int32)  # [B] padding rows (scratch slot) propose nothing
        caps[:n] = shape.caps
        fn = self._executable(StepKey(b, k_run, shape.window))
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
        if self.proposer.tracks_context:  # what the draft holds now, as its commit left it
            self.proposer_lengths[list(slot_ids)] = packed[:, k_run + 3]
        self.lengths[list(slot_ids)] += result.counts
        return result

    def catch_up_plan(self, slot: int) -> list[CatchUpCall]:
        """The catch-up calls a speculating step would first run for this slot: committed tokens
        the proposer missed during k = 0 steps, in prefill-bucket chunks, until only what
        `propose` feeds itself is left ([] if none)."""
        if not self.proposer.tracks_context:
            return []
        return self.menu.catch_up_plan(int(self.proposer_lengths[slot]), int(self.lengths[slot]),
                                       self.proposer.in_step_catch_up)

    def _catch_up(self, slot_ids: Sequence[int]) -> int:
        """Run every slot's catch-up plan; returns the number of calls."""
        calls = 0
        for slot in slot_ids:
            for call in self.catch_up_plan(slot):
                self.state = self._executable(call.key)(self._proposer_params, self.state, np.array([slot], np.int32),
                                                        np.array([call.start], np.int32), np.array([call.n], np.int32))
                self.proposer_lengths[slot] = call.start + call.n
                calls += 1
        return calls

    def length(self, slot: int) -> int:
        return int(self.lengths[slot])

    def room(self, slot: int) -> int:
        return self.menu.room(int(self.lengths[slot]))

    def state_lost(self) -> bool:
        """True if a failed call consumed (donated) the device state."""
        return any(getattr(x, "is_deleted", lambda: False)() for x in jax.tree.leaves(self.state))

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

