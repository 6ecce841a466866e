"""HF-style per-request heuristic: +2 after a step whose proposals were all accepted, −1 otherwise.

Per request i (transformers' `num_assistant_tokens_schedule="heuristic"`):

    k_i ← min(k_i + increase, k_max)   if accepted_i = requested_i > 0
    k_i ← max(k_i − decrease, min_k)    if accepted_i < requested_i
    (unchanged when the row was allowed 0 proposals)

A step runs at the padded k = the smallest menu value ≥ max_i min(k_i, cap_i) (the largest menu
value if none is), with per-row caps row_k_i = min(k_i, cap_i, k). A row's cap (`row_max_k`)
already holds its cache room, and the engine runs a step at each row's own cap
(`Menu.step_shape`), so a long row limits only itself. Defaults: jaxspec/configs/policy.yaml.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable

from jaxspec.policy.base import BatchView, Decision, Policy
from jaxspec.policy.decision_log import DecisionLog
from jaxspec.types import StepResult


@dataclasses.dataclass(frozen=True)
class HeuristicConfig:
    initial_k: int = 4
    increase: int = 2
    decrease: int = 1
    min_k: int = 1

    def __post_init__(self):
        if self.min_k < 0 or self.initial_k < self.min_k:
            raise ValueError(f"need 0 <= min_k <= initial_k, got min_k={self.min_k}, initial_k={self.initial_k}")
        if self.increase < 0 or self.decrease < 0:
            raise ValueError("increase and decrease must be >= 0")


class HeuristicPolicy(Policy):
    name = "heuristic"

    def __init__(self, config: HeuristicConfig = HeuristicConfig(), log_size: int = 4096):
        self.config = config
        self.k: dict[Hashable, int] = {}  # each request's current k_i
        self.log = DecisionLog(log_size)

    def request_k(self, request_id: Hashable) -> int:
        return self.k.get(request_id, self.config.initial_k)

    def choose(self, view: BatchView) -> Decision:
        menu = view.k_menu
        want = [min(self.request_k(r), c) for r, c in zip(view.request_ids, view.row_max_k)]
        top = max(want, default=0)
        k = next((m for m in menu if m >= top), menu[-1])
        row_k = tuple(min(w, k) for w in want)
        return Decision(k=k, row_k=row_k if k > 0 and any(r != k for r in row_k) else None)

    def observe(self, view: BatchView, decision: Decision, result: StepResult, elapsed_s: float) -> None:
        c = self.config
        requested = decision.row_k if decision.row_k is not None else (decision.k,) * view.batch_size
        k_max = view.k_menu[-1]
        for i, rid in enumerate(view.request_ids):
            if requested[i] == 0:
                continue
            current = self.request_k(rid)
            if int(result.accepted[i]) >= requested[i]:
                self.k[rid] = min(current + c.increase, k_max)
            else:
                self.k[rid] = max(current - c.decrease, c.min_k)
        self.log.record(view, decision, result, elapsed_s)

    def forget(self, request_id: Hashable) -> None:
        self.k.pop(request_id, None)
