"""Profiler on a fake engine with an injected clock (no JAX compilation)."""

from __future__ import annotations

import argparse
import dataclasses
import json

import numpy as np
import pytest

from jaxspec import profiler
from jaxspec.policy.cost_model import CostModel, load_matching_profile
from jaxspec.policy.shape import step_shape
from jaxspec.types import StepResult
from tests.policy.sim import Clock, linear_cost


@dataclasses.dataclass(frozen=True)
class FakeConfig:
    num_slots: int = 4
    max_len: int = 512
    batch_buckets: tuple = (1, 2, 4)
    k_menu: tuple = (0, 2, 4)
    window_buckets: tuple = (128, 512)


@dataclasses.dataclass(frozen=True)
class FakeModelConfig:
    name: str = "fake-target"
    vocab_size: int = 32


@dataclasses.dataclass(frozen=True)
class FakeProposer:
    name: str = "ngram"


class FakeEngine:
    """Engine contract with synthetic step times: the clock advances by cost(B, k, W) per step."""

    def __init__(self, clock: Clock, cost, real_token_s=0.0, config=FakeConfig(), jitter=0.0):
        self.config, self.clock, self.cost, self.real_token_s = config, clock, cost, real_token_s
        self.jitter, self.rng = jitter, np.random.default_rng(0)
        self.model_config, self.proposer = FakeModelConfig(), FakeProposer()
        self.lengths = np.zeros(config.num_slots, np.int64)
        self.warmed = False
        self.steps: list[tuple[int, int, int]] = []

    def warmup(self, keys=None, progress=True):
        self.warmed = True
        return 0

    def prefill(self, slot, prompt, params, seed=0):
        assert all(0 <= t < self.model_config.vocab_size for t in prompt)
        self.lengths[slot] = len(prompt)
        return 0

    def free(self, slot):
        self.lengths[slot] = 0

    def step(self, slot_ids, k, row_k=None):
        """Runs at the engine's shape: rows all capped below k run a smaller k (and window)."""
        assert self.warmed, "profiling before warm-up"
        n = len(slot_ids)
        b = next(b for b in self.config.batch_buckets if b >= n)
        shape = step_shape(self.lengths[slot_ids], row_k, k, self.config.k_menu, self.config.window_buckets)
        k, w, caps = shape.k, shape.window, list(shape.caps)
        gap = b * (k + 1) - sum(c + 1 for c in caps)
        self.clock.now += self.cost(b, k, w) - self.real_token_s * gap + self.jitter * self.rng.random()
        self.steps.append((b, k, w))
        counts = np.array([c + 1 for c in caps])
        self.lengths[slot_ids] += counts
        return StepResult(tokens=np.zeros((n, k + 1), np.int32), counts=counts, proposed=np.array(caps))


def test_profile_times_every_shape_of_the_menu():
    fn = linear_cost(step=2e-3, per_token=0.1e-3, draft_step=0.3e-3, attention=0.05e-3)
    clock = Clock()
    engine = FakeEngine(clock, fn, real_token_s=0.02e-3)
    profile = profiler.profile_engine(engine, repeats=3, progress=False, clock=clock, wall_clock=lambda: 42.0,
                                      kind="fake-device")
    c = engine.config
    assert {e.shape for e in profile.entries} == {(b, k, w) for b in c.batch_buckets for k in c.k_menu
                                                  for w in c.window_buckets}
    for e in profile.entries:
        assert e.seconds == pytest.approx(fn(e.batch, e.k, e.window)) and e.samples == 3
    assert profile.real_token_s == pytest.approx(0.02e-3)
    assert profile.key.device_kind == "fake-device" and profile.key.model == "fake-target"
    assert profile.key.draft == "ngram" and profile.key.k_menu == c.k_menu and profile.created_unix == 42.0
    # every timed step ran at the shape it was recorded under (re-prefill kept the window fixed)
    assert set(engine.steps) == {e.shape for e in profile.entries}
    assert not engine.lengths.any()  # slots freed
    model = CostModel.from_profile(profile)
    assert model.step_time(4, 4, 512) == pytest.approx(fn(4, 4, 512))
    assert model.base_time(8, 4, 512) == pytest.approx(fn(8, 4, 512), rel=1e-6)  # not profiled: the fit


def test_profile_at_given_contexts_and_without_probe():
    clock = Clock()
    engine = FakeEngine(clock, linear_cost())
    profile = profiler.profile_engine(engine, contexts=[300], repeats=1, progress=False, clock=clock,
                                      real_token_probe=False, kind="x")
    assert {e.window for e in profile.entries} == {512} and profile.real_token_s == 0.0
    with pytest.raises(ValueError):
        profiler.profile_engine(engine, contexts=[600], progress=False, clock=clock, kind="x")
    with pytest.raises(ValueError):
        profiler.profile_engine(engine, repeats=0, progress=False, clock=clock, kind="x")


def test_timing_noise_does_not_invent_a_per_token_price():
    clock = Clock()
    engine = FakeEngine(clock, linear_cost(), real_token_s=0.0, jitter=1e-3)
    profile = profiler.profile_engine(engine, repeats=5, progress=False, clock=clock, kind="x")
    assert profile.real_token_s == 0.0
    engine = FakeEngine(clock, linear_cost(), real_token_s=0.05e-3, jitter=1e-5)
    profile = profiler.profile_engine(engine, repeats=5, progress=False, clock=clock, kind="x")
    assert profile.real_token_s == pytest.approx(0.05e-3, rel=0.1)


def test_default_contexts():
    assert profiler.default_contexts((256, 1024)) == (1, 256)
    assert profiler.default_contexts((256, 1024), k=3) == (1, 253)


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
        return FakeEngine(clock, linear_cost())

    parser = argparse.ArgumentParser()
    profiler.add_arguments(parser)
    args = parser.parse_args(["--proposer", "ngram", "--k-menu", "0,2,4", "--repeats", "2", "--no-progress",
                              "--out", str(tmp_path / "p.json"), "--json"])
    assert profiler.run(args, builder=builder) == 0
    assert seen[0].k_menu == (0, 2, 4) and seen[0].proposer == "ngram" and seen[0].menu is None
    assert (tmp_path / "p.json").exists()
    printed = json.loads(capsys.readouterr().out)
    assert printed["key"]["device_kind"] == "fake-device"
    # saved under the default name it is found by key
    monkeypatch.setenv("JAXSPEC_PROFILE_DIR", str(tmp_path / "profiles"))
    args = parser.parse_args(["--repeats", "1", "--no-progress"])
    assert profiler.run(args, builder=builder) == 0
    engine = FakeEngine(clock, linear_cost())
    assert load_matching_profile(profiler.profile_key(engine)) is not None
    assert "B=4" in capsys.readouterr().out
