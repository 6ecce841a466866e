"""`jaxspec bench --quick` end to end on the tiny preset: JSON schema, a figure, goal checks."""

import argparse
import json

from jaxspec.bench import cli

REQUIRED = {"workload", "proposer", "policy", "rate", "mean_latency_s", "p50_latency_s", "p99_latency_s",
            "mean_ttft_s", "mean_tpot_s", "tokens_per_s", "acceptance", "k_hist"}


def test_quick_bench_end_to_end_on_tiny(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXSPEC_PROFILE_DIR", str(tmp_path / "profiles"))
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    out = tmp_path / "out"
    args = parser.parse_args(["--model", "tiny", "--quick", "--proposers", "ngram",
                              "--policies", "none,fixed:2,goodput",
                              "--k-menu", "0,2", "--capacity", "2", "--requests", "2", "--max-tokens", "6",
                              "--max-prompt-tokens", "200", "--load-fractions", "0.5,2", "--no-progress",
                              "--json", str(tmp_path / "r.json"), "--out", str(out)])
    assert cli.run(args) == 0
    result = json.loads((tmp_path / "r.json").read_text())
    records = result["records"]
    assert {r["workload"] for r in records} == {"chat", "summarization", "qa", "sql", "code"}  # quick keeps all
    assert {r["policy"] for r in records} == {"none", "fixed:2", "goodput"}
    assert len(records) == 5 * 2 * 3  # workload × rate × policy (one proposer)
    for r in records:
        assert REQUIRED <= set(r) and r["errors"] == 0 and r["proposer"] == "ngram"
        assert r["rate"] > 0 and r["mean_latency_s"] > 0
    rates = sorted({r["rate"] for r in records if r["workload"] == "chat"})
    assert rates[1] / rates[0] == 4.0 or abs(rates[1] / rates[0] - 4.0) < 1e-2  # fractions of the measured μ
    assert all(set(r["k_hist"]) <= {"0", "1", "2"} for r in records)  # per-row k: caps near max_tokens
    assert (out / "bench_latency_ngram.png").stat().st_size > 1000
    assert result["checks"]["goodput_vs_best_fixed"] and "machine" in result["meta"]


def test_bench_with_a_tree_runs_the_tree_beside_the_chain_of_the_same_width(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXSPEC_PROFILE_DIR", str(tmp_path / "profiles"))
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(["--model", "tiny", "--proposers", "ngram", "--workloads", "code",
                              "--policies", "none,fixed:4,goodput", "--tree", "4:2",
                              "--k-menu", "0,4", "--capacity", "2", "--requests", "2", "--max-tokens", "8",
                              "--max-prompt-tokens", "120", "--load-fractions", "0.5", "--no-progress", "--no-plots",
                              "--json", str(tmp_path / "r.json"), "--out", str(tmp_path / "out")])
    assert cli.run(args) == 0
    records = json.loads((tmp_path / "r.json").read_text())["records"]
    cells = {(r["proposer"], r["policy"]) for r in records}
    # the tree under fixed:4 and goodput (over the chains and the tree); none and the chain beside it
    assert cells == {("ngram", "none"), ("ngram", "fixed:4"), ("ngram", "goodput"), ("ngram-tree", "none"),
                     ("ngram-tree", "fixed:4"), ("ngram-tree", "goodput")}
    for r in records:
        assert r["errors"] == 0 and r["tokens_per_step"] >= 1.0


def test_goal_check_compares_goodput_with_every_fixed_k_that_ran():
    """The best baseline is the fastest of `none` and every `fixed:N` in the cell, whatever N was run."""
    def rec(policy, latency):
        return {"workload": "edit", "proposer": "ngram", "concurrency": 1, "policy": policy, "mean_latency_s": latency}

    records = [rec("none", 25.4), rec("fixed:2", 11.3), rec("fixed:8", 7.6), rec("goodput", 7.9)]
    checks = cli.check_goals(records)
    [check] = checks["goodput_vs_best_fixed"]
    assert check["best"] == "fixed:8" and abs(check["ratio"] - 7.9 / 7.6) < 1e-12 and check["ok"] is False
    [speedup] = checks["low_load_speedup_vs_none"]
    assert abs(speedup["speedup"] - 25.4 / 7.9) < 1e-12
