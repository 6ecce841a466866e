"""The traced bodies of the engine's executables: one speculative step, one prefill chunk, one draft catch-up.

Each body is a pure function of (weights, device state, inputs) that `jaxspec.engine.executables` lowers and
compiles once per menu shape; the engine (jaxspec.engine.engine) only runs them. docs/design.md, "The speculative
step":

    propose (draft catch-up + k draft steps | n-gram lookup)  ->  d[B, k]
    score   target over [pending, d_1..d_k] at positions len..len+k   ->  logits[B, k+1, V]
    verify  greedy prefix / rejection sampling                ->  tokens[B, k+1], counts[B]
    commit  lengths += counts, pending = last token, history, draft lengths
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxspec.menu import Menu
from jaxspec.models.kernel_plan import KernelPlan
from jaxspec.models.llama import StepInputs, chain_inputs
from jaxspec.speculation import sampling
from jaxspec.speculation import tree as tree_lib
from jaxspec.speculation.proposers.base import Proposer, StepContext, empty_proposals
from jaxspec.speculation.verify import RESIDUAL_KEY, verify, verify_tree
from jaxspec.types import DecodeState, RowParams, SlotParams


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PrefillInputs:
    """One prompt chunk for one slot, as the prefill executable takes it.

    slot, start, n_valid: [1] int32 (cache slot, first position, real tokens in the chunk);
    tokens: [1, C] int32 (padded past n_valid); is_last: [] bool (the prompt's last chunk: draw
    the first token); temperature, top_p: [1] float32; top_k, seed: [1] int32;
    block_table: [1, ceil(W/X)] int32 (the slot's pages);
    prefix: [1, M] int32, n_prefix: [1] int32 (prompt tokens before `start` served from the prefix cache: written
    to the history, 0 when none); generated: [1] int32 (tokens the request generated before: a preempted
    request's prompt holds them, and its next token draws as the plain decode would have).
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
    block_table: jax.Array
    prefix: jax.Array
    n_prefix: jax.Array
    generated: jax.Array

    @classmethod
    def spec(cls, chunk: int, table_width: int, max_len: int) -> PrefillInputs:
        """Abstract shapes for compiling the chunk-C executable (a block table of `table_width` pages)."""
        i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
        f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
        return cls(slot=i32(1), tokens=i32(1, chunk), start=i32(1), n_valid=i32(1),
                   is_last=jax.ShapeDtypeStruct((), jnp.bool_), temperature=f32(1), top_p=f32(1), top_k=i32(1),
                   seed=i32(1), block_table=i32(1, table_width), prefix=i32(1, max_len), n_prefix=i32(1),
                   generated=i32(1))


def emitted_logprobs(logits: jax.Array, tokens: jax.Array, n_top: int) -> tuple[jax.Array, jax.Array]:
    """The target's raw log-probabilities (log_softmax at temperature 1, no top-k / top-p) of emitted tokens:
    logits [B, T, V] (row t scores tokens[:, t]), tokens [B, T] (-1 past the emitted ones) ->
    (values [B, T, 1 + n_top] float32: the token's then its top n_top alternatives', ids [B, T, n_top] int32)."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)  # [B, T, V]
    chosen = jnp.take_along_axis(logp, jnp.maximum(tokens, 0)[..., None], axis=-1)  # [B, T, 1]
    top_values, top_ids = jax.lax.top_k(logp, n_top)  # [B, T, N], [B, T, N]
    return jnp.concatenate([chosen, top_values], axis=-1), top_ids.astype(jnp.int32)


@dataclasses.dataclass(frozen=True, eq=False)
class StepBodies:
    """The bodies for one target (its graph definition) and proposer, traced with one kernel plan. The scratch
    slot (`menu.num_slots`) takes the padding rows of a step and is emptied after every step.

    logprobs: 0, or N: step and prefill also return the emitted tokens' log-probabilities and their top N
    alternatives (`emitted_logprobs`) as a third output; static, so an engine without them runs the same bodies.
    """

    graphdef: nnx.GraphDef
    proposer: Proposer
    menu: Menu
    kernels: KernelPlan
    logprobs: int = 0

    def rows(self, state: DecodeState, slot_ids: jax.Array) -> RowParams:
        p = state.params
        return RowParams(temperature=p.temperature[slot_ids], top_p=p.top_p[slot_ids], top_k=p.top_k[slot_ids],
                         keys=sampling.row_keys(p.seed[slot_ids], state.n_generated[slot_ids]))

    def step(self, k: int, window: int) -> Callable:
        """The (B, k, W) step: (target_params, proposer_params, state, slot_ids [B], row_k [B], block_table
        [B, ceil(W/X)][, host]) -> (state, packed), or (state, packed, (values [B, k+1, 1+N], ids [B, k+1, N])) with
        logprobs N > 0; `host` (a `HostProposals` of [B, k]) only for a proposer with `host_proposals`."""
        proposer = self.proposer
        scratch = self.menu.num_slots
        tree = self.menu.tree_at(k)

        def body(target_params, proposer_params, state: DecodeState, slot_ids, row_k, block_table, host=None):
            target, layers = nnx.merge(self.graphdef, target_params[0]), target_params[1]
            b = slot_ids.shape[0]
            start = state.cache.lengths[slot_ids]  # [B]
            pending = state.pending[slot_ids]  # [B]
            ctx = StepContext(slot_ids=slot_ids, start=start, history=state.history, rows=self.rows(state, slot_ids),
                              host=host)
            if tree is not None:  # a token tree of k nodes (jaxspec/speculation/tree.py)
                nodes, pstate = proposer.propose_tree(proposer_params, state.proposer, ctx, tree, window)
                # row b verifies nodes 1 .. min(lens, row_k[b]): a parent-closed prefix at most that deep
                valid = jnp.arange(k)[None, :] < jnp.minimum(nodes.lens, row_k)[:, None]  # [B, k]
                rooted = tree_lib.with_root(nodes, valid)  # tokens, parents, depth: [B, k+1]
                logits, cache = target.forward_cached(
                    tree_lib.tree_inputs(pending, rooted, slot_ids, start, tree.depth, block_table), state.cache,
                    window, layers=layers, kernels=self.kernels)  # [B, k+1, V]
                out, counts, path = verify_tree(logits, *rooted, ctx.rows, tree.depth)
                # out[:, j] was drawn at the path's node of depth j: emitted_logits [B, k+1, V]
                node = path[:, jnp.minimum(jnp.arange(k + 1), tree.depth)]  # [B, k+1]
                emitted_logits = jnp.take_along_axis(logits, node[:, :, None], axis=1)
                cache = tree_lib.compact(cache, slot_ids, start, path, block_table)  # the accepted path, as a chain
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
                hidden, features, cache = self.target_pass(
                    target, chain_inputs(tokens_in, slot_ids, start, block_table), state.cache, window,
                    layers)  # [B, k+1, D], [B, k+1, n·D]
                logits = target.unembed(hidden, self.kernels)  # [B, k+1, V]
                out, counts = verify(logits, proposals, ctx.rows)  # [B, k+1], [B]
                emitted_logits = logits  # out[:, j] was drawn at input position j
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
            if self.logprobs:
                return new_state, packed, emitted_logprobs(emitted_logits, out, self.logprobs)
            return new_state, packed

        return body

    def target_pass(self, target, inputs: StepInputs, cache, window: int, layers):
        """The target over `inputs`: (hidden [B, T, D], the proposer's features [B, T, n·D] or None, cache)."""
        if self.proposer.feature_layers:
            return target.forward_cached_features(inputs, cache, window, self.proposer.feature_layers, layers=layers,
                                                  kernels=self.kernels)
        hidden, cache = target.forward_cached_hidden(inputs, cache, window, layers=layers, kernels=self.kernels)
        return hidden, None, cache

    def prefill(self, chunk: int, window: int) -> Callable:
        """The (C, W) prefill chunk: (target_params, proposer_params, state, PrefillInputs) -> (state, first [1]),
        or (state, first, (values [1, 1, 1+N], ids [1, 1, N])) with logprobs N > 0."""
        proposer = self.proposer

        def body(target_params, proposer_params, state: DecodeState, chunk_in: PrefillInputs):
            slot, tokens, start, n_valid, is_last = (chunk_in.slot, chunk_in.tokens, chunk_in.start,
                                                     chunk_in.n_valid, chunk_in.is_last)  # see PrefillInputs
            temperature, top_p, top_k, seed = chunk_in.temperature, chunk_in.top_p, chunk_in.top_k, chunk_in.seed
            target, layers = nnx.merge(self.graphdef, target_params[0]), target_params[1]
            params = SlotParams(temperature=state.params.temperature.at[slot].set(temperature),
                                top_p=state.params.top_p.at[slot].set(top_p),
                                top_k=state.params.top_k.at[slot].set(top_k),
                                seed=state.params.seed.at[slot].set(seed))
            inputs = chain_inputs(tokens, slot, start, chunk_in.block_table)
            hidden, features, cache = self.target_pass(target, inputs, state.cache, window, layers)  # [1, C, D|n·D]
            # logits: [1, 1, V] after the chunk's last real token
            logits = target.unembed(jnp.take_along_axis(hidden, (n_valid - 1)[:, None, None], axis=1), self.kernels)
            cache = cache.with_lengths(slot, start + n_valid)
            pstate = state.proposer
            if proposer.feature_layers:  # stored for the draft's catch-up (it reads them)
                pstate = proposer.record_features(pstate, slot, start, features)
            if proposer.tracks_context:  # a draft sees the prompt lazily (catch-up): it holds nothing yet
                pstate = proposer.forget(pstate, slot)
            else:
                pstate = proposer.prefill(proposer_params, pstate, inputs, n_valid, window)
            # history[slot, :n_prefix] = the cached prefix's tokens, then the chunk's at start..
            max_len = state.history.shape[1]
            cached = jnp.arange(max_len, dtype=jnp.int32)[None, :] < chunk_in.n_prefix[:, None]  # [1, M]
            history = state.history.at[slot].set(jnp.where(cached, chunk_in.prefix, state.history[slot]))
            positions = start[:, None] + jnp.arange(chunk, dtype=jnp.int32)[None, :]  # [1, C]
            history = history.at[slot[:, None], positions].set(tokens, mode="drop")
            # first generated token (used only when this is the prompt's last chunk): the request's token number
            # `generated` (0, or what a preempted request had generated), keyed as the plain decode keys it
            n_gen = chunk_in.generated
            rows = RowParams(temperature=temperature, top_p=top_p, top_k=top_k,
                             keys=sampling.row_keys(seed, n_gen))
            first = sampling.draw(logits[:, 0, :], rows, sampling.subkeys(rows.keys, RESIDUAL_KEY))[0]  # [1]
            first_pos = start + n_valid
            history = jnp.where(is_last, history.at[slot, first_pos].set(first, mode="drop"), history)
            new_state = DecodeState(
                cache=cache,
                pending=jnp.where(is_last, state.pending.at[slot].set(first), state.pending),
                history=history,
                n_generated=state.n_generated.at[slot].set(jnp.where(is_last, n_gen + 1, 0)),
                params=params,
                proposer=pstate,
            )
            if self.logprobs:
                return new_state, first, emitted_logprobs(logits, first[:, None], self.logprobs)
            return new_state, first

        return body

    def catch_up(self, chunk: int, window: int) -> Callable:
        """The (C, W) draft catch-up: (proposer_params, state, slot, start, n_valid) -> state; it feeds a slot's
        committed history [start, start + n_valid) to the proposer's state."""
        proposer = self.proposer

        def body(proposer_params, state: DecodeState, slot, start, n_valid):
            # slot, start, n_valid: [1]; tokens: [1, C] gathered on device from the history
            idx = jnp.clip(start[:, None] + jnp.arange(chunk, dtype=jnp.int32)[None, :], 0, state.history.shape[1] - 1)
            tokens = state.history[slot[:, None], idx]
            pstate = proposer.prefill(proposer_params, state.proposer, chain_inputs(tokens, slot, start), n_valid,
                                      window)
            return dataclasses.replace(state, proposer=pstate)

        return body

