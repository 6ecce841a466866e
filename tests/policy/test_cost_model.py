"""Cost model: profile JSON, least-squares fit, step shapes, per-row pricing, online correction."""

from __future__ import annotations

import json

import numpy as np
import pytest

from jaxspec.menu import menu_step_shapes, step_shape
from jaxspec.policy.cost_model import (
    CostEntry,
    CostModel,
    CostModelError,
    CostProfile,
    LinearCostFit,
    OnlineCostConfig,
    ProfileKey,
    features,
    load_matching_profile,
)
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


def test_shapes_come_from_the_engines_function():
    model = cost_model()
    assert model.shape([100], None, 4, MENU_K) == step_shape([100], None, 4, MENU_K, WINDOWS)
    assert model.shape([251], None, 4, MENU_K).window == 256  # 251 + 4 + 1 = 256
    assert model.shape([252], None, 4, MENU_K).window == 1024
    # a long row capped at 0 does not push the window of a short row at k = 4
    assert model.shape([255, 100], [0, 8], 4, MENU_K).window == 256
    with pytest.raises(CostModelError, match="no window"):
        model.shape([1020], None, 4, MENU_K)


def test_the_menus_shapes_are_step_shape_at_every_k():
    """`menu_step_shapes` (what goodput prices each step) is `step_shape` at each k of the menu, windows that no
    bucket holds included (window None), and rejects what step_shape rejects."""
    rng = np.random.default_rng(0)
    for _ in range(300):
        n = int(rng.integers(1, 9))
        lens = rng.integers(1, 1100, size=n).tolist()
        caps = rng.integers(0, 9, size=n).tolist()
        menu = sorted({0, *rng.choice([1, 2, 3, 4, 5, 6, 8], size=int(rng.integers(1, 5)), replace=False).tolist()})
        windows = None if rng.random() < 0.2 else WINDOWS
        assert menu_step_shapes(lens, caps, menu, windows) == [step_shape(lens, caps, k, menu, windows) for k in menu]
    assert menu_step_shapes([1020], [8], (0, 8), (256, 1024))[1].window is None  # 1020 + 8 + 1 > 1024
    for bad in (([], [], (0, 1)), ([5], [-1], (0, 1)), ([5, 6], [1], (0, 1)), ([5], None, (0, 1))):
        with pytest.raises(ValueError):
            menu_step_shapes(*bad, WINDOWS)


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


def test_a_device_faster_than_its_profile_corrects_every_shape():
    """Only k = 0 is observed, 4x faster than profiled: the shapes with k > 0, never run, are
    priced 4x faster too (a per-shape correction alone would leave them at the profile)."""
    fn = linear_cost()
    model = cost_model(fn)
    for _ in range(100):
        for b in (1, 4):
            model.observe(b, 0, 256, seconds=fn(b, 0, 256) / 4)
    assert model.factor(16, 0, 1024) == pytest.approx(0.25, rel=0.01)  # never observed, no drafting: exp(d)
    for shape in ((4, 4, 256), (1, 8, 256), (16, 2, 1024)):
        assert model.step_time(*shape) == pytest.approx(fn(*shape) / 4, rel=0.01), shape
    for _ in range(200):  # and back
        model.observe(4, 0, 256, seconds=fn(4, 0, 256))
    assert model.step_time(4, 4, 256) == pytest.approx(fn(4, 4, 256), rel=0.01)


def test_a_draft_slower_than_profiled_is_not_charged_to_k0():
    """Steps with k > 0 take longer than profiled in proportion to their drafting: the shared
    correction learns it as a draft slope, so k = 0 (no drafting), never run, keeps its profile."""
    profiled = linear_cost(step=10e-3, draft_step=0.5e-3)
    actual = linear_cost(step=10e-3, draft_step=2e-3)
    model = cost_model(profiled)
    for _ in range(60):
        for k in (2, 4):
            model.observe(1, k, 256, seconds=actual(1, k, 256))
    assert model.factor(16, 8, 1024) > model.factor(16, 0, 1024)  # never observed: exp(d + b·π), so b > 0
    # k = 2 and 4 run 1.27x and 1.49x their profile; a device-only reading would charge k = 0 ~1.4x
    assert model.step_time(1, 0, 256) == pytest.approx(actual(1, 0, 256), rel=0.06)  # extrapolated
    assert model.step_time(1, 3, 256) == pytest.approx(actual(1, 3, 256), rel=0.03)  # interpolated
    assert model.step_time(1, 4, 256) == pytest.approx(actual(1, 4, 256), rel=0.01)  # observed


def test_two_nearby_shapes_do_not_tilt_the_slope_onto_k0():
    """A B = 4 step at k = 1 observed 1.45x its profile twice, k = 3 as profiled three times (a bench's decision
    log, module doc): a draft "faster than profiled" must not be fitted through the two and extrapolated to k = 0.
    With the two-sided prior of a slower draft, k = 0 was priced 1.9x its profile, above k = 1's price; with the
    prior against a faster draft, under 1.3x and below it. The mirror case (k = 3 slow) still reads as a slower
    draft, and k = 0 stays near its profile."""
    fn = linear_cost()

    def observed(slow_k, fast_k, **online):
        model = cost_model(fn, **online)
        for _ in range(2):
            model.observe(4, slow_k, 256, seconds=1.45 * fn(4, slow_k, 256))
        for _ in range(3):
            model.observe(4, fast_k, 256, seconds=fn(4, fast_k, 256))
        return model

    symmetric = observed(1, 3, faster_draft_prior=1e-4)
    assert symmetric.step_time(4, 0, 256) > 1.8 * fn(4, 0, 256)
    assert symmetric.step_time(4, 0, 256) > symmetric.step_time(4, 1, 256)
    model = observed(1, 3)
    assert model.factor(16, 8, 1024) < model.factor(16, 0, 1024)  # never observed: exp(d + b·π), so b < 0
    assert model.step_time(4, 0, 256) < 1.3 * fn(4, 0, 256)
    assert model.step_time(4, 0, 256) < model.step_time(4, 1, 256)
    mirror = observed(3, 1)
    assert mirror.factor(16, 8, 1024) > mirror.factor(16, 0, 1024)
    assert mirror.step_time(4, 0, 256) < 1.05 * fn(4, 0, 256)


def test_a_shape_that_deviates_on_its_own_keeps_its_residual():
    fn = linear_cost()
    model = cost_model(fn, ema_weight=0.1)
    for _ in range(60):  # one shape got 1.5x slower, the others run as profiled
        model.observe(4, 4, 256, seconds=1.5 * fn(4, 4, 256))
        for other in ((4, 0, 256), (4, 2, 256), (4, 6, 256)):
            model.observe(*other, seconds=fn(*other))
    # its residual keeps most of it (shrunk by n_s / (n_s + τ) ≈ 10/11 with w = 0.1), the others little
    assert model.step_time(4, 4, 256) > 1.3 * fn(4, 4, 256)
    for other in ((4, 0, 256), (4, 2, 256), (1, 0, 256)):
        assert model.step_time(*other) == pytest.approx(fn(*other), rel=0.1), other


def test_online_update_is_bounded():
    fn = linear_cost()
    model = cost_model(fn, ratio_clip=4.0)
    model.observe(1, 2, 256, seconds=1000 * fn(1, 2, 256))  # a GC pause: ratio clipped to 4
    for shape in ((1, 2, 256), (1, 0, 256), (16, 8, 1024)):
        assert 1.0 <= model.factor(*shape) <= 4.0 + 1e-12
    with pytest.raises(ValueError):
        model.observe(1, 2, 256, seconds=0.0)
    for bad in (dict(ema_weight=0.2), dict(ratio_clip=0.5), dict(residual_prior=0.0), dict(device_prior=-1.0),
                dict(draft_prior=0.0), dict(faster_draft_prior=0.0)):
        with pytest.raises(ValueError):
            OnlineCostConfig(**bad)


def test_stale_evidence_fades_to_the_shared_correction():
    fn = linear_cost()
    model = cost_model(fn, ema_weight=0.1)
    for _ in range(30):
        model.observe(1, 0, 256, seconds=2 * fn(1, 0, 256))
    for _ in range(400):  # only another shape from now on, and the device is as profiled again
        model.observe(4, 0, 256, seconds=fn(4, 0, 256))
    assert model.step_time(1, 0, 256) == pytest.approx(fn(1, 0, 256), rel=1e-3)


def test_observe_accounts_for_real_tokens():
    fn = linear_cost()
    model = cost_model(fn, real_token_s=0.04e-3, ema_weight=0.1)
    # a step where 2 of 4 rows were capped at 0 took exactly the predicted time: no correction
    t = model.step_time(4, 4, 256, real_tokens=12)
    model.observe(4, 4, 256, seconds=t, real_tokens=12)
    assert model.factor(4, 4, 256) == pytest.approx(1.0)


def test_features_order():
    np.testing.assert_allclose(features(2, 3, 512), [3, 6, 1, 8, 4])
