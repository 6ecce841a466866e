"""benchmarks/gpu_bench.py, the GPU check's goodput stage, end to end on the tiny model (CPU smoke, measures nothing):
it runs, pages its cache (its max_len a whole number of KV pages), and gives every cell goodput's ratio to the best
fixed k with a 95 % interval over paired repeats, the policies taking turns."""

from __future__ import annotations

import json

from benchmarks import gpu_bench


def test_gpu_bench_gives_each_cell_an_interval_over_paired_repeats(tmp_path):
    rc = gpu_bench.main(["--presets", "tiny", "--dtype", "float32", "--quick", "--repeats", "2", "--slice", "0.5",
                         "--out", str(tmp_path)])
    result = json.loads((tmp_path / "gpu_bench.json").read_text(encoding="utf-8"))
    preset = result["presets"]["tiny"]
    assert rc == 0, preset.get("error")
    assert {r["repeats"] for r in preset["records"]} == {2}
    cells = preset["checks"]["goodput_vs_best_fixed"]
    assert len(cells) == 4  # --quick: 2 workloads x 2 rates
    for cell in cells:
        low, high = cell["ci95"]
        assert low <= cell["ratio"] <= high and cell["verdict"] in ("miss", "ok", "better")
