"""A bounded log of speculation decisions with predicted and realised goodput (docs/design.md, "The goodput policy").

Definitions (one record per engine step):
  goodput            committed tokens per second of the step: Σ_rows counts / step seconds
                     (accepted proposals plus the bonus token of every live row); None when the
                     step's measured time is 0 (a clock too coarse, or a test clock that stood still).
  predicted_goodput  the policy's Σ_i E_i(k_i) / T(B, k) for every menu option it considered.
  predicted_tokens   Σ_i E_i(k_i) of the chosen option; predicted_seconds its T(B, k).
  acceptance         Σ accepted / Σ proposed over the rows of the step (None when nothing was proposed).
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np

from jaxspec.policy.base import BatchView, Decision
from jaxspec.types import StepResult


@dataclasses.dataclass(frozen=True)
class DecisionRecord:
    """One step: what was chosen, what was predicted, what happened."""

    step: int
    batch: int  # live rows
    bucket: int  # padded batch bucket B
    k: int
    row_k: tuple[int, ...] | None
    predicted_goodput: dict[int, float] | None
    predicted_tokens: float | None
    predicted_seconds: float | None
    tokens: int
    accepted: int
    proposed: int
    seconds: float
    explored: bool = False  # an exploration option ran instead of the best one

    @property
    def goodput(self) -> float | None:
        """Realised tokens / second of this step (None if it took no measurable time)."""
        return self.tokens / self.seconds if self.seconds > 0 else None

    @property
    def acceptance(self) -> float | None:
        return self.accepted / self.proposed if self.proposed else None

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["row_k"] = list(self.row_k) if self.row_k is not None else None
        if self.predicted_goodput is not None:
            d["predicted_goodput"] = {str(k): v for k, v in self.predicted_goodput.items()}
        d["goodput"] = self.goodput
        d["acceptance"] = self.acceptance
        return d


class DecisionLog:
    """The last `maxlen` decisions (older ones are dropped; `steps` counts all of them)."""

    def __init__(self, maxlen: int = 4096):
        if maxlen < 1:
            raise ValueError(f"maxlen must be >= 1, got {maxlen}")
        self._records: collections.deque[DecisionRecord] = collections.deque(maxlen=maxlen)
        self.steps = 0

    def record(self, view: BatchView, decision: Decision, result: StepResult, elapsed_s: float, *,
               predicted_tokens: float | None = None, predicted_seconds: float | None = None,
               explored: bool = False) -> DecisionRecord:
        if not (elapsed_s >= 0 and np.isfinite(elapsed_s)):
            raise ValueError(f"elapsed_s must be finite and >= 0, got {elapsed_s}")
        n = view.batch_size
        rec = DecisionRecord(
            step=self.steps, batch=n, bucket=view.batch_bucket, k=decision.k, row_k=decision.row_k,
            predicted_goodput=dict(decision.predicted_goodput) if decision.predicted_goodput is not None else None,
            predicted_tokens=predicted_tokens, predicted_seconds=predicted_seconds,
            tokens=int(np.sum(result.counts[:n])), accepted=int(np.sum(result.accepted[:n])),
            proposed=int(np.sum(result.proposed[:n])), seconds=float(elapsed_s), explored=explored)
        self._records.append(rec)
        self.steps += 1
        return rec

    def __len__(self) -> int:
        return len(self._records)

    def __iter__(self):
        return iter(self._records)

    def to_dicts(self) -> list[dict]:
        """JSON-ready records, oldest first (for `--json` stats and metrics)."""
        return [r.as_dict() for r in self._records]

    def summary(self) -> dict:
        """Aggregates over the kept records.

        goodput:            Σ tokens / Σ seconds.
        mean_k:             mean chosen padded k.
        explored:           records whose option was run for exploration, not as the best.
        prediction_ratio:   Σ realised tokens / Σ predicted tokens (1 = calibrated), where predicted.
        time_ratio:         Σ realised seconds / Σ predicted seconds, where predicted.
        """
        recs = list(self._records)
        if not recs:
            return {"steps": self.steps, "kept": 0}
        tokens = sum(r.tokens for r in recs)
        seconds = sum(r.seconds for r in recs)
        pred = [r for r in recs if r.predicted_tokens is not None and r.predicted_seconds is not None]
        out = {"steps": self.steps, "kept": len(recs), "tokens": tokens, "seconds": seconds,
               "goodput": tokens / seconds if seconds > 0 else None, "mean_k": float(np.mean([r.k for r in recs])),
               "k_histogram": {str(k): v for k, v in sorted(collections.Counter(r.k for r in recs).items())},
               "explored": sum(r.explored for r in recs)}
        if pred and sum(r.seconds for r in pred) > 0:
            out["prediction_ratio"] = sum(r.tokens for r in pred) / sum(r.predicted_tokens for r in pred)
            out["time_ratio"] = sum(r.seconds for r in pred) / sum(r.predicted_seconds for r in pred)
        return out

    def step_times(self) -> list[dict]:
        """The cost model's calibration per step shape run: for each (bucket B, padded k), the steps, and the
        median predicted and observed seconds (predicted: what the policy priced the chosen option at)."""
        by_shape = collections.defaultdict(list)
        for r in self._records:
            if r.predicted_seconds is not None:
                by_shape[(r.bucket, r.k)].append((r.predicted_seconds, r.seconds))
        return [{"bucket": b, "k": k, "steps": len(v), "predicted_s": float(np.median([p for p, _ in v])),
                 "observed_s": float(np.median([o for _, o in v]))}
                for (b, k), v in sorted(by_shape.items())]
