"""Suffix decoding (docs/design.md, "Suffix decoding"): model-free proposals from suffix tries over the server's
recent outputs and the request's own prompt (jaxspec.speculation.suffix_tree).

The tries span requests, so they live on the host: the scheduler feeds the `SuffixIndex` (prompts at admission,
outputs as they are committed, ends and cancellations) and builds each step's proposals from it; the step
executable takes them as traced inputs (`HostProposals`, static [B, k]) and this proposer only hands them on. Its
proposals are point masses deterministic given what the server generated before the step, so verification keeps
plain decoding's output at temperature 0 and the target distribution under sampling.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import numpy as np

from jaxspec.menu import TreeEnvelope
from jaxspec.speculation.proposers.base import Proposer, StepContext
from jaxspec.speculation.suffix_tree import SuffixIndex
from jaxspec.types import HostProposals, Proposals, TreeProposals


@dataclasses.dataclass(frozen=True, eq=False)
class SuffixProposer(Proposer):
    """Hands the step the proposals the host made from `index` (one index per engine; identity-compared)."""

    index: SuffixIndex = dataclasses.field(default_factory=SuffixIndex)
    name: str = "suffix"
    builds_trees: ClassVar[bool] = True
    host_proposals: ClassVar[bool] = True

    def propose(self, params, state, ctx: StepContext, k: int, window: int):
        host = ctx.host  # token_ids [B, k], lens [B]
        return Proposals(token_ids=host.token_ids, lens=host.lens, draft_probs=None), state

    def propose_tree(self, params, state, ctx: StepContext, tree: TreeEnvelope, window: int):
        host = ctx.host  # token_ids, parents, depth: [B, k]; lens [B]
        return TreeProposals(token_ids=host.token_ids, parents=host.parents, depth=host.depth, lens=host.lens), state


def host_proposals(index: SuffixIndex, request_ids, k: int, tree: TreeEnvelope | None) -> HostProposals:
    """Each request's proposals at the step's k: its chain of at most k tokens, or its tree inside `tree`
    ([n, k] numpy arrays)."""
    n = len(request_ids)
    tokens, parents, depth = (np.zeros((n, k), np.int32) for _ in range(3))
    lens = np.zeros((n,), np.int32)
    for i, rid in enumerate(request_ids):
        if tree is None:
            chain = index.propose(rid, k).tokens
            tokens[i, :len(chain)] = chain
            lens[i] = len(chain)
        else:
            t = index.propose_tree(rid, tree.nodes, tree.depth)
            m = len(t.tokens)
            tokens[i, :m], parents[i, :m], depth[i, :m] = t.tokens, t.parents, t.depths
            lens[i] = m
    return HostProposals(token_ids=tokens, lens=lens, parents=parents, depth=depth)
