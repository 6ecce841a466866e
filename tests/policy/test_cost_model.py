"""Cost model: profile JSON, least-squares fit, window mapping, per-row pricing, online correction."""

from __future__ import annotations

import json

import numpy as np
import pytest

from jaxspec.policy.cost_model import (CostEntry, CostModel, CostModelError, CostProfile, LinearCostFit,
                                       OnlineCostConfig, ProfileKey, features, load_matching_profile)
from tests.policy.sim import MENU_B, MENU_K, WINDOWS, cost_model, linear_cost

KEY = ProfileKey("cpu", "tiny", "ngram", MENU_B, MENU_K, WINDOWS)


def _profile(fn, drop=()):
    entries = tuple(CostEntry(b, k, w, fn(b, k, w), 3) for b in MENU_B for k in MENU_K for w in WINDOWS
                    if (b, k, w) not in drop)
    return CostProfile(KEY, entries, real_token_s=1e-5, created_unix=123.0)


def test_fit_recovers_a_linear_cost_and_prices_unprofiled_shapes():
    fn = linear_cost(step=5e-3, per_token=0.1e-3, draft_step=1e-3, draft_token=0.02e-3, attention=0.03e-3)
    fit = LinearCostFit.fit(_profile(fn).entries)
    np.testing.assert_allclose(fit.coef, [1e-3, 0.02e-3, 5e-3, 0.1e-3, 0.03e-3], rtol=1e-6, atol=1e-12)
    assert fit.propose(4, 3, 256) + fit.verify(4, 3, 256) == pytest.approx(fn(4, 3, 256))
    assert fit.propose(4, 0, 256) == 0.0
    # shapes outside the profile (B=32, k=12, W=4096) come from the fit
    model = CostModel.from_profile(_profile(fn, drop={(4, 3, 256)}))
    assert (4, 3, 256) not in model.table
    assert model.base_time(4, 3, 256) == pytest.approx(fn(4, 3, 256), rel=1e-6)
    assert model.base_time(32, 12, 4096) == pytest.approx(fn(32, 12, 4096), rel=1e-6)


def test_fit_is_non_negative_on_noisy_data():
    rng = np.random.default_rng(0)
    fn = linear_cost(step=5e-3, per_token=0.1e-3, draft_step=0.0)
    entries = [CostEntry(b, k, w, fn(b, k, w) * rng.uniform(0.9, 1.1)) for b in MENU_B for k in MENU_K
               for w in WINDOWS]
    fit = LinearCostFit.fit(entries)
    assert all(c >= 0 for c in fit.coef)
    for e in entries:
        assert fit(e.batch, e.k, e.window) == pytest.approx(e.seconds, rel=0.2)


def test_table_first_and_a_miss_without_fit_raises():
    model = CostModel({(1, 0, 256): 0.01, (1, 4, 256): 0.02}, window_buckets=WINDOWS)
    assert model.step_time(1, 4, 256) == 0.02
    with pytest.raises(CostModelError, match="not profiled"):
        model.step_time(1, 2, 256)


def test_profile_json_round_trip_and_key_matching(tmp_path):
    profile = _profile(linear_cost())
    path = profile.save(tmp_path / KEY.filename())
    assert CostProfile.load(path) == profile
    assert json.loads(path.read_text())["key"]["device_kind"] == "cpu"
    assert load_matching_profile(KEY, tmp_path) == profile
    other = ProfileKey("cpu", "tiny", "ngram", MENU_B, (0, 1), WINDOWS)
    assert other.filename() != KEY.filename()
    assert load_matching_profile(other, tmp_path) is None
    with pytest.raises(CostModelError, match="is for"):
        CostProfile.load(path, expect=other)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(CostModelError, match="not a"):
        CostProfile.load(bad)
    with pytest.raises(CostModelError):
        CostProfile(KEY, (CostEntry(1, 0, 256, 0.0),))
    with pytest.raises(CostModelError, match="duplicate"):
        CostProfile(KEY, (CostEntry(1, 0, 256, 1.0), CostEntry(1, 0, 256, 2.0)))


def test_window_mapping_matches_the_engine():
    model = cost_model()
    assert model.window(100, 4) == 256
    assert model.window(251, 4) == 256  # 251 + 4 + 1 = 256
    assert model.window(252, 4) == 1024
    assert model.fits(1019, 4) and not model.fits(1020, 4)
    with pytest.raises(CostModelError, match="no window"):
        model.window(1020, 4)


def test_per_row_pricing():
    fn = linear_cost()
    model = cost_model(fn, real_token_s=0.04e-3)
    full = model.step_time(4, 4, 256)
    assert full == pytest.approx(fn(4, 4, 256))
    # two rows capped at 0 save 2·4 verified tokens
    assert model.step_time(4, 4, 256, real_tokens=2 * 5 + 2 * 1) == pytest.approx(full - 8 * 0.04e-3)
    for bad in (0, 4 * 5 + 1):
        with pytest.raises(CostModelError):
            model.step_time(4, 4, 256, real_tokens=bad)
    with pytest.raises(CostModelError, match="too large"):
        cost_model(fn, real_token_s=1.0).step_time(4, 4, 256, real_tokens=4)


def test_split_into_propose_and_verify():
    fn = linear_cost(step=5e-3, per_token=0.1e-3, draft_step=1e-3)
    model = cost_model(fn)
    p, v = model.split(2, 4, 256)
    assert p + v == pytest.approx(model.padded_time(2, 4, 256))
    assert p == pytest.approx(4e-3, rel=1e-6)


def test_online_update_follows_a_shifted_cost():
    fn = linear_cost()
    model = cost_model(fn, ema_weight=0.1)
    shape = (4, 4, 256)
    for _ in range(60):  # the device got 1.5x slower at this shape
        model.observe(*shape, seconds=1.5 * fn(*shape))
    assert model.step_time(*shape) == pytest.approx(1.5 * fn(*shape), rel=0.01)
    # other shapes keep their profiled time
    assert model.factor(1, 0, 256) == 1.0 and model.step_time(4, 2, 256) == pytest.approx(fn(4, 2, 256))
    for _ in range(60):  # and back
        model.observe(*shape, seconds=fn(*shape))
    assert model.step_time(*shape) == pytest.approx(fn(*shape), rel=0.01)
    assert set(model.corrections()) == {"4,4,256"}


def test_online_update_is_bounded():
    fn = linear_cost()
    model = cost_model(fn, ema_weight=0.05, ratio_clip=4.0)
    model.observe(1, 2, 256, seconds=1000 * fn(1, 2, 256))  # a GC pause: ratio clipped to 4
    assert model.factor(1, 2, 256) == pytest.approx(1 + 0.05 * 3)
    with pytest.raises(ValueError):
        model.observe(1, 2, 256, seconds=0.0)
    with pytest.raises(ValueError):
        OnlineCostConfig(ema_weight=0.2)
    with pytest.raises(ValueError):
        OnlineCostConfig(ratio_clip=0.5)


def test_observe_accounts_for_real_tokens():
    fn = linear_cost()
    model = cost_model(fn, real_token_s=0.04e-3, ema_weight=0.1)
    # a step where 2 of 4 rows were capped at 0 took exactly the predicted time: no correction
    t = model.step_time(4, 4, 256, real_tokens=12)
    model.observe(4, 4, 256, seconds=t, real_tokens=12)
    assert model.factor(4, 4, 256) == pytest.approx(1.0)


def test_features_order():
    np.testing.assert_allclose(features(2, 3, 512), [3, 6, 1, 8, 4])
