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
    assert policy.calibration.factor(0) < 0.2 and policy.row_rates(v, 4)[0, 0] < before[0, 0] / 4
    assert policy.choose(v).k == 0


def test_calibration_shrinks_a_new_request_toward_the_proposer_ratio():
    cal = ConfidenceCalibration()
    assert cal.factor("new") == pytest.approx(1.0)
    for _ in range(50):
        cal.observe("a", predicted=2.0, accepted=1)
    assert cal.factor("a") == pytest.approx(0.5, abs=0.05)
    assert 0.5 < cal.factor("b") < 1.0  # unseen: the proposer-wide ratio, still near its prior
    cal.forget("a")
    assert cal.factor("a") == cal.factor("b")
