"""Profiler on a fake engine with an injected clock (no JAX compilation)."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

from jaxspec.bench import profile_cmd
from jaxspec.engine import profiler
from jaxspec.engine.fake import FakeEngine
from jaxspec.menu import Menu, step_shape
from jaxspec.policy.cost_model import CostModel, load_matching_profile
from tests.policy.sim import Clock, linear_cost

MENU = Menu(num_slots=4, max_len=512, batch_buckets=(1, 2, 4), k_menu=(0, 2, 4), window_buckets=(128, 512),
            prefill_buckets=(128,))


class TimedFakeEngine(FakeEngine):
    """The contract's fake engine with synthetic step times: the clock advances by cost(B, k, W)
    per step, less `real_token_s` per token slot the rows' caps leave unused."""

    def __init__(self, clock: Clock, cost, real_token_s=0.0, jitter=0.0, menu: Menu = MENU):
        super().__init__(menu, vocab_size=32, model_name="fake-target", proposer_name="ngram", accept=1)
        self.clock, self.cost, self.real_token_s = clock, cost, real_token_s
        self.jitter, self.rng = jitter, np.random.default_rng(0)
        self.steps: list[tuple[int, int, int]] = []
        self.warmup()

    def step(self, slot_ids, k, row_k=None):
        result = super().step(slot_ids, k, row_k)
        key = self.calls[-1].key
        gap = key.batch * (key.k + 1) - int(result.proposed.sum()) - len(slot_ids)
        self.clock.now += (self.cost(key.batch, key.k, key.window) - self.real_token_s * gap
                           + self.jitter * self.rng.random())
        self.steps.append((key.batch, key.k, key.window))
        return result


def test_profile_times_every_shape_of_the_menu():
    fn = linear_cost(step=2e-3, per_token=0.1e-3, draft_step=0.3e-3, attention=0.05e-3)
    clock = Clock()
    engine = TimedFakeEngine(clock, fn, real_token_s=0.02e-3)
    profile = profiler.profile_engine(engine, repeats=3, progress=False, clock=clock, wall_clock=lambda: 42.0,
                                      kind="fake-device")
    c = engine.menu
    assert {e.shape for e in profile.entries} == {(b, k, w) for b in c.batch_buckets for k in c.k_menu
                                                  for w in c.window_buckets}
    for e in profile.entries:
        assert e.seconds == pytest.approx(fn(e.batch, e.k, e.window)) and e.samples == 3
    assert profile.real_token_s == pytest.approx(0.02e-3)
    assert profile.key.device_kind == "fake-device" and profile.key.model == "fake-target"
    assert profile.key.draft == "ngram" and profile.key.k_menu == c.k_menu and profile.created_unix == 42.0
    # every timed step ran at the shape it was recorded under (re-prefill kept the window fixed)
    assert set(engine.steps) == {e.shape for e in profile.entries}
    assert not any(engine.length(s) for s in range(MENU.num_slots))  # slots freed
    model = CostModel.from_profile(profile)
    assert model.step_time(4, 4, 512) == pytest.approx(fn(4, 4, 512))
    assert model.base_time(8, 4, 512) == pytest.approx(fn(8, 4, 512), rel=1e-6)  # not profiled: the fit


def test_profile_of_a_one_window_menu_re_prefills_before_growth_overruns_the_cache():
    """A menu whose only window is max_len (the tiny one): the steps' growth reaches the end of the cache,
    and the profiler starts the slots over instead of failing with a capacity error."""
    clock = Clock()
    menu = Menu(num_slots=2, max_len=64, batch_buckets=(1, 2), k_menu=(0, 4), window_buckets=(64,),
                prefill_buckets=(16,))
    engine = TimedFakeEngine(clock, linear_cost(), menu=menu)
    profile = profiler.profile_engine(engine, repeats=40, progress=False, clock=clock, kind="fake-device")
    assert {e.shape for e in profile.entries} == {(b, k, 64) for b in (1, 2) for k in (0, 4)}


def test_profile_at_given_contexts_and_without_probe():
    clock = Clock()
    engine = TimedFakeEngine(clock, linear_cost())
    profile = profiler.profile_engine(engine, contexts=[300], repeats=1, progress=False, clock=clock,
                                      real_token_probe=False, kind="x")
    assert {e.window for e in profile.entries} == {512} and profile.real_token_s == 0.0
    with pytest.raises(ValueError):
        profiler.profile_engine(engine, contexts=[600], progress=False, clock=clock, kind="x")
    with pytest.raises(ValueError):
        profiler.profile_engine(engine, repeats=0, progress=False, clock=clock, kind="x")


def test_timing_noise_does_not_invent_a_per_token_price():
    clock = Clock()
    engine = TimedFakeEngine(clock, linear_cost(), real_token_s=0.0, jitter=1e-3)
    profile = profiler.profile_engine(engine, repeats=5, progress=False, clock=clock, kind="x")
    assert profile.real_token_s == 0.0
    engine = TimedFakeEngine(clock, linear_cost(), real_token_s=0.05e-3, jitter=1e-5)
    profile = profiler.profile_engine(engine, repeats=5, progress=False, clock=clock, kind="x")
    assert profile.real_token_s == pytest.approx(0.05e-3, rel=0.1)


def test_default_contexts_are_the_middle_of_each_window():
    assert profiler.default_contexts((256, 1024)) == (128, 639)  # (1 + 255) // 2, (256 + 1023) // 2
    assert profiler.default_contexts((256, 1024), k=3) == (126, 636)  # (1 + 252) // 2, (253 + 1020) // 2


def test_close_windows_reach_every_shape_and_fit_the_cache():
    # windows 256 and 259 = max_len: a context of 257 would not fit k = 3; per-k contexts do
    windows, max_len = (256, 259), 259
    for k in (0, 1, 3):
        contexts = profiler.default_contexts(windows, k)
        assert all(ctx + k + 1 <= max_len for ctx in contexts)
        assert [step_shape([ctx], None, k, (0, 1, 3), windows).window for ctx in contexts] == list(windows)


def test_cli_run_saves_a_matching_profile(tmp_path, capsys, monkeypatch):
    clock = Clock()
    monkeypatch.setattr(profiler, "device_kind", lambda: "fake-device")
    seen = []

    def builder(args):
        seen.append(args)
        return TimedFakeEngine(clock, linear_cost())

    parser = argparse.ArgumentParser()
    profile_cmd.add_arguments(parser)
    args = parser.parse_args(["--proposer", "ngram", "--k-menu", "0,2,4", "--repeats", "2", "--no-progress",
                              "--out", str(tmp_path / "p.json"), "--json"])
    assert profile_cmd.run(args, builder=builder) == 0
    assert seen[0].k_menu == (0, 2, 4) and seen[0].proposer == "ngram" and seen[0].menu is None
    assert (tmp_path / "p.json").exists()
    printed = json.loads(capsys.readouterr().out)
    assert printed["key"]["device_kind"] == "fake-device"
    # saved under the default name it is found by key
    monkeypatch.setenv("JAXSPEC_PROFILE_DIR", str(tmp_path / "profiles"))
    args = parser.parse_args(["--repeats", "1", "--no-progress"])
    assert profile_cmd.run(args, builder=builder) == 0
    engine = TimedFakeEngine(clock, linear_cost())
    assert load_matching_profile(profiler.profile_key(engine)) is not None
    assert "B=4" in capsys.readouterr().out
