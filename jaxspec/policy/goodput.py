"""SmartSpec goodput policy (arXiv 2406.14066, DESIGN.md §7): pick k every step to maximise tokens/s.

For live rows i with acceptance estimates α_i (`AcceptanceTracker`) and the step cost T
(`CostModel`, padded bucket B, attention window W(k) from the longest context):

    E_i(k) = Σ_{j=0..k} α_i^j = (1 − α_i^{k+1}) / (1 − α_i)        (= k+1 at α_i = 1)
    G(k)   = Σ_i E_i(min(k, cap_i)) / T(B, k, W(k), r),   r = Σ_i (min(k, cap_i) + 1)
    k*     = argmax_{k ∈ menu} G(k)          (0 included; ties go to the smaller k)

`GoodputPerRequestPolicy` lets each row verify k_i ≤ K inside one padded step of shape K:

    G(K) = max_{k_i ≤ min(K, cap_i)}  Σ_i E_i(k_i) / T(B, K, W, r = Σ_i (k_i+1))

The cost is linear in the real tokens r with slope c = ∂T/∂r (factor · c_real, see cost_model),
so the optimum is a threshold set: add row tokens in decreasing order of their marginal gain
g = E_i(j) − E_i(j−1) = Π_{l≤j} α_{i,l} while g / c > G (adding raises the ratio iff its gain per second beats the current ratio; gains of a
row never increase with j, so the greedy order is valid and the first refusal ends it). With
c_real = 0 (a purely padded executable) every row with a useful token takes k_i = min(K, cap_i):
per-row k only pays off when verification is priced per real token.

Draft catch-up: a draft skips the tokens committed by k = 0 steps and is fed them (catch-up calls,
`BatchView.catch_up_calls`) before the next k > 0 step. That restart cost buys speculation for
the row's next tokens, so each k > 0 option is charged it amortised over them:

    T'(k) = T(k) + Σ_i n_i · c_call · E_i(k_i) / H_i,   H_i = min(tokens row i still wants, horizon)

where n_i is row i's pending calls and c_call the measured seconds per call (an EMA of what the
engine reports; 0 until a catch-up has been seen). Without it, a policy near break-even flips
between k = 0 and k > 0 and pays a catch-up at every flip; with it, it keeps its choice unless
the gain covers the restart.

Cold start: before the proposer has `explore_trials` verified trials, its rate is the uninformed
prior, and a prior under break-even would keep k = 0 forever, so nothing is ever measured (an
expensive draft at prior 0.5 does exactly that). Until then every row is evaluated at α = 1:
speculation is tried for a few steps and the measured rate takes over.

Feasibility: an option needs a window for max(context) + k + 1 (the engine's capacity check);
options above every row's cap are skipped (they only add padding), except the smallest menu value.
"""

from __future__ import annotations

import dataclasses
import heapq
from typing import Hashable

import numpy as np

from jaxspec.policy.acceptance import AcceptanceTracker, expected_tokens
from jaxspec.policy.base import BatchView, Decision, Policy
from jaxspec.policy.cost_model import CostModel, CostModelError
from jaxspec.policy.decision_log import DecisionLog
from jaxspec.types import StepResult


@dataclasses.dataclass(frozen=True)
class GoodputConfig:
    """positional: E from per-position rates α_{i,j} instead of one α_i per request.
    short_proposal_is_rejection: a row that proposed fewer tokens than it was allowed (prompt
      lookup found no continuation) counts the first missing one as a rejection, so α_i estimates
      the chance the *requested* token is accepted, which is what E_i(k) must predict; False
      conditions on what was proposed.
    log_size: records kept in the decision log.
    catch_up_horizon: tokens a draft catch-up is amortised over at most (see the module doc).
    catch_up_ema: weight of the newest measurement in the seconds-per-catch-up-call estimate.
    explore_trials: verified trials the proposer needs before its measured rate is trusted
      (until then rows are evaluated at α = 1, see "Cold start"); 0 = no exploration."""

    positional: bool = False
    short_proposal_is_rejection: bool = True
    log_size: int = 4096
    catch_up_horizon: int = 32
    catch_up_ema: float = 0.3
    explore_trials: int = 8


@dataclasses.dataclass(frozen=True)
class Option:
    """One evaluated menu option: padded k, per-row k_i, Σ E_i(k_i), T, and their ratio."""

    k: int
    row_k: tuple[int, ...]
    tokens: float
    seconds: float

    @property
    def goodput(self) -> float:
        return self.tokens / self.seconds


class GoodputPolicy(Policy):
    """One k for the whole batch (rows capped at their own room)."""

    name = "goodput"

    def __init__(self, cost_model: CostModel, acceptance: AcceptanceTracker | None = None,
                 config: GoodputConfig = GoodputConfig()):
        self.cost = cost_model
        self.acceptance = acceptance if acceptance is not None else AcceptanceTracker()
        self.config = config
        self.log = DecisionLog(config.log_size)
        self._last: tuple[Decision, Option] | None = None
        self.catch_up_call_s = 0.0  # measured seconds per draft catch-up call (EMA)

    # --- prediction ------------------------------------------------------------------

    def row_expectations(self, view: BatchView, k_max: int) -> np.ndarray:
        """[n, k_max+1] E_i(j) for j = 0..k_max."""
        ids = view.request_ids
        j = np.arange(k_max + 1)
        if self.acceptance.global_trials < self.config.explore_trials:  # cold start: try speculating
            return np.broadcast_to(j + 1.0, (len(ids), k_max + 1)).copy()
        if not self.config.positional:
            alphas = np.array([self.acceptance.alpha(r) for r in ids])
            return expected_tokens(alphas[:, None], j[None, :])
        rows = []
        for r in ids:
            a = self.acceptance.position_alphas(r)
            if k_max > len(a):
                a = np.concatenate([a, np.full(k_max - len(a), a[-1])])
            rows.append(np.concatenate([[1.0], 1.0 + np.cumsum(np.cumprod(np.clip(a[:k_max], 0.0, 1.0)))]))
        return np.stack(rows)

    def candidates(self, view: BatchView) -> list[int]:
        """Menu values that fit the cache and do not exceed every row's cap (smallest kept)."""
        if not view.request_ids:
            raise ValueError("the goodput policy needs at least one live row")
        longest = max(view.context_lens)
        top = max(view.row_max_k)
        fit = [k for k in view.k_menu if self.cost.fits(longest, k)]
        if not fit:
            raise CostModelError(f"no k of {view.k_menu} fits a context of {longest} "
                                 f"(windows {self.cost.window_buckets})")
        return [k for i, k in enumerate(fit) if i == 0 or k <= top]

    def allocate(self, view: BatchView, e: np.ndarray, k: int, window: int) -> Option:
        """Uniform k: every row at min(k, cap_i)."""
        row_k = tuple(min(k, c) for c in view.row_max_k)
        tokens = float(sum(e[i, ki] for i, ki in enumerate(row_k)))
        r = sum(ki + 1 for ki in row_k)
        return Option(k, row_k, tokens, self.cost.step_time(view.batch_bucket, k, window, r))

    def catch_up_seconds(self, view: BatchView, e: np.ndarray, row_k: tuple[int, ...]) -> float:
        """The share of pending draft catch-up a k > 0 step with these row k_i carries (module doc)."""
        total = 0.0
        for i, calls in enumerate(view.catch_up_calls):  # () when the proposer keeps no context
            horizon = max(1, min(view.row_max_k[i] + 1, self.config.catch_up_horizon))
            total += calls * self.catch_up_call_s * e[i, row_k[i]] / horizon
        return total

    def options(self, view: BatchView) -> list[Option]:
        """Every feasible menu option, evaluated (k > 0 ones with their catch-up share)."""
        ks = self.candidates(view)
        e = self.row_expectations(view, ks[-1])
        longest = max(view.context_lens)
        opts = [self.allocate(view, e, k, self.cost.window(longest, k)) for k in ks]
        return [o if o.k == 0 else dataclasses.replace(o, seconds=o.seconds + self.catch_up_seconds(view, e, o.row_k))
                for o in opts]

    # --- the contract ----------------------------------------------------------------

    def choose(self, view: BatchView) -> Decision:
        opts = self.options(view)
        best = max(opts, key=lambda o: (o.goodput, -o.k))
        row_k = best.row_k if (best.k > 0 and any(ki != best.k for ki in best.row_k)) else None
        decision = Decision(k=best.k, row_k=row_k, predicted_goodput={o.k: o.goodput for o in opts})
        self._last = (decision, best)
        return decision

    def observe(self, view: BatchView, decision: Decision, result: StepResult, elapsed_s: float) -> None:
        n = view.batch_size
        if len(result.counts) < n:
            raise ValueError(f"step result has {len(result.counts)} rows for a batch of {n}")
        requested = decision.row_k if decision.row_k is not None else (decision.k,) * n
        for i, rid in enumerate(view.request_ids):
            proposed, accepted = int(result.proposed[i]), int(result.accepted[i])
            if proposed > requested[i]:
                raise ValueError(f"row {i} verified {proposed} proposals but was allowed {requested[i]}")
            trials = requested[i] if self.config.short_proposal_is_rejection else proposed
            self.acceptance.observe(rid, accepted, trials)
        if result.catch_up_calls:
            per_call = result.catch_up_s / result.catch_up_calls
            w = self.config.catch_up_ema if self.catch_up_call_s > 0 else 1.0
            self.catch_up_call_s = (1 - w) * self.catch_up_call_s + w * per_call
        if elapsed_s > 0:  # a step the clock could not time (elapsed 0) carries no timing evidence
            window = self.cost.window(max(view.context_lens), decision.k)
            self.cost.observe(view.batch_bucket, decision.k, window, elapsed_s,
                              real_tokens=sum(r + 1 for r in requested))
        chosen = self._last[1] if self._last is not None and self._last[0] is decision else None
        self.log.record(view, decision, result, elapsed_s,
                        predicted_tokens=chosen.tokens if chosen else None,
                        predicted_seconds=chosen.seconds if chosen else None)

    def forget(self, request_id: Hashable) -> None:
        self.acceptance.forget(request_id)


class GoodputPerRequestPolicy(GoodputPolicy):
    """Padded K from the menu, per-row k_i ≤ K by greedy marginal gain (see module doc)."""

    name = "goodput-per-request"

    def allocate(self, view: BatchView, e: np.ndarray, k: int, window: int) -> Option:
        b, n = view.batch_bucket, view.batch_size
        caps = [min(k, c) for c in view.row_max_k]
        c = self.cost.real_token_time(b, k, window)  # seconds per added real token
        row_k = [0] * n
        tokens = float(e[:, 0].sum())
        seconds = self.cost.step_time(b, k, window, n)  # every row at k_i = 0
        # heap of each row's next marginal gain g = E_i(k_i+1) − E_i(k_i), best first
        heap = [(-(e[i, 1] - e[i, 0]), i) for i in range(n) if caps[i] > 0]
        heapq.heapify(heap)
        while heap:
            neg_g, i = heapq.heappop(heap)
            if not -neg_g * seconds > tokens * c:  # adding lowers (or keeps) tokens / seconds: stop
                break
            row_k[i] += 1
            tokens += -neg_g
            seconds += c
            j = row_k[i]
            if j < caps[i]:
                heapq.heappush(heap, (-(e[i, j + 1] - e[i, j]), i))
        r = sum(ki + 1 for ki in row_k)
        return Option(k, tuple(row_k), float(sum(e[i, ki] for i, ki in enumerate(row_k))),
                      self.cost.step_time(b, k, window, r))

    def choose(self, view: BatchView) -> Decision:
        opts = self.options(view)
        best = max(opts, key=lambda o: (o.goodput, -o.k))
        decision = Decision(k=best.k, row_k=best.row_k if best.k > 0 else None,
                            predicted_goodput={o.k: o.goodput for o in opts})
        self._last = (decision, best)
        return decision
