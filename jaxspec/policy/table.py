"""Batch-size table baseline (vLLM style): k is a step function of the live batch size.

    k(n) = table[max{t ∈ table : t ≤ n}]        n = live rows of the step

e.g. {1: 4, 4: 2, 8: 1, 16: 0}: 4 proposals alone, 2 from 4 rows, 1 from 8, none from 16.
The result is clamped like `fixed:K` (largest menu value ≤ k and ≤ every row's cap).
Defaults: jaxspec/configs/policy.yaml `table`.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping

from jaxspec.policy.base import BatchView, Decision, Policy, menu_at_most, row_caps
from jaxspec.policy.decision_log import DecisionLog
from jaxspec.types import StepResult


def parse_table(text: str) -> dict[int, int]:
    """'1=4,4=2,8=1' -> {1: 4, 4: 2, 8: 1}."""
    table: dict[int, int] = {}
    for item in text.split(","):
        size, sep, k = item.partition("=")
        try:
            if not sep:
                raise ValueError
            size_i, k_i = int(size), int(k)
        except ValueError:
            raise ValueError(f"bad table entry {item!r} in {text!r}: expected BATCH=K, e.g. '1=4,4=2,8=1'") from None
        if size_i in table:
            raise ValueError(f"batch size {size_i} appears twice in {text!r}")
        table[size_i] = k_i
    return table


class TablePolicy(Policy):
    """k from a batch-size threshold table."""

    name = "table"

    def __init__(self, table: Mapping[int, int], log_size: int = 4096):
        table = {int(n): int(k) for n, k in table.items()}
        if not table:
            raise ValueError("the batch-size table is empty")
        if min(table) != 1:
            raise ValueError(f"the batch-size table must start at batch size 1, got {sorted(table)}")
        if any(k < 0 for k in table.values()):
            raise ValueError(f"table k values must be >= 0, got {table}")
        self.table = dict(sorted(table.items()))
        self.log = DecisionLog(log_size)
        self.name = "table:" + ",".join(f"{n}={k}" for n, k in self.table.items())

    def k_for(self, batch_size: int) -> int:
        """The table's k for `batch_size` live rows (before clamping to the menu)."""
        if batch_size < 1:
            raise ValueError(f"batch size must be >= 1, got {batch_size}")
        return self.table[max(n for n in self.table if n <= batch_size)]

    def choose(self, view: BatchView) -> Decision:
        k = menu_at_most(self.k_for(view.batch_size), view.k_menu)
        return Decision(k=k, row_k=row_caps(k, view))  # a row near its limits speculates less, not the batch

    def observe(self, view: BatchView, decision: Decision, result: StepResult, elapsed_s: float) -> None:
        self.log.record(view, decision, result, elapsed_s)

    def forget(self, request_id: Hashable) -> None:
        pass
