"""The paired bootstrap of jaxspec/bench/intervals.py on synthetic latencies with a known answer."""

import numpy as np
import pytest

from jaxspec.bench.intervals import RatioInterval, ratio_interval


def _requests(rng, repeats=3, n=12):
    """[R, n] latencies: requests differ a lot (0.5 s .. 5 s), repeats a little (timing noise)."""
    per_request = rng.uniform(0.5, 5.0, size=n)  # [n]
    return per_request[None, :] * rng.normal(1.0, 0.01, size=(repeats, n))  # [R, n]


def test_a_known_five_percent_slowdown_is_excluded_from_one():
    rng = np.random.default_rng(1)
    base = _requests(rng)
    slower = base * 1.05 * rng.normal(1.0, 0.01, size=base.shape)
    iv = ratio_interval(slower, base)
    assert iv.low > 1.02 and iv.verdict() == "miss"
    assert iv.low <= iv.ratio <= iv.high and abs(iv.ratio - 1.05) < 0.01
    faster = ratio_interval(base / 1.05, base)
    assert faster.high < 0.98 and faster.verdict() == "better"


def test_identical_policies_have_an_interval_that_holds_one():
    rng = np.random.default_rng(2)
    base = _requests(rng)
    same = base * rng.normal(1.0, 0.01, size=base.shape)  # the same policy measured again
    iv = ratio_interval(same, base)
    assert iv.low < 1.0 < iv.high and iv.verdict() == "ok"
    exact = ratio_interval(base, base)
    assert exact.low == exact.high == exact.ratio == 1.0


def test_pairing_narrows_the_interval_on_correlated_requests():
    """Requests of very different length dominate the unpaired spread; pairing cancels them."""
    rng = np.random.default_rng(3)
    base = _requests(rng)
    other = base * 1.01 * rng.normal(1.0, 0.01, size=base.shape)
    paired = ratio_interval(other, base, paired=True)
    unpaired = ratio_interval(other, base, paired=False)
    assert (paired.high - paired.low) * 4 < unpaired.high - unpaired.low
    assert unpaired.low < 1.0 < unpaired.high  # unpaired cannot even see the sign of a 1 % change here
    assert paired.low > 1.0


def test_one_repeat_resamples_requests_and_the_seed_makes_it_reproducible():
    rng = np.random.default_rng(4)
    base = rng.uniform(1.0, 2.0, size=8)  # [n]: one repeat
    other = base * rng.normal(1.1, 0.05, size=8)
    a, b = ratio_interval(other, base, seed=7), ratio_interval(other, base, seed=7)
    assert a == b and a.low < a.ratio < a.high


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="same repeats"):
        ratio_interval(np.ones((2, 3)), np.ones((3, 3)))
    with pytest.raises(ValueError, match="non-finite"):
        ratio_interval([1.0, np.nan], [1.0, 1.0])
    with pytest.raises(ValueError, match="shape"):
        ratio_interval(np.ones((1, 2, 3)), np.ones((1, 2, 3)))
    assert RatioInterval(1.0, 1.021, 1.1, 0.95).verdict() == "miss"
    assert RatioInterval(1.0, 0.9, 0.979, 0.95).verdict() == "better"


def test_resampling_one_factor_tells_a_request_effect_from_a_repeat_effect():
    """ratio_interval(over=...), as benchmarks/interval_parts.py reads it: when only requests differ in how they
    favour a policy (every repeat alike), resampling the repeats alone gives a point and resampling the requests
    alone the whole spread; when only repeats differ, the other way round."""
    from benchmarks.interval_parts import cell_parts

    rng = np.random.default_rng(5)
    base = np.repeat(rng.uniform(1.0, 3.0, size=(1, 16)), 8, axis=0)  # [R, n]: every repeat alike
    by_request = base * rng.uniform(0.8, 1.2, size=(1, 16))  # each request favoured or not, in every repeat
    iv = ratio_interval(by_request, base, over="repeats")
    assert iv.low == pytest.approx(iv.high)
    iv = ratio_interval(by_request, base, over="requests")
    assert iv.high - iv.low > 0.05
    by_repeat = base * rng.uniform(0.8, 1.2, size=(8, 1))  # each repeat faster or slower, all its requests alike
    iv = ratio_interval(by_repeat, base, over="requests")
    assert iv.low == pytest.approx(iv.high)
    iv = ratio_interval(by_repeat, base, over="repeats")
    assert iv.high - iv.low > 0.05
    with pytest.raises(ValueError, match="over"):
        ratio_interval(base, base, over="prompts")

    record = {"latencies_s": by_request.tolist()}
    parts = cell_parts(record, {"latencies_s": base.tolist()})
    assert parts["repeats_x_requests"] == [8, 16]
    ratios = by_request[0] / base[0]  # [n]
    assert parts["per_request"] == pytest.approx([ratios.min(), ratios.max()])
    assert parts["per_repeat"][1] == pytest.approx(0.0, abs=1e-12)
    assert parts["both"][0] <= parts["ratio"] <= parts["both"][1]
    assert parts["repeats"][0] == pytest.approx(parts["repeats"][1])
