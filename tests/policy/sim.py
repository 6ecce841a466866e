"""Pure-numpy simulation for policy tests: a proposer right with probability α, synthetic step costs.

No JAX compilation: StepResults are built from numpy draws, time comes from a synthetic cost
function through an injected clock.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Sequence

import numpy as np

from jaxspec.menu import step_shape
from jaxspec.policy.base import BatchView, Decision
from jaxspec.policy.cost_model import CostEntry, CostModel, LinearCostFit, OnlineCostConfig
from jaxspec.types import StepResult

MENU_B = (1, 2, 4, 8, 16)
MENU_K = (0, 1, 2, 3, 4, 5, 6, 8)
WINDOWS = (256, 1024)


def linear_cost(step=10e-3, per_token=0.05e-3, draft_step=1.5e-3, draft_token=0.0, attention=0.0):
    """T(B, k, W) = step + draft_step·k + draft_token·B·k + per_token·B·(k+1) + attention·B·(k+1)·W/1024."""
    def fn(b, k, w):
        verify_tokens = b * (k + 1)
        return (step + draft_step * k + draft_token * b * k + per_token * verify_tokens
                + attention * verify_tokens * w / 1024)
    return fn


def synthetic_cost_model(fn, batch_buckets: Sequence[int], k_menu: Sequence[int], window_buckets: Sequence[int], *,
                         real_token_s: float = 0.0, online: OnlineCostConfig = OnlineCostConfig()) -> CostModel:
    """A cost model profiled on fn(B, k, W) over the whole menu, plus its fit (synthetic step costs)."""
    entries = [CostEntry(b, k, w, float(fn(b, k, w))) for b in batch_buckets for k in k_menu for w in window_buckets]
    return CostModel({e.shape: e.seconds for e in entries}, LinearCostFit.fit(entries),
                     window_buckets=tuple(window_buckets), real_token_s=real_token_s, online=online)


def cost_model(fn=None, real_token_s=0.0, **online) -> CostModel:
    return synthetic_cost_model(fn or linear_cost(), MENU_B, MENU_K, WINDOWS, real_token_s=real_token_s,
                                online=OnlineCostConfig(**online))


def view(n: int, *, ids: Sequence[Hashable] | None = None, ctx: int = 100, caps: Sequence[int] | None = None,
         k_menu=MENU_K, buckets=MENU_B) -> BatchView:
    bucket = next(b for b in buckets if b >= n)
    return BatchView(request_ids=tuple(ids if ids is not None else range(n)), context_lens=(ctx,) * n,
                     row_max_k=tuple(caps if caps is not None else (k_menu[-1],) * n), k_menu=tuple(k_menu),
                     batch_bucket=bucket)


def simulate_result(alphas: Sequence[float], allowed: Sequence[int], rng: np.random.Generator) -> StepResult:
    """Row i: each of its `allowed[i]` proposals accepted with prob α_i until the first rejection."""
    n = len(alphas)
    k = max(allowed, default=0)
    accepted = np.zeros(n, np.int64)
    for i, (a, m) in enumerate(zip(alphas, allowed)):
        while accepted[i] < m and rng.random() < a:
            accepted[i] += 1
    return StepResult(tokens=np.zeros((n, k + 1), np.int32), counts=accepted + 1, proposed=np.asarray(allowed))


def allowed_rows(decision: Decision, n: int) -> tuple[int, ...]:
    return decision.row_k if decision.row_k is not None else (decision.k,) * n


@dataclasses.dataclass
class Clock:
    """Injected clock: time advances only when a simulated step runs."""

    now: float = 0.0

    def __call__(self) -> float:
        return self.now


def lookup_result(match: float) -> Callable[[Sequence[float], Sequence[int], np.random.Generator], StepResult]:
    """Prompt lookup's all-or-nothing proposals: a row finds a match with probability `match` and then proposes
    all it is allowed, each accepted with prob α_i until the first rejection; without one it proposes nothing.
    P(accept 1) = match·α_i, P(accept j | 1..j−1 accepted) = α_i for j ≥ 2."""
    def result(alphas, allowed, rng):
        n = len(alphas)
        found = rng.random(n) < match  # [n]
        res = simulate_result([a if f else 0.0 for a, f in zip(alphas, found)], allowed, rng)
        return dataclasses.replace(res, proposed=np.where(found, np.asarray(allowed), 0))
    return result


def run(policy, alphas_at: Callable[[int], Sequence[float]], steps: int, true_cost: Callable[[int, int, int], float],
        *, seed: int = 0, ctx: int = 100, caps=None, simulate=simulate_result) -> dict:
    """Drive `policy` for `steps` simulated steps; returns tokens, seconds, the chosen ks and per
    step tokens and seconds. Each step takes `true_cost` at the shape the engine would run; `simulate(alphas,
    allowed, rng)` gives its result (default: each proposal accepted with prob α_i)."""
    rng = np.random.default_rng(seed)
    clock = Clock()
    tokens, ks, step_tokens, step_seconds = 0, [], [], []
    for t in range(steps):
        alphas = alphas_at(t)
        v = view(len(alphas), ctx=ctx, caps=caps)
        d = policy.choose(v)
        allowed = allowed_rows(d, v.batch_size)
        res = simulate(alphas, allowed, rng)
        start = clock()
        shape = step_shape(v.context_lens, d.row_k, d.k, v.k_menu, WINDOWS)  # what the engine runs
        clock.now += true_cost(v.batch_bucket, shape.k, shape.window)
        policy.observe(v, d, res, clock() - start)
        tokens += int(res.counts.sum())
        ks.append(d.k)
        step_tokens.append(int(res.counts.sum()))
        step_seconds.append(clock() - start)
    return {"tokens": tokens, "seconds": clock.now, "ks": ks, "goodput": tokens / clock.now,
            "step_tokens": step_tokens, "step_seconds": step_seconds}
