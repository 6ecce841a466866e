"""Goodput with a host proposer's confidences (suffix decoding): the match statistics are the prior of each
depth's acceptance, calibrated by the measured acceptance; k still comes from the menu, 0 included."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from jaxspec.policy.acceptance import ConfidenceCalibration
from jaxspec.policy.goodput import GoodputPolicy
from jaxspec.types import StepResult
from tests.policy.sim import cost_model, view


def _view(rates):
    return dataclasses.replace(view(len(rates)), proposal_rates=tuple(tuple(r) for r in rates))


def test_no_match_means_no_speculation_even_in_the_cold_start():
    policy = GoodputPolicy(cost_model())
    assert policy.choose(_view([(), ()])).k == 0


def test_confident_chains_speculate_as_far_as_they_reach():
    policy = GoodputPolicy(cost_model())
    assert policy.choose(_view([(1.0,) * 5, (1.0,) * 5])).k == 5  # nothing past the chain's 5 tokens pays
    assert policy.choose(_view([(1.0, 1.0, 0.05), (1.0, 1.0, 0.05)])).k == 2  # the third token is unlikely


def test_measured_acceptance_calibrates_the_confidences():
    policy = GoodputPolicy(cost_model())
    v = _view([(0.9,) * 4])
    before = policy.row_rates(v, 4)
    for _ in range(30):  # confident proposals that are always rejected
        decision = policy.choose(v)
        k = decision.k
        result = StepResult(tokens=np.zeros((1, k + 1), np.int64), counts=np.array([1]), proposed=np.array([k]))
        policy.observe(v, decision, result, 0.0)
    # priced down until speculating stops paying (then no step verifies anything more)
    assert policy.calibration.calibrated([0.9])[0] < 0.3 and policy.row_rates(v, 4)[0, 0] < before[0, 0] / 3
    assert policy.choose(v).k == 0


def test_each_confidence_bin_learns_its_own_acceptance_for_every_request():
    """A trie frequency is not an acceptance probability: tokens of confidence 1.0 accepted 60 % of the time and
    tokens of confidence 0.5 accepted 90 % are each priced at their own measured rate, which a single scale factor
    on the confidences cannot do (it would price both at one ratio); a new request gets the learned map."""
    cal = ConfidenceCalibration()
    assert cal.rates("new", [1.0, 0.5]) == pytest.approx([1.0, 0.5])  # no evidence: the confidences themselves
    rng = np.random.default_rng(0)
    for i in range(3000):
        conf, p = (1.0, 0.6) if i % 2 else (0.5, 0.9)
        cal.observe(i % 7, [conf], int(rng.random() < p))
    assert [cal.calibrated([c])[0] for c in (1.0, 0.5)] == pytest.approx([0.6, 0.9], abs=0.08)
    assert [cal.rates("new", [c])[0] for c in (1.0, 0.5)] == pytest.approx([0.6, 0.9], abs=0.08)


def test_the_map_learns_that_deeper_tokens_of_a_chain_hold_more_often():
    """Confidence-1 tokens accepted 70 % of the time at depth 1 and always after it (a copied run): each depth
    group is priced at its own rate."""
    cal = ConfidenceCalibration()
    rng = np.random.default_rng(1)
    for i in range(2000):
        cal.observe(i % 5, [1.0] * 6, 6 if rng.random() < 0.7 else 0)
    assert cal.calibrated([1.0] * 6) == pytest.approx([0.7, 1.0, 1.0, 1.0, 1.0, 1.0], abs=0.05)


def test_a_request_whose_proposals_do_worse_than_the_map_is_priced_lower_and_forgotten():
    cal = ConfidenceCalibration()
    for i in range(100):  # proposer-wide: confidence-0.8 tokens are accepted as often as their confidence says
        cal.observe("others", [0.8], int(i % 5 != 0))
    for _ in range(50):
        cal.observe("a", [0.8, 0.8], 0)  # ... but request a's never are
    assert cal.factor("a") < 0.4 and cal.factor("b") == 1.0
    assert cal.rates("a", [0.8])[0] < cal.rates("b", [0.8])[0] / 2.5
    cal.forget("a")
    assert cal.factor("a") == 1.0


def test_only_verified_tokens_are_evidence():
    """A rejection at position 1 says nothing about positions 2..k (truncated data): their bins keep their prior."""
    cal = ConfidenceCalibration()
    for _ in range(100):
        cal.observe("a", [0.3, 1.0, 1.0], 0)
    assert cal.calibrated([0.3])[0] < 0.05 and cal.calibrated([1.0])[0] == pytest.approx(1.0)
