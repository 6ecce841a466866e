"""`jaxspec bench --quick` end to end on the tiny preset: JSON schema, a figure, goal checks."""

import argparse
import json

import pytest

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
                              "--policies", "none,fixed:2,fixed:4,goodput", "--tree", "4:2",
                              "--k-menu", "0,2,4", "--capacity", "2", "--requests", "2", "--max-tokens", "8",
                              "--max-prompt-tokens", "120", "--load-fractions", "0.5", "--no-progress", "--no-plots",
                              "--json", str(tmp_path / "r.json"), "--out", str(tmp_path / "out")])
    assert cli.run(args) == 0
    records = json.loads((tmp_path / "r.json").read_text())["records"]
    cells = {(r["proposer"], r["policy"]) for r in records}
    # the tree under fixed:4, a chain on its engine under fixed:2, goodput over both; none and the chains beside
    assert cells == {("ngram", "none"), ("ngram", "fixed:2"), ("ngram", "fixed:4"), ("ngram", "goodput"),
                     ("ngram-tree", "none"), ("ngram-tree", "fixed:2"), ("ngram-tree", "fixed:4"),
                     ("ngram-tree", "goodput")}
    tree_steps = {r["policy"]: r["k_hist"] for r in records if r["proposer"] == "ngram-tree"}
    assert set(tree_steps["fixed:2"]) <= {"0", "1", "2"}  # a chain on the tree's engine, never the tree
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


def test_repeats_pair_every_policy_and_report_intervals(tmp_path, monkeypatch, capsys):
    """--repeats 2: every policy runs each repeat on that repeat's one arrival draw (paired), records keep
    [repeat][request] latencies, and the checks carry goodput's ratio to the best fixed k with a 95 % interval."""
    from jaxspec.bench import loadgen

    monkeypatch.setenv("JAXSPEC_PROFILE_DIR", str(tmp_path / "profiles"))
    draws = []
    real = loadgen.poisson_arrivals

    def recorded(rate, n, seed=0):
        draws.append(seed)
        return real(rate, n, seed=seed)

    monkeypatch.setattr(loadgen, "poisson_arrivals", recorded)
    ran = []  # the policies in the order their cells ran
    real_scheduler = cli._scheduler

    def scheduler(engine, policy, *args):
        ran.append("none" if policy is None else policy.name)
        return real_scheduler(engine, policy, *args)

    monkeypatch.setattr(cli, "_scheduler", scheduler)
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(["--model", "tiny", "--proposers", "ngram", "--workloads", "code",
                              "--policies", "none,fixed:2,goodput", "--repeats", "2", "--decision-log",
                              "--k-menu", "0,2", "--capacity", "2", "--requests", "3", "--max-tokens", "6",
                              "--max-prompt-tokens", "120", "--rates", "50", "--no-progress", "--no-plots",
                              "--json", str(tmp_path / "r.json"), "--out", str(tmp_path / "out")])
    assert cli.run(args) == 0
    assert draws == [1, 2]  # one arrival draw per repeat, shared by all three policies
    assert len(ran) == 6 and ran[3:] == ran[:3][::-1]  # the second repeat runs the policies in reverse order
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["meta"]["smoke_test"] is False and len(result["meta"]["loadavg_before"]) == 3
    records = result["records"]
    assert {r["policy"] for r in records} == {"none", "fixed:2", "goodput"}
    for r in records:
        assert r["repeats"] == 2 and len(r["latencies_s"]) == 2 and all(len(x) == 3 for x in r["latencies_s"])
        assert abs(r["mean_latency_s"] - sum(map(sum, r["latencies_s"])) / 6) < 1e-9
        loop = r["loop"]  # where the loop's time went, over both repeats: inside their spans
        assert loop["decode_steps"] > 0 and loop["prefill_chunks"] >= 6
        assert 0 < loop["decode_s"] + loop["prefill_s"] <= 2 * r["span_s"] * 1.05
    [goodput] = [r for r in records if r["policy"] == "goodput"]
    assert len(goodput["decision_logs"]) == 2 and "predicted_goodput" in goodput["decision_logs"][0][0]
    [check] = result["checks"]["goodput_vs_best_fixed"]
    low, high = check["ci95"]
    assert low <= check["ratio"] <= high and check["verdict"] in ("miss", "better", "ok")
    assert check["repeats"] == 2 and check["paired_requests"] == 3
    assert check["ok"] == (check["verdict"] != "miss") and "ci95" in check["vs_none"]
    assert set(result["checks"]["better_than_each_fixed_shown"]) == {"code/ngram/fixed:2"}
    printed = capsys.readouterr().out
    assert "goodput / best" in printed and f"[{low:.3f}, {high:.3f}]" in printed
    assert "95 % CI" in (tmp_path / "out" / "bench.md").read_text()


@pytest.mark.parametrize("load, proposer", [(["--closed-loop", "2"], "ngram"), (["--rates", "50"], "ngram"),
                                            (["--closed-loop", "2"], "suffix")])
def test_slice_runs_a_cells_policies_at_once_each_on_its_own_engine(tmp_path, monkeypatch, load, proposer):
    """--slice: the policies of a cell take turns (each on its own engine and clock; suffix decoding with its own
    index of outputs), greedy outputs agree, and the records are those of a run one after another (latencies per
    repeat and request, the interval checks)."""
    monkeypatch.setenv("JAXSPEC_PROFILE_DIR", str(tmp_path / "profiles"))
    from jaxspec.bench import loadgen

    schedulers, turns = [], []
    real_scheduler, real_interleaved = cli._scheduler, loadgen.run_interleaved

    def scheduler(engine, policy, *args):
        sched = real_scheduler(engine, policy, *args)
        schedulers.append((engine, "none" if policy is None else policy.name, sched))
        return sched

    def interleaved(runs, slice_s):
        turns.append((len(runs), slice_s))
        return real_interleaved(runs, slice_s)

    monkeypatch.setattr(cli, "_scheduler", scheduler)
    monkeypatch.setattr(loadgen, "run_interleaved", interleaved)
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(["--model", "tiny", "--proposers", proposer, "--workloads", "code",
                              "--policies", "none,fixed:2,goodput", "--repeats", "2", "--slice", "0.05",
                              "--k-menu", "0,2", "--capacity", "2", "--requests", "3", "--max-tokens", "6",
                              "--max-prompt-tokens", "120", *load, "--no-progress", "--no-plots",
                              "--json", str(tmp_path / "r.json"), "--out", str(tmp_path / "out")])
    assert cli.run(args) == 0
    assert turns == [(3, 0.05), (3, 0.05)]  # one interleave of the three policies per repeat
    assert len(schedulers) == 6  # 2 repeats × 3 policies (--rates: no service rate measured)
    engines = {name: id(engine) for engine, name, _ in schedulers}
    assert len(set(engines.values())) == 3  # none, fixed:2 and goodput each on its own engine
    if proposer == "suffix":  # ... and each proposing from its own outputs
        indexes = [id(engine.suffix_index) for engine, name, _ in schedulers if name != "none"]
        assert len(set(indexes)) == 2
    assert all(isinstance(sched.clock, loadgen.SliceClock) for _, _, sched in schedulers)
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["meta"]["settings"]["slice_s"] == 0.05
    records = result["records"]
    assert {r["policy"] for r in records} == {"none", "fixed:2", "goodput"}
    assert len({r["output_tokens"] for r in records}) == 1  # greedy: every policy emits the same tokens
    for r in records:
        n = 4 if load[0] == "--closed-loop" else 3  # a closed loop runs at least 2 × c requests
        assert r["errors"] == 0 and len(r["latencies_s"]) == 2 and all(len(x) == n for x in r["latencies_s"])
        assert all(v > 0 for row in r["latencies_s"] for v in row)
    [check] = result["checks"]["goodput_vs_best_fixed"]
    assert check["repeats"] == 2 and check["ci95"][0] <= check["ratio"] <= check["ci95"][1]
    with pytest.raises(ValueError, match="--slice"):
        cli.settings_from_args(parser.parse_args(["--slice", "-1"]))


def test_quick_says_it_is_a_smoke_test():
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    assert "smoke test" in parser.format_help()
    assert "smoke test" in cli.QUICK_NOTE and cli.settings_from_args(parser.parse_args(["--quick"])).quick
    with pytest.raises(ValueError, match="repeats"):
        cli.settings_from_args(parser.parse_args(["--repeats", "0"]))


def test_goal_check_intervals_from_per_request_latencies():
    """A cell whose goodput is 10 % slower on every request of every repeat is a miss; a failed request drops out
    of both sides of the pair; records without latencies keep the point check only."""
    import numpy as np

    rng = np.random.default_rng(0)
    base = rng.uniform(0.5, 3.0, size=(3, 10))  # [repeats, requests]

    def rec(policy, lat):
        rows = [[None if v is None else float(v) for v in row] for row in lat]
        flat = [v for row in rows for v in row if v is not None]
        return {"workload": "code", "proposer": "ngram", "concurrency": 1, "policy": policy,
                "mean_latency_s": sum(flat) / len(flat), "latencies_s": rows}

    slow = (base * 1.10).tolist()
    slow[1][4] = None  # failed in one repeat
    records = [rec("none", base * 1.5), rec("fixed:3", base), rec("goodput", slow)]
    [check] = cli.check_goals(records)["goodput_vs_best_fixed"]
    assert check["best"] == "fixed:3" and check["verdict"] == "miss" and check["ok"] is False
    assert check["paired_requests"] == 9 and check["ci95"][0] > 1.02
    assert check["vs_none"]["verdict"] == "better"
    for r in records:
        del r["latencies_s"]
    [point] = cli.check_goals(records)["goodput_vs_best_fixed"]
    assert "ci95" not in point and point["ok"] is False and "(point)" in cli.interval_table({"goodput_vs_best_fixed":
                                                                                           [point]})


def test_goal_check_reports_machine_drift_from_the_same_prefill_work():
    """The same prefill chunks took 1.25x as long in goodput's cell as in the best fixed k's: the check carries that
    drift (the interval over requests cannot see it); different chunks (a preemption) or no accounts: none."""
    def rec(policy, latency, prefill_s, chunks=72):
        return {"workload": "agentic", "proposer": "suffix", "concurrency": 4, "policy": policy,
                "mean_latency_s": latency, "loop": {"decode_steps": 10, "decode_s": 1.0,
                                                    "prefill_chunks": chunks, "prefill_s": prefill_s}}

    [check] = cli.check_goals([rec("fixed:4", 3.0, 16.0), rec("goodput", 3.5, 20.0)])["goodput_vs_best_fixed"]
    assert abs(check["prefill_drift"] - 1.25) < 1e-12
    assert "| 1.250 |" in cli.interval_table({"goodput_vs_best_fixed": [check]})
    [check] = cli.check_goals([rec("fixed:4", 3.0, 16.0), rec("goodput", 3.5, 20.0, chunks=73)])[
        "goodput_vs_best_fixed"]
    assert "prefill_drift" not in check
