"""The policy contract: every step, pick the speculation length from the compiled menu.

The scheduler calls `choose(view)` before a step and `observe(view, decision, result, elapsed_s)`
after it. Policies never touch the device and never cause a compile: they only pick among the
menu's k values (0 included) and optional per-row caps ≤ k.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable

from jaxspec.menu import TreeEnvelope
from jaxspec.types import StepResult


@dataclasses.dataclass(frozen=True)
class BatchView:
    """What a policy sees of the live batch.

    request_ids:  one id per row.
    context_lens: committed tokens per row (prompt + generated so far).
    row_max_k:    the largest k each row can take (cache room and remaining max_tokens).
    k_menu:       compiled speculation lengths, increasing, 0 first if present.
    batch_bucket: the padded batch size this step will run at.
    catch_up_calls: per row, the draft catch-up calls a step with k > 0 would run first (the
                  draft skipped the tokens committed by k = 0 steps); () when not tracked.
    catch_up_tokens: per row, those calls' chunks' padded tokens; () when not tracked.
    trees:        the menu's token-tree envelopes (jaxspec.menu.TreeEnvelope): each runs at its k
                  in place of the chain there.
    proposal_rates: per row, the confidence of each token of the chain a host proposer (suffix decoding) has
                  ready: its frequency in the suffix trie given the tokens before it (none past the chain's end);
                  () when the proposer proposes on the device.
    assumed_rates: per row, the confidences of the tokens its chain takes as committed before it: the overlapped
                  loop proposes for a row whose previous step is in flight as if that step accepted its proposals
                  and its bonus token is the trie's next one (docs/design.md, "The overlapped loop"); () for a row
                  whose context is read, or () for all.
    """

    request_ids: tuple[Hashable, ...]
    context_lens: tuple[int, ...]
    row_max_k: tuple[int, ...]
    k_menu: tuple[int, ...]
    batch_bucket: int
    catch_up_calls: tuple[int, ...] = ()
    catch_up_tokens: tuple[int, ...] = ()
    trees: tuple[TreeEnvelope, ...] = ()
    proposal_rates: tuple[tuple[float, ...], ...] = ()
    assumed_rates: tuple[tuple[float, ...], ...] = ()

    @property
    def batch_size(self) -> int:
        return len(self.request_ids)

    def tree_at(self, k: int) -> TreeEnvelope | None:
        """The tree envelope that runs at k, or None for a chain."""
        return next((t for t in self.trees if t.nodes == k), None)


@dataclasses.dataclass(frozen=True)
class Decision:
    """A policy's choice for one step.

    k:                  the padded speculation length (a menu value).
    row_k:              optional per-row caps (each ≤ k); None means every row uses k.
    predicted_goodput:  optional predicted tokens/s of each menu option considered.
    """

    k: int
    row_k: tuple[int, ...] | None = None
    predicted_goodput: dict[int, float] | None = None


class Policy:
    """Base class. Subclasses implement `choose`; `observe` and `forget` are optional."""

    name: str = "policy"

    def choose(self, view: BatchView) -> Decision:
        raise NotImplementedError

    def observe(self, view: BatchView, decision: Decision, result: StepResult, elapsed_s: float) -> None:
        """Learn from a finished step (acceptance, timing)."""

    def forget(self, request_id: Hashable) -> None:
        """A request finished; drop its per-request state."""

    def exact_caps_k(self, k_menu: tuple[int, ...]) -> int:
        """Up to which k a row's cap must be the synchronous loop's for this policy's tokens to be reproducible:
        the k it gives every row when its choice follows from no live state (`none`, `fixed:K`: a seeded request
        then gives the same tokens in any batch, overlapped or not); 0 for a policy whose choice depends on the
        live batch anyway. The overlapped loop holds a row out of a step while the step in flight could change
        its cap below this k (docs/design.md, "The overlapped loop")."""
        return 0


def menu_at_most(k: int, k_menu: tuple[int, ...]) -> int:
    """The largest menu value ≤ k."""
    allowed = [m for m in k_menu if m <= k]
    return allowed[-1] if allowed else k_menu[0]


def row_caps(k: int, view: BatchView) -> tuple[int, ...]:
    """Per-row caps min(k, row_max_k): rows near their limits speculate less, others keep k."""
    return tuple(min(k, cap) for cap in view.row_max_k)
