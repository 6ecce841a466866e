"""Online acceptance estimates: a discounted Beta posterior per request, prior from the global rate.

Model. A proposal at position j is accepted with probability α given positions 1..j−1 were
(the chain model of SmartSpec). One verify of n proposals with a accepted is *truncated* data:
a successes, then one failure iff a < n (if a = n the chain stopped because the proposals ran
out, which says nothing about position n+1). So one observation contributes

    successes = a,   trials = a + [a < n]                                   (truncated_counts)

and the maximum-likelihood estimate is α̂ = Σ successes / Σ trials (not Σa / Σn, which is biased
low: with n = 4 and α = 0.9 it gives E[a]/n ≈ 0.77).

Estimator: Beta posterior with exponential forgetting, chosen over a plain moving average because
(i) it weighs observations by their trials (a verify of 8 proposals says more than one of 1),
(ii) a new request with no data starts at the prior — the proposer's global rate — and moves away
from it as its own evidence grows, with the prior's weight stated in pseudo-trials, and
(iii) discounting by γ per observation keeps it tracking a change of α (effective memory
≈ 1/(1−γ) observations). A request's counts start at the prior's pseudo-counts, m trials at the
global rate α_g, and decay with its data, so the prior fades (weight m·γⁿ after n verifies) once
the request has evidence of its own:

    s₀ = m·α_g,  t₀ = m;    s ← γ·s + successes,  t ← γ·t + trials;    α̂ = s / t

The proposer-wide rate α_g uses the same recursion (longer memory, prior `initial_alpha`).
A verify of nothing (a k = 0 step) is no evidence; it lets the request's counts relax toward
the prior with a slower γ_idle (s ← γ_idle·s + (1−γ_idle)·m·α_g, t ← γ_idle·t + (1−γ_idle)·m),
so a request parked at k = 0 by old bad evidence is probed again now and then instead of never
speculating anew (γ_idle = 1 turns this off).
Per-position rates α̂_j = P(accept j | accepted 1..j−1) count per position j (trials: positions 1..min(a+1, n);
successes: positions 1..a; discounted like the rest, (s_j, t_j) the data alone) and shrink toward what is known
of the position, with a weight of m pseudo-trials that does not fade:

    proposer-wide   g_1 = (S_1 + m·γ_gⁿ·α_0) / (T_1 + m·γ_gⁿ),   g_j = (S_j + m·g_{j−1}) / (T_j + m)   (j ≥ 2)
    request         α_j = (s_j + m·g_j) / (t_j + m)

A position the proposer has rarely reached is the one before it (not the uninformed prior α_0: a policy that
never ran that deep would never learn otherwise), and a request's rate at a position it reached a few times is
its proposer's, pulled by its own evidence (not a warm start its few trials then override: deep positions see few).

How far a request's own evidence pulls is measured. If requests differ little, a run of lucky verifies is luck,
not the request, and the weight m of the proposer's rate should be large; if they differ a lot (prompt lookup on a
prompt it can copy from and on one it cannot), small. Each m of a grid (prior_strength doubled up to
max_prior_strength) is scored by how well it would have predicted every verified position before seeing it, the
discounted log loss of its α_j (prequential: the policy verifies only what it chose to, and a weight that lets a
request's lucky verifies raise its rate is caught overpredicting exactly there); positions use the best-scored m
(`request_strength`; ties to the smaller). Measured at k = 1 on 32 requests of each workload (the default model, its
token draft, summarization and QA) requests differ so little that a beta-binomial fit gives m ≈ 28–50 (prompt
lookup: 5–14), where with m = 4 one accepted verify of a draft that accepts one proposal in five priced the request's
next at 0.36 ((1 + 4·0.2) / (1 + 4)). Only these chain rates use the measured weight: `RunState`'s request factor,
`TreeYieldTracker` and `ConfidenceCalibration` still shrink by the configured prior_strength.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Hashable, Sequence

import numpy as np


def truncated_counts(accepted: int, proposed: int) -> tuple[int, int]:
    """(successes, trials) of one verify: a successes, plus one failure iff a < n."""
    if not 0 <= accepted <= proposed:
        raise ValueError(f"need 0 <= accepted <= proposed, got accepted={accepted}, proposed={proposed}")
    return accepted, accepted + (1 if accepted < proposed else 0)


@dataclasses.dataclass(frozen=True)
class AcceptanceConfig:
    """Estimator settings.

    initial_alpha:   prior mean before the proposer has any global data.
    prior_strength:  m, the prior's weight in pseudo-trials (it fades as the request's data decays it).
    request_decay:   γ per observation for a request's counts (memory ≈ 1/(1−γ) steps).
    global_decay:    γ per observation for the proposer-wide counts (longer memory).
    max_positions:   positions tracked for per-position rates.
    idle_decay:      γ_idle per k = 0 step relaxing a request toward the global prior (1 = off).
    run_min_z:       standard errors by which the first position's rate after a copied run must differ from its
                     rate after a rejection before `RunState` prices steps by it.
    max_prior_strength: the largest weight scored for a request's per-position rates' shrinkage toward its
                     proposer's (prior_strength doubled up to it; = prior_strength: never measured; module doc).
    """

    initial_alpha: float = 0.5
    prior_strength: float = 4.0
    request_decay: float = 0.9
    global_decay: float = 0.995
    max_positions: int = 16
    idle_decay: float = 0.995
    run_min_z: float = 2.0
    max_prior_strength: float = 64.0

    def __post_init__(self):
        if not 0.0 <= self.initial_alpha <= 1.0:
            raise ValueError(f"initial_alpha must be in [0, 1], got {self.initial_alpha}")
        if self.prior_strength <= 0:
            raise ValueError(f"prior_strength must be > 0, got {self.prior_strength}")
        for name in ("request_decay", "global_decay", "idle_decay"):
            if not 0.0 < getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in (0, 1], got {getattr(self, name)}")
        if self.run_min_z < 0:
            raise ValueError(f"run_min_z must be >= 0, got {self.run_min_z}")
        if self.max_positions < 1:
            raise ValueError(f"max_positions must be >= 1, got {self.max_positions}")
        if self.max_prior_strength < self.prior_strength:
            raise ValueError(f"max_prior_strength must be >= prior_strength ({self.prior_strength}), "
                             f"got {self.max_prior_strength}")

    @property
    def strengths(self) -> np.ndarray:
        """[S] the request shrinkage weights scored (module doc): prior_strength doubled up to max_prior_strength."""
        count = int(np.floor(np.log2(self.max_prior_strength / self.prior_strength) + 1e-9)) + 1
        return self.prior_strength * 2.0 ** np.arange(count)


class _DiscountedCounts:
    """Discounted successes/trials overall (starting at prior pseudo-counts) and per position (the data alone)."""

    __slots__ = ("s", "t", "n_obs", "data_s", "data_t", "prior_weight")

    def __init__(self, prior: float, positions: int, strength: float):
        self.s = strength * prior
        self.t = strength
        self.n_obs = 0
        self.data_s = np.zeros(positions)  # [P] discounted successes per position, no prior
        self.data_t = np.zeros(positions)  # [P] discounted trials per position, no prior
        self.prior_weight = strength  # the pseudo-trials of the starting prior left after the decay

    def add(self, accepted: int, proposed: int, decay: float) -> None:
        succ, trials = truncated_counts(accepted, proposed)
        self.s = decay * self.s + succ
        self.t = decay * self.t + trials
        p = len(self.data_s)
        self.data_s *= decay
        self.data_t *= decay
        self.data_s[: min(succ, p)] += 1.0  # positions 1..a accepted
        self.data_t[: min(trials, p)] += 1.0  # positions 1..a (+ a+1 rejected if a < n)
        self.prior_weight *= decay
        self.n_obs += 1

    def relax(self, prior: float, strength: float, decay: float) -> None:
        """Decay toward the prior pseudo-counts (fixed point: s = m·prior, t = m); the per-position data fade, so
        the shrunk per-position rates move toward their prior."""
        self.s = decay * self.s + (1 - decay) * strength * prior
        self.t = decay * self.t + (1 - decay) * strength
        self.data_s *= decay
        self.data_t *= decay
        self.prior_weight = decay * self.prior_weight + (1 - decay) * strength

    @property
    def alpha(self) -> float:
        return self.s / self.t


class AcceptanceTracker:
    """Per-request α̂ (and per-position α̂_j) for one proposer, with the global rate as prior."""

    def __init__(self, config: AcceptanceConfig = AcceptanceConfig()):
        self.config = config
        self._global = _DiscountedCounts(config.initial_alpha, config.max_positions, config.prior_strength)
        self._global_rates: tuple[list[float], np.ndarray] | None = None  # α̂_j memoised until the next verify
        self._requests: dict[Hashable, _DiscountedCounts] = {}
        self.global_trials = 0  # trials observed so far (undiscounted): the evidence behind α̂_g
        self._strengths = config.strengths.tolist()  # [S] the request shrinkage weights scored
        self._strength_loss = [0.0] * len(self._strengths)  # [S] discounted log loss of each one's predictions

    # --- updates ---------------------------------------------------------------------

    def observe(self, request_id: Hashable, accepted: int, proposed: int) -> None:
        """One verify outcome of a request. proposed = 0 (a k = 0 step) is no evidence; it only
        relaxes a known request toward the prior (γ_idle)."""
        c = self.config
        counts = self._requests.get(request_id)
        if proposed == 0:
            if accepted != 0:
                raise ValueError(f"accepted={accepted} with nothing proposed")
            if counts is not None and c.idle_decay < 1.0:
                counts.relax(self.global_alpha(), c.prior_strength, c.idle_decay)
            return
        if counts is None:  # a new request starts at the proposer's current rates
            counts = self._requests[request_id] = _DiscountedCounts(self.global_alpha(), c.max_positions,
                                                                    c.prior_strength)
        elif len(self._strengths) > 1:  # (a new request's first verify is predicted alike by every weight)
            self._score_strengths(counts, accepted, proposed)
        counts.add(accepted, proposed, c.request_decay)
        self._global.add(accepted, proposed, c.global_decay)
        self._global_rates = None
        self.global_trials += truncated_counts(accepted, proposed)[1]

    def _score_strengths(self, counts: _DiscountedCounts, accepted: int, proposed: int) -> None:
        """Add each scored weight's log loss on this verify's positions, predicted before seeing it (module doc)."""
        succ, trials = truncated_counts(accepted, proposed)
        p = min(trials, len(counts.data_s))
        if p == 0:
            return
        # scalar arithmetic: a verify reaches a few positions, and numpy's per-call cost on [S, p] arrays doubled
        # the tracker's host time per row
        g = self._proposer_rates()[0]  # [P] (positions 1..p used)
        s, t = counts.data_s[:p].tolist(), counts.data_t[:p].tolist()  # [p] each
        decay, losses = self.config.global_decay, self._strength_loss
        for i, m in enumerate(self._strengths):
            loss = 0.0
            for j in range(p):
                rate = (s[j] + m * g[j]) / (t[j] + m)  # this weight's α_j; positions 1..a accepted, a + 1 rejected
                loss -= math.log(max(rate if j < succ else 1.0 - rate, 1e-6))
            losses[i] = decay * losses[i] + loss

    @property
    def request_strength(self) -> float:
        """m of a request's per-position shrinkage: the scored weight with the least loss (ties: the smaller)."""
        losses = self._strength_loss
        return float(self._strengths[losses.index(min(losses))])

    def forget(self, request_id: Hashable) -> None:
        self._requests.pop(request_id, None)

    # --- estimates -------------------------------------------------------------------

    def global_alpha(self) -> float:
        """Proposer-wide α̂_g (starts at `initial_alpha`)."""
        return self._global.alpha

    def alpha(self, request_id: Hashable) -> float:
        """Request α̂; the global rate for a request with no informative verify yet."""
        counts = self._requests.get(request_id)
        return self.global_alpha() if counts is None else counts.alpha

    def _proposer_rates(self) -> tuple[list[float], np.ndarray]:
        """The proposer-wide α̂_j [P] as floats and as an array, computed once per verify observed (every row of a
        batch reads them; scalar arithmetic, the same values as the array recursion)."""
        if self._global_rates is None:
            g, m = self._global, self.config.prior_strength
            s, t = g.data_s.tolist(), g.data_t.tolist()  # [P] each
            rates = [(s[0] + g.prior_weight * self.config.initial_alpha) / (t[0] + g.prior_weight)]
            for j in range(1, len(s)):
                rates.append((s[j] + m * rates[-1]) / (t[j] + m))  # shrunk toward the position before it
            self._global_rates = (rates, np.array(rates))
        return self._global_rates

    def global_position_alphas(self) -> np.ndarray:
        """[P] proposer-wide α̂_j, each shrunk toward the one before it (module doc)."""
        return self._proposer_rates()[1].copy()

    def position_alphas(self, request_id: Hashable) -> np.ndarray:
        """[P] α̂_j = P(accept position j | 1..j−1 accepted) for a request; global for a new one."""
        counts = self._requests.get(request_id)
        g = self._proposer_rates()[1]  # [P]
        if counts is None:
            return g.copy()
        m = self.request_strength
        return (counts.data_s + m * g) / (counts.data_t + m)  # [P] shrunk toward the proposer's (module doc)

    def observations(self, request_id: Hashable) -> int:
        """Informative verifies seen for a request (0 if unseen)."""
        counts = self._requests.get(request_id)
        return 0 if counts is None else counts.n_obs

    @property
    def tracked(self) -> int:
        return len(self._requests)


RUN_MIN = 2  # a verify that accepted all it was allowed, at least this many, ended inside a copied run


class RunState:
    """The first proposal of a step by how the request's step before ended (docs/design.md, "The goodput policy").

    Prompt lookup accepts in runs: a step that accepted all it was allowed (`RUN_MIN` or more) ended inside a copied
    span, and the next step's first proposal is then accepted several times as often as after a rejection. So each
    request is in state s = 1 after such a verify and s = 0 otherwise (a new request too; a k = 0 step keeps it), and
    the proposer-wide rate of position 1 in each state, from discounted counts (S_s, T_s) shrunk toward the pooled
    rate with m pseudo-trials, is

        G_s = (S_s + m·G) / (T_s + m),   G = (S_0 + S_1) / (T_0 + T_1);   a request's: min(1, λ_i·G_s)

    with λ_i = (a_i + m) / (p_i + m) its discounted accepted first proposals over those the G_s of its states
    predicted (1 for a new request). The states are used only once G_0 and G_1 differ by `run_min_z` standard
    errors (`separated`): a proposer whose steps are alike (a draft) is priced as before."""

    def __init__(self, config: AcceptanceConfig = AcceptanceConfig()):
        self.config = config
        self._first = [[0.0, 0.0], [0.0, 0.0]]  # [state][accepted, verified] position 1, proposer-wide, discounted
        self._state: dict[Hashable, int] = {}
        self._requests: dict[Hashable, list[float]] = {}  # request -> discounted [accepted, predicted] position 1

    def observe(self, request_id: Hashable, accepted: int, allowed: int) -> None:
        """One verify of a request allowed `allowed` proposals (a missing one a rejection), `accepted` accepted."""
        if not 0 <= accepted <= allowed:
            raise ValueError(f"need 0 <= accepted <= allowed, got accepted={accepted}, allowed={allowed}")
        if allowed == 0:
            return
        c = self.config
        state = self._state.get(request_id, 0)
        predicted = self._state_rates()[state]  # before this evidence
        first = self._first[state]
        first[0] = c.global_decay * first[0] + (accepted >= 1)
        first[1] = c.global_decay * first[1] + 1.0
        counts = self._requests.setdefault(request_id, [0.0, 0.0])
        counts[0] = c.request_decay * counts[0] + (accepted >= 1)
        counts[1] = c.request_decay * counts[1] + predicted
        self._state[request_id] = int(accepted == allowed and accepted >= RUN_MIN)

    def state_rates(self) -> np.ndarray:
        """[2] G_0 (after a rejection), G_1 (after a copied run)."""
        return np.array(self._state_rates())

    def _state_rates(self) -> tuple[float, float]:
        """(G_0, G_1) in scalar arithmetic (observed once a verified row)."""
        (s0, t0), (s1, t1) = self._first
        verified = t0 + t1
        pooled = (s0 + s1) / verified if verified > 0 else self.config.initial_alpha
        m = self.config.prior_strength
        return (s0 + m * pooled) / (t0 + m), (s1 + m * pooled) / (t1 + m)

    def separated(self) -> bool:
        """Whether G_0 and G_1 differ by `run_min_z` standard errors (and each state has a verify's evidence)."""
        (s0, t0), (s1, t1) = self._first
        if min(t0, t1) < 1:
            return False
        pooled = (s0 + s1) / (t0 + t1)
        se = math.sqrt(max(pooled * (1 - pooled), 1e-12) * (1 / t0 + 1 / t1))
        return bool(abs(s1 / t1 - s0 / t0) >= self.config.run_min_z * se)

    def first_rates(self, request_ids: Sequence[Hashable]) -> np.ndarray:
        """[n, 2] each request's min(1, λ_i·G_s) for s = 0, 1."""
        m = self.config.prior_strength
        factors = np.array([(a + m) / (p + m) for a, p in (self._requests.get(r, (0.0, 0.0)) for r in request_ids)])
        return np.minimum(1.0, factors[:, None] * self.state_rates()[None, :])  # [n, 2]

    def forget(self, request_id: Hashable) -> None:
        self._state.pop(request_id, None)
        self._requests.pop(request_id, None)


class TreeYieldTracker:
    """Per-depth continuation of token-tree steps, per request and proposer-wide.

    A tree step's accepted count is not a chain's truncated per-token trials (a rejected preferred child can
    be followed by an accepted sibling), so trees keep their own estimates, per depth. A full-envelope step of
    a tree Z deep that accepted a nodes reached depths 1..a and, if a < Z, stopped at depth a + 1. For each
    depth d the continuation rate c_d = P(the path reaches d | it reached d − 1) is the coverage of the tree's
    candidates there, siblings included. It is a discounted ratio of steps that reached d to steps that reached
    d − 1, shrunk toward a prior of m pseudo-trials: the request's own toward the proposer-wide rate, that
    toward the chain's rate at that depth, α_d (the preferred child alone; rows capped below the envelope are
    no evidence). With the request's counts (r_d, t_d) and the global ones (R_d, T_d), per envelope::

        g_d = (R_d + m·α_d) / (T_d + m),   c_d = (r_d + m·g_d) / (t_d + m),   E_tree = 1 + Σ_{d=1..Z} Π_{j≤d} c_j
    """

    def __init__(self, config: AcceptanceConfig = AcceptanceConfig()):
        self.config = config
        self._global: dict[int, np.ndarray] = {}  # k -> [2, Z]: discounted (reached d, reached d − 1)
        self._requests: dict[tuple[Hashable, int], np.ndarray] = {}  # (request, k) -> [2, Z]
        self._steps: dict[int, int] = {}  # k -> full-envelope steps observed (undiscounted)

    def observe(self, request_id: Hashable, k: int, accepted: int, depth: int) -> None:
        """One full-envelope step of the tree at k (at most `depth` deep) that accepted `accepted` nodes."""
        if not 0 <= accepted <= depth:
            raise ValueError(f"accepted must be in 0..{depth}, got {accepted}")
        d = np.arange(1, depth + 1)
        trial = np.stack([d <= accepted, d <= accepted + 1]).astype(np.float64)  # [2, Z] reached d, reached d − 1
        for store, key, decay in ((self._requests, (request_id, k), self.config.request_decay),
                                  (self._global, k, self.config.global_decay)):
            store[key] = decay * store.get(key, np.zeros((2, depth))) + trial  # one depth per k: shapes agree
        self._steps[k] = self._steps.get(k, 0) + 1

    def steps(self, k: int) -> int:
        """Full-envelope steps of the tree at k observed so far (the evidence behind its estimate)."""
        return self._steps.get(k, 0)

    def rates(self, request_id: Hashable, k: int, chain_rates: np.ndarray) -> np.ndarray:
        """c_d [Z] for a request's next full-envelope step at k, given the chain's α_d [Z] (see the class doc)."""
        m = self.config.prior_strength
        z = len(chain_rates)
        big_r, big_t = self._global.get(k, np.zeros((2, z)))
        g = (big_r + m * chain_rates) / (big_t + m)  # [Z]
        r, t = self._requests.get((request_id, k), np.zeros((2, z)))
        return (r + m * g) / (t + m)

    def expected(self, request_id: Hashable, k: int, chain_rates: np.ndarray) -> float:
        """E_tree, bonus token included, for a request's next full-envelope step at k (see the class doc)."""
        return 1.0 + float(np.sum(np.cumprod(self.rates(request_id, k, np.asarray(chain_rates, np.float64)))))

    def forget(self, request_id: Hashable) -> None:
        for key in [key for key in self._requests if key[0] == request_id]:
            del self._requests[key]


CONFIDENCE_BINS = (0.25, 0.5, 0.75, 0.9, 0.99)  # inner edges of the confidence bins; the last bin is [0.99, 1]
DEPTH_GROUPS = (2, 5)  # inner edges of the depth groups: d = 1, 2..4, 5 and deeper


class ConfidenceCalibration:
    """How a host proposer's confidences (suffix decoding's trie frequencies, `BatchView.proposal_rates`) map to
    acceptance. A trie frequency is not a probability of acceptance: one seen continuation has frequency 1, and a
    context seen with two continuations may be one the target always continues the same way; and the deeper a
    token of a chain, the likelier it holds once the ones before it did (measured on the agentic workload at
    fixed k = 8: confidence-1 tokens were accepted 0.77 of the time at depth 1, 0.89 at depths 2–4, 0.95 deeper,
    and tokens of confidence 0.25–0.5 only 0.09). So the map is learned, per bin b of confidence
    (`CONFIDENCE_BINS`) and depth (`DEPTH_GROUPS`), from every verified token: S_b, T_b = discounted accepted and
    verified tokens of that bin, a token verified only if the ones before it were accepted (truncated data,
    `truncated_counts`). A token of confidence c in bin b is accepted with

        cal(c) = (S_b + m·c) / (T_b + m)                      (c itself until the bin has evidence)

    and a request's rate is min(1, κ_i·cal(c)), with κ_i = (a_i + m) / (p_i + m) its own discounted accepted
    tokens over those the map predicted for it (so κ = 1 for a new request)."""

    def __init__(self, config: AcceptanceConfig = AcceptanceConfig()):
        self.config = config
        cells = (len(CONFIDENCE_BINS) + 1) * (len(DEPTH_GROUPS) + 1)
        self._accepted = [0.0] * cells  # [confidence bins × depth groups] discounted S_b (`_cells`)
        self._verified = [0.0] * cells  # [confidence bins × depth groups] discounted T_b
        self._requests: dict[Hashable, list[float]] = {}  # request -> discounted [accepted, predicted]

    @staticmethod
    def _cells(confidences):
        """(c clipped to [0, 1], the flat index of its (confidence bin, depth group)) of a chain's tokens at depths
        1..d; scalar, since a chain is a handful of tokens and this runs for every row a step."""
        for depth, c in enumerate(confidences, 1):
            c = min(max(float(c), 0.0), 1.0)
            yield c, (bisect.bisect_right(CONFIDENCE_BINS, c) * (len(DEPTH_GROUPS) + 1)
                      + bisect.bisect_right(DEPTH_GROUPS, depth))

    def calibrated(self, confidences) -> np.ndarray:
        """[d] cal(c) of a chain's tokens (depths 1..d), the proposer-wide map (no request factor)."""
        m, accepted, verified = self.config.prior_strength, self._accepted, self._verified
        return np.array([(accepted[cell] + m * c) / (verified[cell] + m) for c, cell in self._cells(confidences)],
                        np.float64)  # [d]

    def rates(self, request_id: Hashable, confidences) -> np.ndarray:
        """[d] min(1, κ_i·cal(c_d)): the chance each proposed token is accepted given the ones before it were."""
        return np.minimum(1.0, self.factor(request_id) * self.calibrated(confidences))

    def observe(self, request_id: Hashable, confidences, accepted: int) -> None:
        """One verify of a row whose `confidences` are those of the tokens it verified (its proposal, cut to what
        the step ran), `accepted` of them accepted."""
        if not len(confidences):
            return
        cfg = self.config
        predicted = float(np.sum(np.cumprod(self.calibrated(confidences))))  # by the map, before this evidence
        trials = truncated_counts(accepted, len(confidences))[1]
        decay = cfg.global_decay
        self._accepted = [decay * x for x in self._accepted]
        self._verified = [decay * x for x in self._verified]
        for depth, (_, cell) in enumerate(self._cells(confidences[:trials]), 1):
            self._verified[cell] += 1.0
            if depth <= accepted:
                self._accepted[cell] += 1.0
        counts = self._requests.setdefault(request_id, [0.0, 0.0])
        counts[0] = cfg.request_decay * counts[0] + accepted
        counts[1] = cfg.request_decay * counts[1] + predicted

    def factor(self, request_id: Hashable | None = None) -> float:
        """κ of a request: its accepted over predicted tokens with m pseudo-tokens at 1 (1 for an unseen one)."""
        accepted, predicted = self._requests.get(request_id, (0.0, 0.0))
        m = self.config.prior_strength
        return (accepted + m) / (predicted + m)

    def forget(self, request_id: Hashable) -> None:
        self._requests.pop(request_id, None)


def expected_tokens(alpha: float | np.ndarray, k: int | np.ndarray) -> np.ndarray:
    """E(k) = Σ_{j=0..k} α^j = (1 − α^{k+1}) / (1 − α), bonus token included; E = k+1 at α = 1.

    Vectorised over α and k (broadcast). Computed as the geometric sum itself for α near 1,
    where the closed form loses precision.
    """
    a = np.clip(np.asarray(alpha, dtype=np.float64), 0.0, 1.0)
    k = np.asarray(k)
    if np.any(k < 0):
        raise ValueError("k must be >= 0")
    near_one = np.abs(1.0 - a) < 1e-9
    safe = np.where(near_one, 0.5, a)
    closed = (1.0 - safe ** (k + 1)) / (1.0 - safe)
    return np.where(near_one, k + 1.0, closed)


def expected_tokens_positional(position_alphas: np.ndarray, k: int) -> float:
    """E(k) = 1 + Σ_{j=1..k} Π_{i≤j} α_i with per-position rates (positions past P reuse α_P)."""
    if k < 0:
        raise ValueError("k must be >= 0")
    a = np.asarray(position_alphas, dtype=np.float64)
    if k > len(a):
        a = np.concatenate([a, np.full(k - len(a), a[-1])])
    return float(1.0 + np.cumprod(np.clip(a[:k], 0.0, 1.0)).sum())
