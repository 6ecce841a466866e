"""Acceptance estimates: truncated counts, convergence, tracking a change, prior, positions."""

from __future__ import annotations

import numpy as np
import pytest

from jaxspec.policy.acceptance import (
    AcceptanceConfig,
    AcceptanceTracker,
    expected_tokens,
    expected_tokens_positional,
    truncated_counts,
)
from tests.policy.sim import simulate_result


def test_truncated_counts():
    assert truncated_counts(0, 4) == (0, 1)  # rejected at position 1
    assert truncated_counts(2, 4) == (2, 3)  # 2 accepted, rejected at 3
    assert truncated_counts(4, 4) == (4, 4)  # ran out of proposals: no failure observed
    assert truncated_counts(0, 0) == (0, 0)
    with pytest.raises(ValueError):
        truncated_counts(5, 4)
    with pytest.raises(ValueError):
        truncated_counts(-1, 4)


def _feed(tracker, rid, alpha, k, steps, rng):
    naive_a = naive_n = 0
    for _ in range(steps):
        res = simulate_result([alpha], [k], rng)
        tracker.observe(rid, int(res.accepted[0]), k)
        naive_a += int(res.accepted[0])
        naive_n += k
    return naive_a / naive_n


@pytest.mark.parametrize("alpha", [0.1, 0.5, 0.9])
def test_converges_to_alpha(alpha):
    rng = np.random.default_rng(1)
    tracker = AcceptanceTracker(AcceptanceConfig(request_decay=0.99))
    naive = _feed(tracker, "r", alpha, 4, 2000, rng)
    assert tracker.alpha("r") == pytest.approx(alpha, abs=0.04)
    assert tracker.global_alpha() == pytest.approx(alpha, abs=0.03)
    if alpha == 0.9:  # accepted / proposed would be biased low by the truncation
        assert naive < alpha - 0.1


def test_follows_a_change_of_alpha():
    rng = np.random.default_rng(2)
    tracker = AcceptanceTracker()  # request_decay 0.9: memory of ~10 verifies
    _feed(tracker, "r", 0.9, 4, 200, rng)
    assert tracker.alpha("r") > 0.75
    _feed(tracker, "r", 0.2, 4, 40, rng)
    assert tracker.alpha("r") == pytest.approx(0.2, abs=0.12)
    _feed(tracker, "r", 0.8, 4, 40, rng)
    assert tracker.alpha("r") == pytest.approx(0.8, abs=0.12)


def test_prior_from_the_global_rate_for_new_requests():
    rng = np.random.default_rng(3)
    tracker = AcceptanceTracker(AcceptanceConfig(initial_alpha=0.5, prior_strength=4.0))
    assert tracker.alpha("new") == 0.5
    for rid in range(20):
        _feed(tracker, rid, 0.85, 4, 20, rng)
    assert tracker.alpha("unseen") == pytest.approx(0.85, abs=0.05)
    # one bad verify moves a new request only part of the way (prior strength 4 pseudo-trials)
    tracker.observe("fresh", 0, 4)
    assert 0.5 < tracker.alpha("fresh") < tracker.global_alpha()
    tracker.forget("fresh")
    assert tracker.observations("fresh") == 0
    assert tracker.alpha("fresh") == tracker.global_alpha()


def test_zero_proposals_carry_no_information():
    tracker = AcceptanceTracker()
    tracker.observe("r", 0, 0)
    assert tracker.observations("r") == 0 and tracker.tracked == 0
    with pytest.raises(ValueError):
        tracker.observe("r", 1, 0)


def test_per_position_rates():
    """Position j accepted with its own rate given 1..j−1 were: the estimator recovers each."""
    rng = np.random.default_rng(4)
    rates = [0.9, 0.6, 0.3, 0.3]
    tracker = AcceptanceTracker(AcceptanceConfig(request_decay=0.999, global_decay=0.9999, max_positions=4))
    for _ in range(4000):
        a = 0
        while a < 4 and rng.random() < rates[a]:
            a += 1
        tracker.observe("r", a, 4)
    est = tracker.position_alphas("r")
    np.testing.assert_allclose(est, rates, atol=0.05)
    np.testing.assert_allclose(tracker.global_position_alphas(), rates, atol=0.05)


def test_expected_tokens():
    assert expected_tokens(0.0, 5) == 1.0
    assert expected_tokens(1.0, 5) == 6.0
    assert expected_tokens(1.0 - 1e-12, 5) == pytest.approx(6.0)
    for a in (0.3, 0.9, 0.999):
        for k in range(9):
            assert expected_tokens(a, k) == pytest.approx(sum(a ** j for j in range(k + 1)), rel=1e-9)
    grid = expected_tokens(np.array([[0.5], [1.0]]), np.arange(3)[None, :])
    np.testing.assert_allclose(grid, [[1, 1.5, 1.75], [1, 2, 3]])
    assert expected_tokens_positional(np.array([0.5, 0.5]), 4) == pytest.approx(expected_tokens(0.5, 4))
    assert expected_tokens_positional(np.array([1.0, 0.5, 0.0]), 3) == pytest.approx(1 + 1 + 0.5)
    with pytest.raises(ValueError):
        expected_tokens(0.5, -1)


def test_config_validation():
    for bad in (dict(initial_alpha=1.5), dict(prior_strength=0), dict(request_decay=0), dict(max_positions=0)):
        with pytest.raises(ValueError):
            AcceptanceConfig(**bad)


def test_idle_steps_relax_toward_the_global_rate():
    rng = np.random.default_rng(6)
    tracker = AcceptanceTracker(AcceptanceConfig(idle_decay=0.98))
    _feed(tracker, "good", 0.9, 4, 200, rng)
    _feed(tracker, "bad", 0.05, 4, 30, rng)
    low = tracker.alpha("bad")
    for _ in range(300):  # k = 0 steps
        tracker.observe("bad", 0, 0)
    assert tracker.alpha("bad") == pytest.approx(tracker.global_alpha(), abs=0.02) and tracker.alpha("bad") > low + 0.3
    frozen = AcceptanceTracker(AcceptanceConfig(idle_decay=1.0))
    _feed(frozen, "bad", 0.05, 4, 30, rng)
    before = frozen.alpha("bad")
    frozen.observe("bad", 0, 0)
    assert frozen.alpha("bad") == before


def test_a_position_never_reached_takes_the_rate_of_the_one_before():
    """A policy that ran k ≤ 3 has no evidence past position 3: pricing positions 4.. at the uninformed prior
    (0.5) made a longer k look worse than it is, so it was never run and never measured."""
    rng = np.random.default_rng(7)
    tracker = AcceptanceTracker(AcceptanceConfig(initial_alpha=0.5, max_positions=8))
    for _ in range(400):
        a = 0
        while a < 3 and rng.random() < (0.3 if a == 0 else 0.9):
            a += 1
        tracker.observe("r", a, 3)
    g = tracker.global_position_alphas()
    assert g[0] == pytest.approx(0.3, abs=0.06) and g[2] == pytest.approx(0.9, abs=0.06)
    np.testing.assert_allclose(g[3:], g[2], atol=1e-9)  # unreached: the deepest measured position's rate
    np.testing.assert_allclose(tracker.position_alphas("r")[3:], g[3:], atol=1e-9)


def test_a_request_s_rare_deep_positions_shrink_toward_the_proposer_s():
    """One rejection at position 4 of a new request moves its α_4 by at most a fifth of the way (m = 4
    pseudo-trials at the proposer's rate), however old the request: no warm start that its first trials override."""
    rng = np.random.default_rng(8)
    tracker = AcceptanceTracker(AcceptanceConfig(prior_strength=4.0, max_prior_strength=4.0, max_positions=8))
    for rid in range(30):
        for _ in range(20):
            a = 0
            while a < 8 and rng.random() < 0.9:
                a += 1
            tracker.observe(rid, a, 8)
    for _ in range(30):  # an old request that only ever verified k = 1, all accepted
        tracker.observe("old", 1, 1)
    tracker.observe("old", 3, 8)  # then reached position 4 once and was rejected there
    g4 = tracker.global_position_alphas()[3]
    assert g4 > 0.85 and tracker.position_alphas("old")[3] == pytest.approx(4 / 5 * g4)  # (0 + 4·g4) / (1 + 4)


def _copy_runs(state: dict, start: float, within: float, rng):
    """Prompt lookup's runs: the first proposal is accepted with `within` after a step that copied a run (all it was
    allowed, two or more), with `start` otherwise; later ones with `within`. Returns accepted of `allowed`."""
    def verify(allowed: int) -> int:
        accepted = 0
        while accepted < allowed and rng.random() < (within if accepted or state.get("run") else start):
            accepted += 1
        if allowed:
            state["run"] = accepted == allowed and accepted >= 2
        return accepted
    return verify


def test_run_state_finds_runs_and_their_first_rates():
    from jaxspec.policy.acceptance import RunState

    runs, state = RunState(), {}
    verify = _copy_runs(state, start=0.2, within=0.9, rng=np.random.default_rng(0))
    for _ in range(3000):
        runs.observe("r", verify(3), 3)
    after_rejection, after_run = runs.state_rates()
    assert runs.separated()
    assert after_rejection == pytest.approx(0.2, abs=0.05) and after_run == pytest.approx(0.9, abs=0.05)
    mine = runs.first_rates(["r"])[0]  # λ·G_s, λ the request's accepted over predicted (memory ~10 verifies)
    factor = mine[0] / after_rejection
    assert 0.5 < factor < 2.0 and mine[1] == pytest.approx(min(1.0, factor * after_run))
    assert np.array_equal(runs.first_rates(["new"])[0], runs.state_rates())  # a new request: λ = 1
    runs.forget("r")
    assert np.array_equal(runs.first_rates(["r"])[0], runs.state_rates())


def test_run_state_stays_off_when_steps_are_alike():
    """A draft's steps: every first proposal accepted with 0.6 whatever came before. The two rates differ by 2
    standard errors in under 1 % of the steps, so the policy keeps pricing as before."""
    from jaxspec.policy.acceptance import RunState

    runs, rng = RunState(), np.random.default_rng(1)
    separated = []
    for _ in range(3000):
        accepted = 0
        while accepted < 4 and rng.random() < 0.6:
            accepted += 1
        runs.observe("r", accepted, 4)
        separated.append(runs.separated())
    assert sum(separated) < 0.01 * len(separated)


def test_run_state_ignores_k0_steps_and_rejects_bad_counts():
    from jaxspec.policy.acceptance import RunState

    runs = RunState()
    runs.observe("r", 3, 3)  # a copied run
    runs.observe("r", 0, 0)  # a k = 0 step: no evidence, the state stays
    runs.observe("r", 0, 2)
    assert runs._first[1][1] == 1.0 and runs._first[0][1] == 1.0  # one verify after a rejection, one after a run
    with pytest.raises(ValueError):
        runs.observe("r", 3, 2)


def _run_requests(tracker, rates, verifies, rng, start=0):
    """Requests with these first-proposal rates, each verifying one proposal `verifies` times, then finished."""
    for i, alpha in enumerate(rates):
        for _ in range(verifies):
            tracker.observe(start + i, int(rng.random() < alpha), 1)
        tracker.forget(start + i)


def test_alike_requests_raise_the_shrinkage_and_unlike_ones_keep_it():
    """A token draft's requests accept alike (0.2 each): the weight that predicts their verifies best is the
    grid's largest, so a new request's one accepted verify moves its first rate by little (with m = 4 it would be
    (1 + 4·0.2) / 5 = 0.36). Requests that differ (0.05 and 0.95, prompt lookup's copy-or-not) keep the configured
    4, and max_prior_strength = prior_strength turns the measurement off."""
    rng = np.random.default_rng(5)
    alike = AcceptanceTracker()
    assert alike.request_strength == 4.0  # no evidence: the configured weight
    _run_requests(alike, [0.2] * 16, 30, rng)
    assert alike.request_strength == 64.0
    alike.observe("new", 1, 1)
    alike.observe("new", 1, 1)  # discounted: 0.9 + 1 accepted of 0.9 + 1 verified
    g = alike.global_position_alphas()[0]
    assert alike.position_alphas("new")[0] == pytest.approx((1.9 + 64 * g) / (1.9 + 64))

    unlike = AcceptanceTracker()
    _run_requests(unlike, [0.05, 0.95] * 8, 30, rng)
    assert unlike.request_strength == 4.0
    unlike.observe("new", 1, 1)
    unlike.observe("new", 1, 1)  # discounted: 0.9 + 1 accepted of 0.9 + 1 verified
    g = unlike.global_position_alphas()[0]
    assert unlike.position_alphas("new")[0] == pytest.approx((1.9 + 4 * g) / (1.9 + 4))

    fixed = AcceptanceTracker(AcceptanceConfig(max_prior_strength=4.0))
    _run_requests(fixed, [0.2] * 16, 30, rng)
    assert fixed.request_strength == 4.0


def test_the_shrinkage_is_scored_on_the_verifies_a_policy_chose():
    """A policy speculates on a request only while its rate looks high: with m = 4 a lucky verify lifts a 0.15 draft's
    request over a 0.25 threshold and its next verifies come from that selection. Scoring the weights on exactly
    those verifies (the ones chosen) still finds the large one, and the chosen steps' predicted rate then comes within
    0.05 of what they realise (with m fixed at 4 it overpredicts by more)."""
    def run(config):
        rng, tracker, predicted, realised = np.random.default_rng(2), AcceptanceTracker(config), [], []
        for rid in range(128):
            for step in range(31):
                rate = 1.0 if tracker.global_trials < 8 else tracker.position_alphas(rid)[0]
                if rate > 0.25 or (step % 16 == 0 and rid % 2 == 0):  # chosen, or explored now and then
                    accepted = int(rng.random() < 0.15)
                    tracker.observe(rid, accepted, 1)
                    if tracker.global_trials > 8:
                        predicted.append(rate)
                        realised.append(accepted)
                else:
                    tracker.observe(rid, 0, 0)
            tracker.forget(rid)
        return tracker.request_strength, np.mean(predicted) - np.mean(realised)

    strength, bias = run(AcceptanceConfig())
    fixed_strength, fixed_bias = run(AcceptanceConfig(max_prior_strength=4.0))
    assert strength == 64.0 and fixed_strength == 4.0
    assert abs(bias) < 0.05 < fixed_bias


def test_measured_strength_settings_are_checked():
    with pytest.raises(ValueError):
        AcceptanceConfig(max_prior_strength=2.0)
    assert AcceptanceConfig(prior_strength=4.0, max_prior_strength=40.0).strengths.tolist() == [4, 8, 16, 32]
