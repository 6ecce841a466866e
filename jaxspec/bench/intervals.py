"""Confidence intervals for a policy's mean latency relative to a baseline, by paired bootstrap.

A cell's measurements are latencies x[r, q] for repeat r = 0..R−1 and request q = 0..n−1, the same requests and
arrivals for every policy (the bench's pairing). The statistic is the ratio of means

    ρ = mean(x_policy) / mean(x_baseline)

and its interval is the percentile bootstrap over both repeats and requests (a crossed resample): each of
`resamples` draws picks R repeat indices and n request indices with replacement, and ρ is recomputed on the
sub-matrix. Paired: both policies are resampled at the same indices, so the variation the two share (a long
prompt, a loaded moment of the machine) cancels in the ratio. Seeded, so a file's intervals are reproducible.

Verdicts against a tolerance τ (2 %): "miss" when the interval lies entirely above 1 + τ, "better" when entirely
below 1 − τ, otherwise "ok" (not shown to be a miss; the interval's width says how much that proves).
"""

from __future__ import annotations

import dataclasses

import numpy as np

RESAMPLES = 2000
LEVEL = 0.95
TOLERANCE = 0.02


@dataclasses.dataclass(frozen=True)
class RatioInterval:
    """The point ratio of means and its bootstrap interval [low, high] at `level`."""

    ratio: float
    low: float
    high: float
    level: float

    def verdict(self, tolerance: float = TOLERANCE) -> str:
        if self.low > 1.0 + tolerance:
            return "miss"
        if self.high < 1.0 - tolerance:
            return "better"
        return "ok"


def _matrix(x, name: str) -> np.ndarray:
    a = np.asarray(x, dtype=np.float64)
    if a.ndim == 1:
        a = a[None, :]  # one repeat
    if a.ndim != 2 or a.size == 0:
        raise ValueError(f"{name} must be [repeats, requests] latencies, got shape {a.shape}")
    if not np.all(np.isfinite(a)) or np.any(a < 0):
        raise ValueError(f"{name} holds a negative or non-finite latency")
    return a


def _resampled_means(x: np.ndarray, rep_idx: np.ndarray, req_idx: np.ndarray) -> np.ndarray:
    """[B] means of x[rep_idx[b]][:, req_idx[b]] for every draw b (rep_idx [B, R], req_idx [B, n])."""
    sub = x[rep_idx[:, :, None], req_idx[:, None, :]]  # [B, R, n]
    return sub.mean(axis=(1, 2))  # [B]


def ratio_interval(policy, baseline, *, paired: bool = True, resamples: int = RESAMPLES, level: float = LEVEL,
                   seed: int = 0, over: str = "both") -> RatioInterval:
    """mean(policy) / mean(baseline) with its bootstrap interval (module doc). `policy`, `baseline`: [R, n] (or
    [n] for one repeat) latencies, row r and column q the same repeat and request in both. paired=False draws the
    baseline's indices independently (the interval an unpaired comparison would give). `over`: what is resampled,
    "both" (the bench's interval), or "repeats" or "requests" alone (the other kept whole: what more of each would
    narrow, benchmarks/interval_parts.py)."""
    x, y = _matrix(policy, "policy"), _matrix(baseline, "baseline")
    if x.shape != y.shape:
        raise ValueError(f"policy {x.shape} and baseline {y.shape} must hold the same repeats and requests")
    if y.mean() <= 0:
        raise ValueError("the baseline's mean latency must be > 0")
    if resamples < 1 or not 0.0 < level < 1.0:
        raise ValueError(f"need resamples >= 1 and 0 < level < 1, got {resamples}, {level}")
    if over not in ("both", "repeats", "requests"):
        raise ValueError(f"over must be 'both', 'repeats' or 'requests', got {over!r}")
    rng = np.random.default_rng(seed)
    r, n = x.shape

    def axis(size: int, drawn: bool) -> np.ndarray:
        """[resamples, size] indices: drawn with replacement, or every index once (kept whole)."""
        if drawn:
            return rng.integers(0, size, size=(resamples, size))
        return np.broadcast_to(np.arange(size), (resamples, size))

    def draw():
        return axis(r, over != "requests"), axis(n, over != "repeats")

    rep_x, req_x = draw()
    rep_y, req_y = (rep_x, req_x) if paired else draw()
    ratios = _resampled_means(x, rep_x, req_x) / _resampled_means(y, rep_y, req_y)  # [B]
    tail = 100.0 * (1.0 - level) / 2.0
    low, high = np.percentile(ratios, [tail, 100.0 - tail])
    return RatioInterval(float(x.mean() / y.mean()), float(low), float(high), level)
