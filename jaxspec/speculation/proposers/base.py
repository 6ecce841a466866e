"""The proposer contract: guess up to k tokens per row inside the jitted step.

A proposer is a static (hashable) object; its device state (e.g. a draft KV cache) lives in
`DecodeState.proposer` and its weights are passed in as `params` so they are jit arguments,
never baked-in constants. All methods are traced inside the engine's compiled functions.
"""

from __future__ import annotations

import copy
import dataclasses

import jax
import jax.numpy as jnp

from jaxspec.menu import TreeEnvelope
from jaxspec.models.kernel_plan import XLA_PLAN, KernelPlan
from jaxspec.models.llama import StepInputs
from jaxspec.models.sharding import Placement
from jaxspec.types import HostProposals, Proposals, RowParams, TreeProposals


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepContext:
    """What a proposer may look at in one step.

    slot_ids: [B] cache slot per row.      start:   [B] committed target length per row.
    history:  [S+1, M] all tokens of every slot; history[slot, start] is the row's pending token.
    rows:     the rows' sampling parameters and fresh keys.
    host:     the proposals made on the host for this step (a proposer with `host_proposals`), else None.
    """

    slot_ids: jax.Array
    start: jax.Array
    history: jax.Array
    rows: RowParams
    host: HostProposals | None = None


class Proposer:
    """Base class; subclasses override what they need."""

    name: str = "none"
    #: Per-slot state that must see every committed token (a draft KV cache). Such state is
    #: not touched in prompt prefill nor in k = 0 steps (they cost exactly plain decoding); the engine
    #: tracks how far each slot lags and calls `prefill` on the missing history, prompt included,
    #: before the next k > 0 step.
    tracks_context: bool = False
    #: How many trailing tokens (pending included) `propose` itself feeds before drafting.
    in_step_catch_up: int = 1
    #: Whether `propose_tree` builds token trees (jaxspec/speculation/tree.py) for a menu's tree envelopes.
    builds_trees: bool = False
    #: Whether proposals are made on the host: every step executable then takes a `HostProposals` input
    #: ([B, k] at its static k) that `propose` / `propose_tree` return, and `Engine.step` needs them.
    host_proposals: bool = False
    #: The target layers (1 .. L) whose hidden states the proposer reads as its features (L: the last hidden state,
    #: before the final norm); empty: none. If any, the engine hands every target pass's features to
    #: `record_features`, k = 0 steps and prefill included.
    feature_layers: tuple[int, ...] = ()
    #: The forms the proposer's own model traces with (jaxspec.models.kernel_plan); the engine sets its plan
    #: with `with_kernels`.
    kernels: KernelPlan = XLA_PLAN

    def with_kernels(self, plan: KernelPlan) -> Proposer:
        """A copy of this proposer that traces its model with `plan`."""
        clone = copy.copy(self)
        object.__setattr__(clone, "kernels", plan)  # frozen-dataclass proposers too: the clone is not shared yet
        return clone

    def init_state(self, num_slots: int, max_len: int):
        """Device state for `num_slots` slots (+ scratch). Default: none."""
        return ()

    def params(self, placement: Placement = Placement()):
        """Weights passed to every compiled call (pytree), placed by `placement`. Default: none."""
        return ()

    def prefill(self, params, state, inputs: StepInputs, n_valid: jax.Array, window: int):
        """See a chunk of a slot's tokens (a prompt chunk, or committed history it missed while
        k was 0). Returns the new state."""
        return state

    def propose(self, params, state, ctx: StepContext, k: int, window: int) -> tuple[Proposals, object]:
        raise NotImplementedError

    def propose_tree(self, params, state, ctx: StepContext, tree: TreeEnvelope,
                     window: int) -> tuple[TreeProposals, object]:
        """A deterministic token tree per row inside `tree` (N nodes, at most D deep)."""
        raise NotImplementedError(f"the {self.name!r} proposer does not build token trees")

    def record_features(self, state, slot_ids: jax.Array, start: jax.Array, features: jax.Array):
        """The target's features [B, T, n·D] (its hidden states after the n `feature_layers`, concatenated) of the
        tokens it just saw at start .. start+T-1 (before `prefill` in a prompt chunk, before `commit` in a step).
        Only called for a proposer with `feature_layers`."""
        return state

    def commit(self, params, state, ctx: StepContext, k: int, n_accepted: jax.Array, window: int):
        """After verification: `n_accepted` [B] of the k proposals were kept; `ctx.history` already holds the
        step's emitted tokens at start+1 .."""
        return state

    def commit_tree(self, params, state, ctx: StepContext, nodes: TreeProposals, path: jax.Array,
                    n_accepted: jax.Array, window: int):
        """After a tree step (`propose_tree`'s `nodes`): the accepted root path `path` [B, Z+1] (node numbers by
        depth, as `tree.root_path` gives them) of depth `n_accepted` [B]; `ctx.history` as in `commit`."""
        return state

    def context_lengths(self, state, slot_ids: jax.Array) -> jax.Array:
        """[B] how many leading positions of each slot the state holds (what the engine's catch-up plan starts
        from; read back with every step, so the host never guesses a commit rule). Default: 0."""
        return jnp.zeros(slot_ids.shape, jnp.int32)

    def forget(self, state, slot_ids: jax.Array):
        """The slots' context is empty (a new prompt, which a context-tracking state sees in catch-up)."""
        return state


class NoProposer(Proposer):
    """Plain decoding: proposes nothing (only k = 0 is valid)."""

    name = "none"

    def propose(self, params, state, ctx, k, window):
        raise ValueError("the 'none' proposer cannot speculate; use k = 0")

    def __eq__(self, other):
        return type(other) is type(self)

    def __hash__(self):
        return hash(type(self))


def empty_proposals(batch: int) -> Proposals:
    """Proposals for a k = 0 step."""
    return Proposals(token_ids=jnp.zeros((batch, 0), jnp.int32), lens=jnp.zeros((batch,), jnp.int32),
                     draft_probs=None)
