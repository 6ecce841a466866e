"""Draft-model proposer: a small Llama with its own KV cache, k draft steps in one call.

Keeping the draft cache in sync (docs/design.md, "The speculative step": lazy draft catch-up): steps with
k = 0 do not touch the draft (they cost exactly plain decoding). A speculating step first feeds
the draft what the target committed since the draft last saw it, through the pending token.
After a k > 0 step at most one committed token is missing (the last accepted proposal when all
k were accepted), so the in-step catch-up is a fixed chunk of width 2 with a per-row count; the
engine brings longer lags (after k = 0 steps) down to that with bucketed catch-up calls first.

    target:  ... t(s-1) | pending(s)                    committed length s
    draft:   ... t(dl-1)                                draft length dl ∈ {s-1, s}
    chunk:   history[dl], history[dl+1]   (count c = s - dl + 1 ∈ {1, 2})

As a token tree (`propose_tree`, docs/design.md "Token trees"), EAGLE-2-style inside the envelope (N nodes,
at most Z deep): level by level, the A most probable nodes of the newest level (path log-probability under
the draft) are fed to the draft in one call under a tree mask and each is expanded by its A most probable
next tokens; the tree is the N most probable of all expanded nodes. Fed node i of level j (j = 1..Z-1) is
written at draft position s + 1 + (j-1)·A + i; after verification `commit_tree` moves the accepted path's
entries to s + 1 .. (where a chain has them), so the lag is again at most one token.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from jaxspec.menu import TreeEnvelope
from jaxspec.models.kv_cache import KVCache, init_cache
from jaxspec.models.llama import Llama, ServingParams, StepInputs, chain_inputs, serving_split
from jaxspec.models.pallas_attention import WindowMask
from jaxspec.models.sharding import Placement
from jaxspec.speculation import sampling
from jaxspec.speculation import tree as tree_lib
from jaxspec.speculation.proposers.base import Proposer, StepContext
from jaxspec.types import Proposals, TreeProposals

CATCH_UP = 2  # tokens fed to the draft at the start of every step


def tree_width(tree: TreeEnvelope) -> int:
    """A, the nodes a draft tree expands per level: as many as keep the (Z-1)·A fed entries within the N
    positions after the pending token that the target's own tree step writes (all N when Z = 1)."""
    return tree.nodes if tree.depth == 1 else max(1, tree.nodes // (tree.depth - 1))


class DraftModelProposer(Proposer):
    """Samples k tokens autoregressively from a draft model (warped like the target)."""

    tracks_context = True
    in_step_catch_up = CATCH_UP
    builds_trees: ClassVar[bool] = True

    def __init__(self, draft: Llama, name: str = "draft"):
        self.name = name
        self.config = draft.config
        self.draft = draft
        self.graphdef = nnx.graphdef(draft)

    def params(self, placement: Placement = Placement()) -> ServingParams:
        """Per-layer weights read in place, like the target's (a draft with many layers would otherwise
        copy every stacked slice on every draft forward); replicated over the mesh by the engine."""
        return serving_split(self.draft, placement)[1]

    def init_state(self, num_slots: int, max_len: int) -> KVCache:
        return init_cache(self.config, num_slots, max_len)

    def _model(self, params: ServingParams) -> tuple[Llama, tuple[dict, ...]]:
        return nnx.merge(self.graphdef, params[0]), params[1]

    def prefill(self, params, state: KVCache, inputs: StepInputs, n_valid, window):
        draft, layers = self._model(params)
        _, state = draft.forward_cached(inputs, state, window, logits_at=(n_valid - 1)[:, None], layers=layers,
                                         kernels=self.kernels)
        return state.with_lengths(inputs.slot_ids, inputs.start + n_valid)

    def _catch_up(self, draft: Llama, layers, state: KVCache, ctx: StepContext, window: int):
        """Feed the missing committed tokens and the pending one. Returns logits [B, V] after
        the pending token and the cache (draft length is then start + 1)."""
        dl = state.lengths[ctx.slot_ids]  # [B]
        m = ctx.history.shape[1]
        # chunk: [B, 2] = history[slot, dl + {0, 1}]
        idx = jnp.clip(dl[:, None] + jnp.arange(CATCH_UP)[None, :], 0, m - 1)
        chunk = ctx.history[ctx.slot_ids[:, None], idx]
        count = ctx.start - dl + 1  # [B] ∈ {1, 2}
        logits, state = draft.forward_cached(chain_inputs(chunk, ctx.slot_ids, dl), state, window,
                                             logits_at=(count - 1)[:, None], layers=layers, kernels=self.kernels)
        return logits[:, 0, :], state

    def propose(self, params, state: KVCache, ctx: StepContext, k: int, window: int,
                perturb: Callable[[jax.Array, jax.Array], jax.Array] | None = None):
        """k draft tokens per row. `perturb(token [B], i) -> token [B]`, if given, replaces the
        i-th drawn token before the draft continues from it (and before it is proposed), so the
        draft cache holds exactly the proposed chain; the probabilities are those it was drawn from."""
        draft, layers = self._model(params)
        logits, state = self._catch_up(draft, layers, state, ctx, window)  # logits: [B, V]

        def draw(logits, i):
            # token: [B] drawn from q = warp(logits) [B, V]
            token, q = sampling.draw(logits, ctx.rows, sampling.subkeys(ctx.rows.keys, i))
            return (token if perturb is None else perturb(token, i)), q

        first, q_first = draw(logits, 0)

        def step(carry, i):
            state, token = carry
            # feed d_i at position start + i, draw d_{i+1}
            inputs = chain_inputs(token[:, None], ctx.slot_ids, ctx.start + i)
            logits, state = draft.forward_cached(inputs, state, window, layers=layers,
                                                 kernels=self.kernels)  # [B, 1, V]
            nxt, q = draw(logits[:, 0, :], i)
            return (state, nxt), (nxt, q)

        (state, _), (rest, q_rest) = jax.lax.scan(step, (state, first), jnp.arange(1, k, dtype=jnp.int32))
        # tokens: [B, k]; probs: [B, k, V]
        tokens = jnp.concatenate([first[:, None], jnp.moveaxis(rest, 0, 1)], axis=1)
        probs = jnp.concatenate([q_first[:, None, :], jnp.moveaxis(q_rest, 0, 1)], axis=1)
        lens = jnp.full(ctx.slot_ids.shape, k, jnp.int32)
        return Proposals(token_ids=tokens, lens=lens, draft_probs=probs), state

    def context_lengths(self, state: KVCache, slot_ids: jax.Array) -> jax.Array:
        return state.lengths[slot_ids]  # [B]

    def forget(self, state: KVCache, slot_ids: jax.Array) -> KVCache:
        return state.with_lengths(slot_ids, jnp.zeros(slot_ids.shape, jnp.int32))

    def commit(self, params, state: KVCache, ctx: StepContext, k: int, n_accepted: jax.Array, window: int) -> KVCache:
        # The draft holds pending + d_1..d_{k-1}; keep what the target accepted (k > 0 only).
        valid = ctx.start + 1 + jnp.minimum(n_accepted, k - 1)  # [B]
        return state.with_lengths(ctx.slot_ids, valid)

    def propose_tree(self, params, state: KVCache, ctx: StepContext, tree: TreeEnvelope,
                     window: int) -> tuple[TreeProposals, KVCache]:
        """The draft's token tree per row (see the module doc). Scores are path log-probabilities under the
        draft's own (unwarped) distribution, so the tree is the same for every temperature; `verify_tree`
        stays exact because the tree is a deterministic function of the context."""
        draft, layers = self._model(params)
        logits, state = self._catch_up(draft, layers, state, ctx, window)  # [B, V] after the pending token
        b, n_nodes, z = ctx.slot_ids.shape[0], tree.nodes, tree.depth
        a = tree_width(tree)
        fed = (z - 1) * a  # draft entries the level calls write, (Z-1)·A
        # level 1: the root's A most probable tokens, all of them the first frontier
        score, token = jax.lax.top_k(jax.nn.log_softmax(logits, axis=-1), a)  # [B, A]
        cand_token, cand_score = [token], [score]  # per level: [B, A] then [B, A·A]
        cand_parent = [jnp.full((b, a), -1, jnp.int32)]  # candidate index of the parent (-1: the root)
        cand_slot = [jnp.broadcast_to(jnp.arange(a, dtype=jnp.int32) if z > 1 else jnp.full((a,), -1), (b, a))]
        cand_depth = [1] * a
        frontier_cand = jnp.broadcast_to(jnp.arange(a, dtype=jnp.int32), (b, a))  # [B, A]
        # frontier_anc: [B, A, (Z-1)·A] the fed entries each frontier node may attend to (its ancestors, itself)
        frontier_anc = jnp.broadcast_to(jax.nn.one_hot(jnp.arange(a), fed, dtype=bool), (b, a, fed))
        n_cand = a
        for j in range(1, z):  # feed the depth-j frontier, expand it to depth j + 1
            first_slot = (j - 1) * a
            write_start = ctx.start + 1 + first_slot  # [B]
            # RoPE position start + j for every fed node: depth offset j - 1 - first_slot from write_start
            inputs = StepInputs(token, ctx.slot_ids, write_start, jnp.full((b, a), j - 1 - first_slot, jnp.int32),
                                jnp.broadcast_to(jnp.eye(a, dtype=bool), (b, a, a)))
            mask = WindowMask(frontier_anc, ctx.start + 1, window)  # [B, A, U]: history, then earlier nodes
            logits, state = draft.forward_cached(inputs, state, window, layers=layers, mask=mask,
                                                 kernels=self.kernels)  # [B, A, V]
            child_score, child_token = jax.lax.top_k(jax.nn.log_softmax(logits, axis=-1), a)  # [B, A, A]
            child_score = (score[:, :, None] + child_score).reshape(b, a * a)  # [B, A·A] path log-probabilities
            child_token = child_token.reshape(b, a * a)  # [B, A·A]
            cand_token.append(child_token)
            cand_score.append(child_score)
            cand_parent.append(jnp.repeat(frontier_cand, a, axis=1))  # [B, A·A]
            cand_depth += [j + 1] * (a * a)
            slots = jnp.full((b, a * a), -1, jnp.int32)  # [B, A·A]
            if j + 1 < z:  # the next frontier: the A most probable children, fed at slots j·A ..
                score, pick = jax.lax.top_k(child_score, a)  # [B, A]
                token = jnp.take_along_axis(child_token, pick, axis=1)  # [B, A]
                own = j * a + jnp.arange(a, dtype=jnp.int32)  # [A] their fed slots
                slots = slots.at[jnp.arange(b)[:, None], pick].set(own[None, :])
                parent_anc = jnp.take_along_axis(frontier_anc, (pick // a)[:, :, None], axis=1)  # [B, A, (Z-1)·A]
                frontier_anc = parent_anc | jax.nn.one_hot(own, fed, dtype=bool)[None]
                frontier_cand = n_cand + pick
            cand_slot.append(slots)
            n_cand += a * a
        # the k most probable candidates (A + (Z-1)·A² of them): a child never outscores its parent
        # (log-probabilities <= 0) and ties keep the lower index, which a parent has, so a parent comes first
        tokens, scores, parents, slots = (jnp.concatenate(x, axis=1) for x in (cand_token, cand_score, cand_parent,
                                                                                   cand_slot))  # [B, A+(Z-1)·A²]
        n_kept = min(n_cand, n_nodes)
        order = jnp.argsort(-scores, axis=1, stable=True)[:, :n_kept]  # [B, k'] candidate indices, best first
        rows = jnp.arange(b)[:, None]
        node_of = jnp.zeros((b, n_cand), jnp.int32).at[rows, order].set(jnp.arange(1, n_kept + 1, dtype=jnp.int32))
        parent_cand = jnp.take_along_axis(parents, order, axis=1)  # [B, k']
        node_parent = jnp.where(parent_cand < 0, 0,
                                jnp.take_along_axis(node_of, jnp.maximum(parent_cand, 0), axis=1))  # [B, k']
        depth = jnp.asarray(cand_depth, jnp.int32)[order]  # [B, k']

        def pad(x):  # [B, k'] -> [B, k] (the envelope holds fewer candidates than nodes: lens says so)
            return jnp.pad(x, ((0, 0), (0, n_nodes - n_kept)))

        nodes = TreeProposals(token_ids=pad(jnp.take_along_axis(tokens, order, axis=1)).astype(jnp.int32),
                              parents=pad(node_parent), depth=pad(depth),
                              lens=jnp.full((b,), n_kept, jnp.int32),
                              draft_slots=pad(jnp.take_along_axis(slots, order, axis=1)))
        return nodes, state

    def commit_tree(self, params, state: KVCache, ctx: StepContext, nodes: TreeProposals, path: jax.Array,
                    n_accepted: jax.Array, window: int) -> KVCache:
        """Keep the draft entries of the accepted path, moved to start + 1 .. start + kept (`tree.compact`); the
        deepest accepted node has no entry when it was never fed (a leaf), which leaves a lag of one token."""
        b, z = path.shape[0], path.shape[1] - 1
        k = nodes.draft_slots.shape[1]
        # slot: [B, Z] the fed slot of the path's node at each depth 1..Z (valid up to n_accepted)
        slot = jnp.take_along_axis(nodes.draft_slots, jnp.clip(path[:, 1:] - 1, 0, k - 1), axis=1)
        deepest = jnp.take_along_axis(slot, jnp.clip(n_accepted - 1, 0, z - 1)[:, None], axis=1)[:, 0]  # [B]
        kept = jnp.where((n_accepted > 0) & (deepest < 0), n_accepted - 1, n_accepted)  # [B]
        column = jnp.arange(z + 1, dtype=jnp.int32)[None, :]
        written = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), 1 + slot], axis=1)  # [B, Z+1] from start
        state = tree_lib.compact(state, ctx.slot_ids, ctx.start, jnp.where(column <= kept[:, None], written, column))
        return state.with_lengths(ctx.slot_ids, ctx.start + 1 + kept)
