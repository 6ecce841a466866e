"""The GPU check's pieces (benchmarks/gpu_floor.py) and the warm-up benchmark's arithmetic
(benchmarks/warmup_speed.py): the peak lookup, the bytes a decode step reads, the goals' verdicts."""

from __future__ import annotations

import pytest

from benchmarks.gpu_floor import (
    GOAL_DECODE_FRACTION,
    GOAL_STEP_OVER_BARE,
    bytes_per_step,
    decode_rows,
    goals,
    make_scheduler,
    overlap_option,
    peak_hbm_gbs,
)
from benchmarks.warmup_speed import summarize
from jaxspec.bench.floor import kv_window_mb, weight_mb
from jaxspec.engine.engine import Engine
from jaxspec.menu import Menu


@pytest.mark.parametrize("kind,gbs", [("NVIDIA H100 80GB HBM3", 3350.0), ("NVIDIA H200", 4800.0),
                                      ("NVIDIA H100 PCIe", 2000.0), ("NVIDIA H100 NVL", 3900.0),
                                      ("NVIDIA GH200 480GB", 4000.0), ("NVIDIA A100-SXM4-80GB", 2039.0),
                                      ("NVIDIA A100-SXM4-40GB", 1555.0), ("cpu", None), ("TPU v5 lite", None)])
def test_the_peak_is_looked_up_by_the_most_specific_device_name(kind, gbs):
    assert peak_hbm_gbs(kind) == gbs


def test_decode_rows_count_every_weight_and_each_rows_window_and_divide_by_the_peak(tiny_model):
    window, peak = 64, 100.0
    engine = Engine(tiny_model, None, Menu(num_slots=2, max_len=window, batch_buckets=(1, 2), k_menu=(0,),
                                           window_buckets=(window,), prefill_buckets=(32,)))
    engine.warmup(progress=False)
    rows = decode_rows(engine, [1, 2], window, repeats=2, peak=peak)
    assert [r["B"] for r in rows] == [1, 2]
    for r in rows:
        expected = weight_mb(engine) * 1e6 + r["B"] * kv_window_mb(engine, window) * 1e6
        assert r["bytes"] == pytest.approx(expected) and r["kv_bytes"] > 0
        assert r == r | bytes_per_step(engine, r["B"], window)
        assert r["engine_step_fraction"] == pytest.approx(r["bytes"] / (r["engine_step_ms"] / 1e3) / 1e9 / peak)
        assert r["executable_fraction"] == pytest.approx(r["bytes"] / (r["executable_ms"] / 1e3) / 1e9 / peak)
    assert all(engine.length(slot) == 0 for slot in range(2))  # reset afterwards


def _decode(fraction):
    return {"rows": [{"B": 1, "engine_step_fraction": fraction, "executable_fraction": fraction * 1.5},
                     {"B": 16, "engine_step_fraction": 0.9, "executable_fraction": 0.9}], "peak_gbs": 3350.0}


def _floor(ratio):
    return {"rows": [{"k": 4, "ratio": 1.0}, {"k": 0, "ratio": ratio}]}


@pytest.mark.parametrize("fraction,ratio,met", [(GOAL_DECODE_FRACTION, GOAL_STEP_OVER_BARE, [True, True]),
                                                (0.145, 1.67, [False, False]), (0.6, 2.0, [True, False])])
def test_goals_judge_the_b1_decode_fraction_and_the_k0_ratio(fraction, ratio, met):
    verdicts = goals(_decode(fraction), _floor(ratio))
    assert [g["value"] for g in verdicts] == [fraction, ratio]
    assert [g["met"] for g in verdicts] == met


def test_goals_are_unmeasured_without_their_pieces_or_on_a_dry_run():
    assert [g["met"] for g in goals(None, None)] == [None, None]
    assert [g["value"] for g in goals(None, None)] == [None, None]
    assert [g["met"] for g in goals(_decode(0.9), _floor(1.0), measured=False)] == [None, None]


def test_the_loop_is_chosen_through_the_schedulers_option_or_refused_without_one(tiny_model):
    engine = Engine(tiny_model, None, Menu(num_slots=1, max_len=64, batch_buckets=(1,), k_menu=(0,),
                                           window_buckets=(64,), prefill_buckets=(32,)))
    how = overlap_option()
    assert how in (None, "config", "scheduler")
    if how is None:
        with pytest.raises(ValueError, match="no overlapped loop"):
            make_scheduler(engine, None, overlap=True)
        assert make_scheduler(engine, None, overlap=None).engine is engine
    elif how == "config":
        assert make_scheduler(engine, None, overlap=False).config.overlap is False
        assert make_scheduler(engine, None, overlap=True).config.overlap is True


def test_warmup_summary_takes_medians_per_menu_and_mode():
    trials = [{"menu": "generate", "workers": w, "shapes": 6, "warmup_s": s}
              for w, s in ((1, 30.0), (4, 10.0), (4, 12.0), (1, 36.0), (1, 33.0), (4, 11.0))]
    (row,) = summarize(trials, 4)
    assert row["command"] == "jaxspec generate" and row["shapes"] == 6
    assert (row["serial_s"], row["parallel_s"]) == (33.0, 11.0)
    assert row["speedup"] == pytest.approx(3.0)
