"""Baselines: no speculation, and a fixed k."""

from __future__ import annotations

from jaxspec.policy.base import BatchView, Decision, Policy, menu_at_most, row_caps


class NoSpeculation(Policy):
    """Always k = 0 (plain decoding)."""

    name = "none"

    def choose(self, view: BatchView) -> Decision:
        return Decision(k=0)


class FixedPolicy(Policy):
    """Always the same k (the largest menu value ≤ k), capped per row by each row's room."""

    def __init__(self, k: int):
        if k < 0:
            raise ValueError(f"fixed k must be >= 0, got {k}")
        self.k = k
        self.name = f"fixed:{k}"

    def choose(self, view: BatchView) -> Decision:
        k = menu_at_most(self.k, view.k_menu)
        return Decision(k=k, row_k=row_caps(k, view))

    def exact_caps_k(self, k_menu: tuple[int, ...]) -> int:
        return menu_at_most(self.k, k_menu)
