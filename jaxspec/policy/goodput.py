"""SmartSpec goodput policy (arXiv 2406.14066): pick k every step to maximise tokens/s.

Design: docs/design.md, "The goodput policy".

For live rows i with acceptance estimates α_i (`AcceptanceTracker`) and the step cost T
(`CostModel`, padded bucket B):

    E_i(k) = Σ_{j=0..k} α_i^j = (1 − α_i^{k+1}) / (1 − α_i)        (= k+1 at α_i = 1)
    G(k)   = Σ_i E_i(k_i) / T(B, k', W, r),   k_i = min(k, cap_i),  r = Σ_i (k_i + 1)
    k*     = argmax_{k ∈ menu} G(k)          (0 included; ties go to the smaller k)

where (k', W) is the shape the engine runs the step at (`jaxspec.menu.step_shape`, the
one function both use): k' the smallest menu value ≥ max_i k_i, W the window of
max_i (len_i + k_i) + 1. A long row capped at a small k therefore does not push the window of
the others, and each observed step time is filed under the shape that actually ran.

`GoodputPerRequestPolicy` lets each row verify k_i ≤ K inside one padded step of shape K:

    G(K) = max_{k_i ≤ min(K, cap_i)}  Σ_i E_i(k_i) / T(B, K, W, r = Σ_i (k_i+1))

The cost is linear in the real tokens r with slope c = ∂T/∂r (factor · c_real, see cost_model),
so the optimum is a threshold set: add row tokens in decreasing order of their marginal gain
g = E_i(j) − E_i(j−1) = Π_{l≤j} α_{i,l} while g / c > G (adding raises the ratio iff its gain per
second beats the current ratio; gains of a row never increase with j, so the greedy order is
valid and the first refusal ends it; runs are not priced here, since a run's next step makes the gain of j = 2
larger than that of j = 1). With c_real = 0 (a purely padded executable) every row
with a useful token takes k_i = min(K, cap_i):
per-row k only pays off when verification is priced per real token. The allocation is then
priced at the shape it runs (a smaller k' and window when every row ended below K).

Draft catch-up: a draft skips the tokens committed by k = 0 steps and is fed them (catch-up calls,
`BatchView.catch_up_calls` and `catch_up_tokens`) before the next k > 0 step. That restart cost buys speculation for
the row's next tokens, so each k > 0 option is charged it amortised over them:

    T'(k) = T(k) + Σ_i (a · n_i + b · t_i) · E_i(k_i) / H_i,   H_i = min(tokens row i still wants, horizon)

where n_i is row i's pending calls, t_i their chunks' padded tokens, and a (seconds a call) and b (a token) are
fitted to the catch-ups the engine reported (`CatchUpCost`; 0 until a catch-up has been seen): the chunks range
from a few tokens after a short stretch at k = 0 to a prompt's worth. Without it, a policy near break-even flips
between k = 0 and k > 0 and pays a catch-up at every flip; with it, it keeps its choice unless
the gain covers the restart.

Cold start: before the proposer has `explore_trials` verified trials, its rate is the uninformed
prior, and a prior under break-even would keep k = 0 forever, so nothing is ever measured (an
expensive draft at prior 0.5 does exactly that). Until then every row's first proposal is evaluated
as accepted (α_1 = 1) and the deeper ones at what is known of them (the prior): speculation is tried
for a few steps, at the depth that prior prices, and the measured rates take over. The trials of
the steps in flight count as if observed (each row that verifies a proposal gives at least one), so
the overlapped loop, which chooses a step before it observes the one before, does not buy another
probe for evidence already on its way. Evaluating every
proposal as accepted made the probe the menu's deepest k, whatever it cost: in 13 bench cells the
cold steps took 4–11 % of goodput's step time, at 0.39–0.98× its tokens per second elsewhere in 10
of them (docs/benchmarks.md, "Goodput against fixed k, with intervals": the cold start).

Exploration: every `explore_every`-th decision runs a menu neighbour of the best option instead
(the next smaller or the next larger k, the side tried first alternating), if its predicted
goodput is within `explore_margin` of the best (G ≥ (1 − margin)·G*). Its shape's cost and the
rows' acceptance get fresh evidence, so estimates that drifted (k = 0 looking best on a device
faster than its profile, or one k looking cheap because only it was observed) cannot lock the
policy: goodput is unimodal in k in practice, and a better neighbour, once measured, takes over.
At most one decision in `explore_every` explores, giving up at most `explore_margin` of the
predicted goodput. A neighbour is judged as the one step it runs: with the whole draft catch-up it
would start, not the share amortised over the tokens a run of such steps enables. Amortised, an
exploration from k = 0 to k = 1 passed the margin at a fraction of its catch-up, ran it, and went
back to k = 0 (token draft, c = 4, a QA cell: 29 catch-up calls of ~10 ms against ~25 ms steps for
16 k = 1 steps, 6 of them explorations; docs/benchmarks.md, "Goodput against fixed k, with
intervals"). (An explored k = 0 step leaves the draft one more token to catch up.)

Token trees: a menu k that runs a tree envelope (`BatchView.trees`) is priced with the tree's own
expected tokens, E_i = 1 + Σ_{d=1..Z} Π_{j≤d} c_j from `TreeYieldTracker`'s measured per-depth continuation
rates of full-envelope tree steps (siblings' coverage included), each with the chain's α_d at that depth
as its prior (`row_rates`), at its own profiled
cost T(B, k, W); a row capped below the envelope is priced as the chain of its cap. Tree steps update
the tree estimate only (their accepted counts are not per-token chain trials). Cold start, per tree:
until the tree has `explore_trials` full-envelope steps of evidence it is evaluated at Z + 1 tokens
(every node of one path accepted), so a tree is tried once the chains' own cold start is over, and its
measured yield takes over after those few steps (a tree far from the best chain in k would never be
reached by neighbour exploration).

Host proposals (suffix decoding): when the view carries each row's ready chain with its confidences
(`BatchView.proposal_rates`: the trie frequency conf_i(d) of each token given the ones before it), the rates are
α_i(d) = min(1, κ_i·cal(conf_i(d))) for the chain's tokens and 0 past its end (a row with no match is priced at
k = 0), with no cold start (`ConfidenceCalibration`): cal maps a confidence to the acceptance measured for tokens
of its confidence bin (the confidence itself until the bin has evidence), κ_i is the request's accepted over
predicted tokens, shrunk toward 1. A row whose chain was proposed ahead of a step in flight
(`BatchView.assumed_rates`) has its first rate times Π cal of the assumed tokens, the chance its context is the
one assumed; the scheduler observes such a row's chain only if the assumption held.

Runs: prompt lookup accepts in runs. A step that accepted all it was allowed (two or more) ended inside a copied
span, and the next step's first proposal is then accepted several times as often as after a rejection (measured on
the recorded outputs of every workload, benchmarks/goodput_replay.py `outcome_before`). Rates that pool both kinds of
step price a short chain, which ends inside a run more often, too low and a long one too high. So, once `RunState`
shows the two first-position rates apart, the rows' chains are priced per state s (the first rate G_s of the row,
the positions after it as before) and each k by the tokens per step running it yields in the long run: with
E_s(k) the expectation from state s and P_s(k) the chance of a copied run (all k accepted, k ≥ 2),

    π(k) = P_0(k) / (P_0(k) + 1 − P_1(k)),      E_i(k) = π(k)·E_1(k) + (1 − π(k))·E_0(k)

which is what fixed:k yields on that process, the baseline goodput is judged against.

Feasibility: an option needs a window for its shape (the engine's capacity check); a menu value
above every row's cap runs as a smaller one and is evaluated once, as that one.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
from collections.abc import Hashable

import numpy as np

from jaxspec.menu import StepShape
from jaxspec.policy.acceptance import (
    RUN_MIN,
    AcceptanceConfig,
    AcceptanceTracker,
    ConfidenceCalibration,
    RunState,
    TreeYieldTracker,
)
from jaxspec.policy.base import BatchView, Decision, Policy
from jaxspec.policy.cost_model import CatchUpCost, CostModel, CostModelError
from jaxspec.policy.decision_log import DecisionLog
from jaxspec.types import StepResult


@dataclasses.dataclass(frozen=True)
class GoodputConfig:
    """positional: E from per-position rates α_{i,j} instead of one α_i per request (on in the shipped
      jaxspec/configs/policy.yaml: prompt lookup's first position is far less likely than the ones after it).
    short_proposal_is_rejection: a row that proposed fewer tokens than it was allowed (prompt
      lookup found no continuation) counts the first missing one as a rejection, so α_i estimates
      the chance the *requested* token is accepted, which is what E_i(k) must predict; False
      conditions on what was proposed.
    log_size: records kept in the decision log.
    catch_up_horizon: tokens a draft catch-up is amortised over at most (see the module doc).
    catch_up_window: the catch-ups the seconds-per-call and per-token fit keeps (`CatchUpCost`).
    explore_trials: verified trials the proposer needs before its measured rate is trusted
      (until then the first proposal is evaluated as accepted, see "Cold start"); 0 = no exploration.
    cold_start: what the cold start evaluates as accepted: "first" (the first proposal; the deeper ones at their
      prior) or "all" (every proposal: the probe is the menu's deepest k, whatever it costs; the earlier default).
    explore_every: every N-th decision may run a menu neighbour of the best option (see
      "Exploration"); 0 = never.
    explore_margin: ... if the neighbour's predicted goodput is at least (1 − margin) times the best's.
    run_state: with positional rates, price the first proposal by how the row's step before ended and each k by the
      tokens per step it yields in the long run, once the proposer's steps are shown not alike (see "Runs")."""

    positional: bool = False
    short_proposal_is_rejection: bool = True
    log_size: int = 4096
    catch_up_horizon: int = 32
    catch_up_window: int = 32
    explore_trials: int = 8
    explore_every: int = 16
    explore_margin: float = 0.25
    run_state: bool = True
    cold_start: str = "first"

    def __post_init__(self):
        if self.cold_start not in ("first", "all"):
            raise ValueError(f"cold_start must be 'first' or 'all', got {self.cold_start!r}")
        if self.explore_every < 0:
            raise ValueError(f"explore_every must be >= 0, got {self.explore_every}")
        if not 0.0 <= self.explore_margin < 1.0:
            raise ValueError(f"explore_margin must be in [0, 1), got {self.explore_margin}")


@dataclasses.dataclass(frozen=True)
class Option:
    """One evaluated menu option: menu k, per-row k_i, Σ E_i(k_i), T, and the shape the step runs at. With draft
    catch-up pending, T carries an amortised share of it; `unamortised_s` is the rest, which one step alone pays."""

    k: int
    row_k: tuple[int, ...]
    tokens: float
    seconds: float
    shape: StepShape
    unamortised_s: float = 0.0

    @property
    def goodput(self) -> float:
        return self.tokens / self.seconds

    @property
    def one_step_goodput(self) -> float:
        """Goodput of running this option once: the whole catch-up it starts charged to it."""
        return self.tokens / (self.seconds + self.unamortised_s)


@dataclasses.dataclass(frozen=True)
class _Pending:
    """A decision chosen and not yet observed: the option it ran, whether it explored, and the chain trials it
    will give (at least one per row that verifies a proposal; none for a tree, whose steps feed `trees`)."""

    decision: Decision
    option: Option
    explored: bool
    trials: int


class GoodputPolicy(Policy):
    """One k for the whole batch (rows capped at their own room)."""

    name = "goodput"

    def __init__(self, cost_model: CostModel, acceptance: AcceptanceTracker | None = None,
                 config: GoodputConfig = GoodputConfig()):
        self.cost = cost_model
        self.acceptance = acceptance if acceptance is not None else AcceptanceTracker()
        # tree estimates share the acceptance estimator's prior and memory settings
        self.trees = TreeYieldTracker(self.acceptance.config if isinstance(self.acceptance, AcceptanceTracker)
                                      else AcceptanceConfig())
        self.calibration = ConfidenceCalibration(self.trees.config)  # host proposers' confidences (suffix decoding)
        self.runs = RunState(self.trees.config)  # the first proposal by how the step before ended
        self.config = config
        self.log = DecisionLog(config.log_size)
        # decisions chosen but not yet observed (the overlapped loop chooses step t+1 before it observes step t)
        self._pending: collections.deque[_Pending] = collections.deque(maxlen=8)
        self.catch_up = CatchUpCost(config.catch_up_window)  # what a draft catch-up costs, measured
        self.decisions = 0  # choose() calls so far (the exploration schedule)
        self.explored = 0  # decisions that ran an exploration option

    # --- prediction ------------------------------------------------------------------

    def row_rates(self, view: BatchView, k_max: int) -> np.ndarray:
        """[n, k_max] α_i(d) for d = 1..k_max: the chance that row i's d-th proposal is accepted once the ones
        before it were (the first 1 in the cold start, so speculation is tried; one α_i per request unless
        positional)."""
        ids = view.request_ids
        if view.proposal_rates:  # the proposer's own confidences, calibrated by what was accepted
            return self.confidence_rates(view, k_max)
        # cold start: try speculating, until the trials observed and those the steps in flight will give suffice
        cold = self.acceptance.global_trials + sum(p.trials for p in self._pending) < self.config.explore_trials
        if cold and self.config.cold_start == "all":
            return np.ones((len(ids), k_max))
        if not self.config.positional:
            rates = np.repeat(np.array([self.acceptance.alpha(r) for r in ids])[:, None], k_max, axis=1)
        else:
            rows = []
            for r in ids:
                a = self.acceptance.position_alphas(r)
                if k_max > len(a):
                    a = np.concatenate([a, np.full(k_max - len(a), a[-1])])
                rows.append(np.clip(a[:k_max], 0.0, 1.0))
            rates = np.stack(rows).reshape(len(ids), k_max)  # [n, k_max]
        if cold and k_max:
            rates[:, 0] = 1.0  # the first proposal as accepted, the deeper ones at what is known of them
        return rates

    def confidence_rates(self, view: BatchView, k_max: int) -> np.ndarray:
        """[n, k_max] min(1, κ_i·cal(conf_i(d))) for the tokens of each row's ready chain, 0 past its end, the
        first times the chance that the tokens its chain assumes are committed (module doc, "Host proposals")."""
        rates = np.zeros((view.batch_size, k_max))
        for i, (rid, conf) in enumerate(zip(view.request_ids, view.proposal_rates, strict=True)):
            used = np.asarray(conf[:k_max], np.float64)
            rates[i, :len(used)] = self.calibration.rates(rid, used)
            if view.assumed_rates and view.assumed_rates[i] and len(used):
                rates[i, 0] *= float(np.prod(self.calibration.rates(rid, view.assumed_rates[i])))
        return rates

    def row_expectations(self, view: BatchView, k_max: int) -> np.ndarray:
        """[n, k_max+1] E_i(j) = 1 + Σ_{d≤j} Π_{d'≤d} α_i(d') for j = 0..k_max, or with runs priced (module doc,
        "Runs") the tokens per step of running j in the long run."""
        rates = self.row_rates(view, k_max)  # [n, k_max]
        ones = np.ones((len(view.request_ids), 1))
        if k_max and self.prices_runs(view):
            return np.concatenate([ones, self.run_expectations(rates, self.runs.first_rates(view.request_ids))],
                                  axis=1)
        reach = np.cumprod(rates, axis=1)  # [n, k_max] P(proposals 1..d all accepted)
        return np.concatenate([ones, 1.0 + np.cumsum(reach, axis=1)], axis=1)

    def prices_runs(self, view: BatchView) -> bool:
        """Whether rows are priced by `RunState`: positional chain rates past the cold start, states shown apart."""
        return (self.config.run_state and self.config.positional and not view.proposal_rates
                and self.acceptance.global_trials >= self.config.explore_trials and self.runs.separated())

    @staticmethod
    def run_expectations(rates: np.ndarray, first: np.ndarray) -> np.ndarray:
        """[n, J] long-run tokens per step of running j = 1..J, from positional rates [n, J] (positions ≥ 2 used)
        and the first position's rate after a rejection and after a copied run [n, 2] (module doc, "Runs")."""
        by_state = np.repeat(rates[:, None, :], 2, axis=1)  # [n, 2, J]
        by_state[:, :, 0] = first
        reach = np.cumprod(by_state, axis=2)  # [n, 2, J] P(proposals 1..d accepted | state)
        tokens = 1.0 + np.cumsum(reach, axis=2)  # [n, 2, J] E_s(j)
        run = reach.copy()  # [n, 2, J] P(a copied run at j | state): all j accepted, j ≥ RUN_MIN
        run[:, :, :RUN_MIN - 1] = 0.0
        leave, enter = 1.0 - run[:, 1], run[:, 0]  # [n, J] P(run -> no run), P(no run -> run)
        in_run = np.where(leave + enter > 1e-12, enter / np.maximum(leave + enter, 1e-12), 1.0)  # [n, J] stationary
        return in_run * tokens[:, 1] + (1.0 - in_run) * tokens[:, 0]  # [n, J]

    def shape(self, view: BatchView, k: int, row_caps=None) -> StepShape:
        """The shape a step at padded k runs at, rows capped at `row_caps` (default: their room)."""
        return self.cost.shape(view.context_lens, view.row_max_k if row_caps is None else row_caps, k, view.k_menu)

    def candidates(self, view: BatchView) -> list[StepShape]:
        """The shapes of the menu values that fit a window and run as themselves (a value above
        every row's cap runs as the smallest menu value ≥ the largest cap: evaluated once, as that)."""
        if not view.request_ids:
            raise ValueError("the goodput policy needs at least one live row")
        shapes = []
        for k, shape in zip(sorted(view.k_menu), self.cost.menu_shapes(view.context_lens, view.row_max_k,
                                                                       view.k_menu), strict=True):
            if shape.window is None:  # no window holds it (nor any larger k)
                break
            if shape.k == k:
                shapes.append(shape)
        if not shapes:
            raise CostModelError(f"no k of {view.k_menu} fits contexts up to {max(view.context_lens)} "
                                 f"(windows {self.cost.window_buckets})")
        return shapes

    def row_tokens(self, view: BatchView, e: np.ndarray, shape: StepShape) -> list[float]:
        """Expected tokens of each row in a step of this shape: E_i(k_i) for a chain; for a tree, the
        tree's estimate for a row at the full envelope, the chain of its cap for a capped row."""
        tree = view.tree_at(shape.k)
        if tree is None:
            return [e[i, ki] for i, ki in enumerate(shape.caps)]
        if self.trees.steps(shape.k) < self.config.explore_trials:  # cold start: try the tree
            return [tree.depth + 1.0 if ki == shape.k else e[i, ki] for i, ki in enumerate(shape.caps)]
        rates = self.row_rates(view, tree.depth)  # [B, Z] each row's chain α_d, the prior of its tree's c_d
        return [self.trees.expected(rid, shape.k, rates[i]) if ki == shape.k else e[i, ki]
                for i, (rid, ki) in enumerate(zip(view.request_ids, shape.caps, strict=True))]

    def allocate(self, view: BatchView, e: np.ndarray, shape: StepShape) -> Option:
        """Uniform k: every row at min(k, cap_i), as the shape says."""
        tokens = float(sum(self.row_tokens(view, e, shape)))
        seconds = self.cost.step_time(view.batch_bucket, shape.k, shape.window, shape.real_tokens)
        return Option(shape.k, shape.caps, tokens, seconds, shape)

    def catch_up_seconds(self, view: BatchView, e: np.ndarray, row_k: tuple[int, ...]) -> float:
        """The share of pending draft catch-up a k > 0 step with these row k_i carries (module doc)."""
        total = 0.0
        for i, (calls, tokens) in enumerate(zip(view.catch_up_calls, view.catch_up_tokens, strict=True)):
            horizon = max(1, min(view.row_max_k[i] + 1, self.config.catch_up_horizon))  # () without a draft
            total += self.catch_up.seconds(calls, tokens) * e[i, row_k[i]] / horizon
        return total

    def options(self, view: BatchView) -> list[Option]:
        """Every feasible menu option, evaluated (those that speculate with their catch-up share)."""
        shapes = self.candidates(view)
        e = self.row_expectations(view, shapes[-1].k)
        opts = [self.allocate(view, e, shape) for shape in shapes]
        # the whole catch-up a speculating step runs
        pending = self.catch_up.seconds(sum(view.catch_up_calls), sum(view.catch_up_tokens))
        if pending == 0:  # nothing to charge (prompt lookup, suffix decoding, a draft in step)
            return opts
        return [o if o.shape.k == 0 else
                dataclasses.replace(o, seconds=o.seconds + (share := self.catch_up_seconds(view, e, o.row_k)),
                                    unamortised_s=pending - share)
                for o in opts]

    def pick(self, opts: list[Option]) -> tuple[Option, bool]:
        """The best option, or on the exploration schedule a neighbour of it within the margin
        (module doc). Returns (option, explored)."""
        best = max(opts, key=lambda o: (o.goodput, -o.k))
        self.decisions += 1
        every = self.config.explore_every
        if not every or self.decisions % every:
            return best, False
        by_k: dict[int, Option] = {}  # the best option of each k that runs
        for o in opts:
            if o.shape.k not in by_k or o.goodput > by_k[o.shape.k].goodput:
                by_k[o.shape.k] = o
        ks = sorted(by_k)
        i = ks.index(best.shape.k)
        below = by_k[ks[i - 1]] if i > 0 else None
        above = by_k[ks[i + 1]] if i + 1 < len(ks) else None
        turn = self.decisions // every
        floor = (1.0 - self.config.explore_margin) * best.goodput
        for option in ((below, above) if turn % 2 else (above, below)):  # alternate the first side tried
            if option is not None and option.one_step_goodput >= floor:
                self.explored += 1
                return option, True
        return best, False

    # --- the contract ----------------------------------------------------------------

    def decision(self, option: Option, opts: list[Option]) -> Decision:
        """The engine's instructions for an option: its shape's k, per-row caps unless all at k."""
        k = option.shape.k
        row_k = option.row_k if (k > 0 and any(ki != k for ki in option.row_k)) else None
        return Decision(k=k, row_k=row_k, predicted_goodput={o.k: o.goodput for o in opts})

    def choose(self, view: BatchView) -> Decision:
        opts = self.options(view)
        option, explored = self.pick(opts)
        decision = self.decision(option, opts)
        trials = 0 if view.tree_at(option.shape.k) is not None else sum(1 for c in option.row_k if c > 0)
        self._pending.append(_Pending(decision, option, explored, trials))
        return decision

    def observe(self, view: BatchView, decision: Decision, result: StepResult, elapsed_s: float) -> None:
        n = view.batch_size
        if len(result.counts) < n:
            raise ValueError(f"step result has {len(result.counts)} rows for a batch of {n}")
        # the shape the engine ran (the same function it runs steps with)
        shape = self.cost.shape(view.context_lens, decision.row_k, decision.k, view.k_menu)
        tree = view.tree_at(shape.k)
        proposed_rows = np.asarray(result.proposed[:n]).tolist()  # [n]
        accepted_rows = np.asarray(result.accepted[:n]).tolist()  # [n]
        for i, rid in enumerate(view.request_ids):
            proposed, accepted = proposed_rows[i], accepted_rows[i]
            if proposed > shape.caps[i]:
                raise ValueError(f"row {i} verified {proposed} proposals but was allowed {shape.caps[i]}")
            if tree is not None:  # tree evidence only, from rows at the full envelope
                if shape.caps[i] == shape.k:
                    self.trees.observe(rid, shape.k, accepted, tree.depth)
                continue
            trials = shape.caps[i] if self.config.short_proposal_is_rejection else proposed
            self.acceptance.observe(rid, accepted, trials)
            self.runs.observe(rid, accepted, shape.caps[i])
            if view.proposal_rates:  # what the row's confidences predicted for the tokens it verified
                self.calibration.observe(rid, view.proposal_rates[i][:proposed], accepted)
        self.catch_up.observe(result.catch_up_calls, result.catch_up_tokens, result.catch_up_s)
        if elapsed_s > 0:  # a step the clock could not time (elapsed 0) carries no timing evidence
            self.cost.observe(view.batch_bucket, shape.k, shape.window, elapsed_s, real_tokens=shape.real_tokens)
        last = next((p for p in self._pending if p.decision is decision), None)
        if last is not None:
            self._pending.remove(last)
        self.log.record(view, decision, result, elapsed_s,
                        predicted_tokens=last.option.tokens if last else None,
                        predicted_seconds=last.option.seconds if last else None,
                        explored=last.explored if last else False)

    def forget(self, request_id: Hashable) -> None:
        self.acceptance.forget(request_id)
        self.trees.forget(request_id)
        self.calibration.forget(request_id)
        self.runs.forget(request_id)


class GoodputPerRequestPolicy(GoodputPolicy):
    """Padded K from the menu, per-row k_i ≤ K by greedy marginal gain (see module doc)."""

    name = "goodput-per-request"

    def prices_runs(self, view: BatchView) -> bool:
        """Never: the long-run expectation of runs (module doc, "Runs") is not concave in k_i (a run needs two
        accepted tokens, so the gain of j = 2 can exceed that of j = 1), and the greedy allocation needs it to be."""
        return False

    def allocate(self, view: BatchView, e: np.ndarray, shape: StepShape) -> Option:
        if view.trees:
            raise ValueError("goodput-per-request does not price token trees (use goodput)")
        b, n, k, window = view.batch_bucket, view.batch_size, shape.k, shape.window
        caps = shape.caps
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
        # priced at the shape it runs (a smaller k' and window if every row ended below K)
        ran = self.shape(view, k, row_k)
        return Option(k, ran.caps, float(sum(e[i, ki] for i, ki in enumerate(ran.caps))),
                      self.cost.step_time(b, ran.k, ran.window, ran.real_tokens), ran)

    def decision(self, option: Option, opts: list[Option]) -> Decision:
        k = option.shape.k
        return Decision(k=k, row_k=option.row_k if k > 0 else None, predicted_goodput={o.k: o.goodput for o in opts})
