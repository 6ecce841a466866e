"""Goodput's decisions replayed on recorded outputs, free of the machine's noise (issue 46).

    python -m benchmarks.goodput_replay --recordings docs/results/goodput/replay_recordings.json \
        --json docs/results/goodput/replay_c1_lag1.json

A bench cell's latency mixes the policy's choices with the machine's drift (prefill seconds of the same chunks
moved up to 10 % between cells of one run). This replays the choices alone, one request at a time (c = 1):

1. Record: the default model's greedy outputs for each workload's requests (the bench's prompts, seed and caps),
   run under fixed:K (K the menu's largest) with prompt lookup, keeping each request's (proposed, accepted) per step.
   `--recordings FILE` saves them with the step costs and the cost profile (below), or replays from the file if it
   exists (no engine is built then).
2. Replay: prompt lookup's proposals are recomputed on the host (`lookup_chain`: longest n of max_ngram..min_ngram,
   latest earlier occurrence, as `PromptLookupProposer.propose` does on the device; checked by replaying fixed:K
   against the recorded steps). A step at k verifies the first min(k, cap) tokens of the chain; the accepted ones
   are those equal to the recorded output. Each step costs its k's measured time (`step_costs`: the B = 1 step
   executables at every k timed alternately, `--cost-repeats` times, medians), the same for every policy, so two
   policies differ only by their choices; `--pricing profile` prices by the cost profile instead. Goodput starts
   from the profile the bench's goodput uses and corrects it online from the times it observes, as it does live.
   Goodput is the shipped policy object (`make_policy`), fresh for every cell of `--cell` requests (the bench's
   cold start), observing each replayed step after it chose the next (`--lag 1`, the overlapped loop; `--lag 0`,
   the synchronous loop); `--variant NAME:section.key=value,...` replays it with other settings of
   jaxspec/configs/policy.yaml.

Reported per workload and policy: tokens, seconds and tokens/s over all steps, the policy's own host time per
step (choose + observe, on this machine's clock), goodput's ratio to the best fixed k, `none` included (tokens/s),
and per k its speculative tokens realised over predicted (`prediction_ratios`). Per workload: the host matcher's
agreement with the device's steps (`lookup_check`) and how the first proposal's acceptance depends on the step
before (`outcome_before`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np

from jaxspec.bench.common import machine
from jaxspec.menu import Menu, step_shape
from jaxspec.policy.base import BatchView, Decision, Policy, menu_at_most, row_caps
from jaxspec.policy.fixed import FixedPolicy
from jaxspec.types import StepResult

K_MENU = (0, 1, 2, 3, 5)


def lookup_chain(context: list[int], k: int, min_ngram: int = 1, max_ngram: int = 3) -> list[int]:
    """Prompt lookup's proposal for `context` (host twin of `PromptLookupProposer.propose`): the tokens after the
    latest earlier occurrence of its last n tokens, n = max_ngram first; at most k, never past the context."""
    cur = len(context)
    for n in range(max_ngram, min_ngram - 1, -1):
        if cur < n + 1:
            continue
        suffix = context[cur - n:]
        for j in range(cur - n - 1, -1, -1):  # latest start with j + n < cur
            if context[j:j + n] == suffix:
                start = j + n
                return context[start:min(start + k, cur)]
    return []


@dataclasses.dataclass(frozen=True)
class Recorded:
    """One request: its prompt, greedy output, output cap, and the device's (proposed, accepted) per step."""

    prompt: tuple[int, ...]
    output: tuple[int, ...]
    max_tokens: int
    steps: tuple[tuple[int, int], ...]


def step_cap(req: Recorded, t: int) -> int:
    """The most proposals a step may verify with t output tokens committed: the menu's largest k, no more than the
    tokens still wanted after the bonus one."""
    return max(0, min(max(K_MENU), req.max_tokens - t - 1))


def accepted_prefix(chain: list[int], out: tuple[int, ...], t: int) -> int:
    """How many of `chain`'s tokens greedy verification accepts at output position t: its prefix equal to the
    recorded output from t on."""
    accepted = 0
    while accepted < len(chain) and t + accepted < len(out) and chain[accepted] == out[t + accepted]:
        accepted += 1
    return accepted


def replay_request(req: Recorded, choose, rid):
    """Yields each step of one request under `choose(view) -> Decision`: (view, decision, proposed, accepted)."""
    out, t = req.output, 1  # the first token comes from the prefill
    while t < len(out):
        context = list(req.prompt) + list(out[:t])
        cap = step_cap(req, t)
        view = BatchView(request_ids=(rid,), context_lens=(len(context),), row_max_k=(cap,), k_menu=K_MENU,
                         batch_bucket=1)
        decision = choose(view)
        k = min(decision.k, cap)
        chain = lookup_chain(context, k)
        accepted = accepted_prefix(chain, out, t)
        yield view, decision, len(chain), accepted
        t += accepted + 1


class RunStatePolicy(Policy):
    """A reference, not a policy to ship: k_full after a row's last observed step accepted every proposal (a copied
    run), k_rejected otherwise (and before any step is observed). The best pair over the menu, chosen in hindsight
    per workload, bounds what pricing runs alone can win over the best fixed k."""

    def __init__(self, k_full: int, k_rejected: int):
        self.k_full, self.k_rejected = k_full, k_rejected
        self.name = f"runs:{k_full}/{k_rejected}"
        self._full: dict = {}  # request id -> whether its last observed step accepted all it proposed

    def choose(self, view: BatchView) -> Decision:
        rid = view.request_ids[0]
        k = menu_at_most(self.k_full if self._full.get(rid, False) else self.k_rejected, view.k_menu)
        return Decision(k=k, row_k=row_caps(k, view))

    def observe(self, view, decision, result, elapsed_s) -> None:
        proposed = int(result.proposed[0])
        if proposed:
            self._full[view.request_ids[0]] = int(result.counts[0]) - 1 == proposed

    def forget(self, request_id) -> None:
        self._full.pop(request_id, None)


def clairvoyant(requests: list[Recorded], price, windows) -> dict:
    """A bound no policy reaches: every step takes the k whose own tokens/s is the highest, knowing what each k
    would accept (greedy per step, so not the exact optimum over a request, but no causal policy sees this much)."""
    tokens = seconds = steps = 0
    k_hist: dict[int, int] = {}
    for req in requests:
        out, t = req.output, 1
        while t < len(out):
            context = list(req.prompt) + list(out[:t])
            cap = step_cap(req, t)
            best = None
            for k in K_MENU:
                if k > cap:
                    break
                chain = lookup_chain(context, k)
                accepted = accepted_prefix(chain, out, t)
                shape = step_shape((len(context),), (cap,), k, K_MENU, windows)
                took = price(shape.k, shape.window)
                if best is None or (accepted + 1) / took > best[0]:
                    best = ((accepted + 1) / took, k, accepted, took)
            _, k, accepted, took = best
            tokens, seconds, steps, t = tokens + accepted + 1, seconds + took, steps + 1, t + accepted + 1
            k_hist[k] = k_hist.get(k, 0) + 1
    return {"tokens": tokens, "seconds": seconds, "steps": steps, "tokens_per_s": tokens / seconds,
            "k_hist": {str(k): n for k, n in sorted(k_hist.items())}}


def step_costs(engine, repeats: int, context: int = 180) -> dict[int, float]:
    """Seconds of the (B = 1, k, W) step executable per k of the menu at the window a context of `context` runs
    in: medians of `repeats` runs, the ks alternated (drift hits them alike)."""
    from jaxspec.bench.floor import hold_context, interleaved_medians, step_call
    from jaxspec.types import SamplingParams

    engine.reset()
    engine.prefill(0, [2 + i % 7 for i in range(8)], SamplingParams(temperature=0.0))
    window = engine.menu.step_shape([context], None, max(K_MENU)).window
    times = interleaved_medians([step_call(engine, k, window) for k in K_MENU], repeats,
                                prepares=[hold_context(engine, context)] * len(K_MENU))
    engine.reset()
    return dict(zip(K_MENU, times, strict=True))


def prediction_ratios(records) -> dict[str, dict]:
    """Per padded k, from decision-log records: speculative tokens realised over predicted (bonus tokens left out)
    and step seconds observed over priced, cold-start steps (predicted k + 1 tokens a row) apart:
    {k: {"steps", "ratio", "seconds_ratio", "cold_steps", "cold_ratio"}} (k = 0 has no speculative tokens)."""
    sums: dict[int, dict[str, float]] = {}
    for r in records:
        if r.predicted_tokens is None:
            continue
        cold = r.k > 0 and abs(r.predicted_tokens - (r.k + 1) * r.batch) < 1e-9
        s = sums.setdefault(r.k, dict.fromkeys(("steps", "pred", "real", "cold_steps", "cold_pred", "cold_real",
                                                "seconds_ratio"), 0.0))
        prefix = "cold_" if cold else ""
        s[prefix + "steps"] += 1
        s[prefix + "pred"] += r.predicted_tokens - r.batch
        s[prefix + "real"] += r.tokens - r.batch
        if r.predicted_seconds:
            s["seconds_ratio"] += r.seconds / r.predicted_seconds
    out = {}
    for k, s in sorted(sums.items()):
        every = s["steps"] + s["cold_steps"]
        out[str(k)] = {"steps": int(s["steps"]), "ratio": s["real"] / s["pred"] if s["pred"] else None,
                       "seconds_ratio": s["seconds_ratio"] / every if every else None,
                       "cold_steps": int(s["cold_steps"]),
                       "cold_ratio": s["cold_real"] / s["cold_pred"] if s["cold_pred"] else None}
    return out


def run_policy(requests: list[Recorded], make, price, cell: int, windows, lag: int = 0) -> dict:
    """Replay every request in order; a fresh policy (`make()`) per cell of `cell` requests. `price(k, window)`:
    the seconds of a B = 1 step of that shape. lag = 1 observes each step only after the next one was chosen, as
    the overlapped loop does (lag = 0: before)."""
    if lag not in (0, 1):
        raise ValueError(f"lag must be 0 or 1, got {lag}")
    tokens = seconds = steps = 0
    host_s = 0.0  # in the policy's choose and observe
    k_hist: dict[int, int] = {}
    policy = None
    records = []  # the decision logs of every cell (goodput's; fixed policies keep none)

    def observe(held):
        nonlocal host_s
        began = time.perf_counter()
        policy.observe(*held)
        host_s += time.perf_counter() - began

    def choose(view):
        nonlocal host_s
        began = time.perf_counter()
        decision = policy.choose(view)
        host_s += time.perf_counter() - began
        return decision

    for i, req in enumerate(requests):
        if i % cell == 0:
            records.extend(getattr(policy, "log", ()))
            policy = make()
        held = None  # a step chosen and run, not yet observed
        for view, decision, proposed, accepted in replay_request(req, choose, f"r{i}"):
            if held is not None:  # the next step is chosen: the one before it is observed now
                observe(held)
                held = None
            shape = step_shape(view.context_lens, view.row_max_k, decision.k, K_MENU, windows)
            took = price(shape.k, shape.window)
            result = StepResult(tokens=np.zeros((1, shape.k + 1), np.int32), counts=np.array([accepted + 1]),
                                proposed=np.array([proposed]))
            held = (view, decision, result, took)
            if not lag:
                observe(held)
                held = None
            tokens, seconds, steps = tokens + accepted + 1, seconds + took, steps + 1
            k_hist[shape.k] = k_hist.get(shape.k, 0) + 1
        if held is not None:
            observe(held)
        policy.forget(f"r{i}")
    records.extend(getattr(policy, "log", ()))
    out = {"tokens": tokens, "seconds": seconds, "steps": steps, "tokens_per_s": tokens / seconds,
           "policy_host_ms_per_step": 1e3 * host_s / steps,
           "k_hist": {str(k): n for k, n in sorted(k_hist.items())}}
    if records:
        out["speculative_tokens_realised_over_predicted"] = prediction_ratios(records)
    return out


def record(workloads, n: int, seed: int, max_tokens: int, max_prompt_tokens: int):
    """(engine, {workload: [Recorded]}): greedy outputs under fixed:K with prompt lookup, 8 in flight."""
    from jaxspec.bench.workloads import load_workload
    from jaxspec.engine.build import build_model, build_proposer
    from jaxspec.engine.engine import Engine
    from jaxspec.models.loading.registry import DEFAULT_MODEL
    from jaxspec.scheduling.requests import Request
    from jaxspec.scheduling.scheduler import Scheduler, SchedulerConfig
    from jaxspec.types import SamplingParams

    built = build_model(DEFAULT_MODEL)
    menu = Menu(num_slots=8, max_len=256, batch_buckets=(1, 4, 8), k_menu=K_MENU, window_buckets=(256,),
                prefill_buckets=(64, 256))  # the bench's menu (`bench_menu`): its cost profile is reused
    engine = Engine(built.model, build_proposer("ngram", built.model), menu)
    engine.warmup(progress=False)
    recorded = {}
    for name in workloads:
        wl = load_workload(name, built.tokenizer, n, seed=seed, max_prompt_tokens=max_prompt_tokens,
                           max_tokens=max_tokens)
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        reqs = [Request(f"{name}-{i}", p, params) for i, p in enumerate(wl.prompts)]
        results = Scheduler(engine, FixedPolicy(max(K_MENU)), config=SchedulerConfig(max_running=8)).generate_all(reqs)
        recorded[name] = [Recorded(tuple(r.prompt_token_ids), tuple(res.token_ids), max_tokens,
                                   tuple((s.proposed, s.accepted) for s in res.steps))
                          for r, res in zip(reqs, results, strict=True)]
        print(f"recorded {name}: {len(reqs)} requests", file=sys.stderr)
    return engine, recorded


def lookup_check(requests: list[Recorded]) -> dict:
    """fixed:K replayed on the host against the device's recorded steps: the share of steps that agree."""
    same = total = 0
    for i, req in enumerate(requests):
        replayed = [(p, a) for _, _, p, a in replay_request(req, FixedPolicy(max(K_MENU)).choose, i)]
        total += max(len(replayed), len(req.steps))
        same += sum(x == y for x, y in zip(replayed, req.steps))
    return {"steps": total, "agreeing": same, "share": same / max(total, 1)}


def save_recordings(path: Path, recorded: dict[str, list[Recorded]], measured: dict[int, float], profile,
                    windows, meta: dict | None = None) -> None:
    """Write what a replay needs of the engine (outputs, B = 1 step costs, the cost profile) to `path`, with `meta`
    (when and how they were measured)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"meta": meta or {},
                                "recorded": {w: [dataclasses.asdict(r) for r in reqs] for w, reqs in recorded.items()},
                                "step_s": {str(k): v for k, v in measured.items()}, "profile": profile.to_json(),
                                "windows": list(windows)}))


def load_recordings(path: Path, workloads: list[str]):
    """(recorded, step costs, profile, windows, meta) saved by `save_recordings`, for `workloads`."""
    from jaxspec.policy.cost_model import CostProfile

    data = json.loads(path.read_text())
    missing = [w for w in workloads if w not in data["recorded"]]
    if missing:
        raise SystemExit(f"{path} holds no recording of {missing} (it has {sorted(data['recorded'])})")
    recorded = {w: [Recorded(tuple(r["prompt"]), tuple(r["output"]), r["max_tokens"],
                             tuple(tuple(s) for s in r["steps"])) for r in data["recorded"][w]] for w in workloads}
    return (recorded, {int(k): v for k, v in data["step_s"].items()}, CostProfile.from_json(data["profile"]),
            tuple(data["windows"]), data.get("meta", {}))


def outcome_before(requests: list[Recorded]) -> dict:
    """Under fixed:K, the chance the first proposal is accepted after a step that accepted all K (a run copied) and
    after one that ended in a rejection, with the step before known (lag 1) and with one step unknown between
    (lag 2, what the overlapped loop knows): {"lag1": {"after_full": [accepted, steps], "after_rejection": ...}}."""
    k_max = max(K_MENU)
    counts = {lag: {"after_full": [0, 0], "after_rejection": [0, 0]} for lag in (1, 2)}
    for i, req in enumerate(requests):
        ended_full: list[bool] = []
        for view, _, _, accepted in replay_request(req, FixedPolicy(k_max).choose, i):
            k = min(k_max, view.row_max_k[0])
            if k == 0:
                continue
            for lag in (1, 2):
                if len(ended_full) >= lag:
                    c = counts[lag]["after_full" if ended_full[-lag] else "after_rejection"]
                    c[0] += accepted >= 1
                    c[1] += 1
            ended_full.append(accepted == k)
    return {f"lag{lag}": {state: {"accepted": a, "steps": n, "rate": a / n if n else None}
                          for state, (a, n) in c.items()} for lag, c in counts.items()}


def parse_variant(text: str):
    """'NAME:section.key=value,...' -> (NAME, {section: {key: value}}) over jaxspec/configs/policy.yaml."""
    name, _, body = text.partition(":")
    changes: dict[str, dict] = {}
    for item in filter(None, body.split(",")):
        path, _, value = item.partition("=")
        section, _, key = path.partition(".")
        changes.setdefault(section, {})[key] = json.loads(value)
    return name, changes


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default="chat,summarization,qa,sql,code,edit")
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--cell", type=int, default=8, help="requests per fresh policy (the bench's cell)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-prompt-tokens", type=int, default=192)
    ap.add_argument("--pricing", choices=("measured", "profile"), default="measured")
    ap.add_argument("--cost-repeats", type=int, default=40, help="alternated runs per k of `step_costs`")
    ap.add_argument("--variant", action="append", default=[], help="NAME:section.key=value,... (policy.yaml)")
    ap.add_argument("--lag", type=int, choices=(0, 1), default=1,
                    help="1: observe each step after choosing the next (the overlapped loop); 0: before")
    ap.add_argument("--recordings", type=Path, help="reuse the outputs, step costs and profile saved here by an "
                    "earlier run, with its --requests, --seed, --max-tokens, --max-prompt-tokens and --cost-repeats "
                    "(written here if the file does not exist)")
    ap.add_argument("--json", type=Path, required=True)
    args = ap.parse_args(argv)

    from jaxspec.bench.floor import load
    from jaxspec.engine.profiler import profile_key
    from jaxspec.policy.cost_model import CostModel, load_matching_profile
    from jaxspec.policy.registry import load_defaults, make_policy
    from jaxspec.serving.runtime import build_policy

    load_before, started = load(), time.time()
    run = {"command": " ".join(["python -m benchmarks.goodput_replay"] + (argv or sys.argv[1:])),
           "machine": machine(), "date": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
           "load_before": load_before}
    if args.recordings is not None and args.recordings.exists():
        recorded, measured, profile, windows, measured_meta = load_recordings(args.recordings,
                                                                              args.workloads.split(","))
    else:
        engine, recorded = record(args.workloads.split(","), args.requests, args.seed, args.max_tokens,
                                  args.max_prompt_tokens)
        build_policy("goodput", engine=engine, progress=False)  # profiles the engine once if no profile is saved
        profile = load_matching_profile(profile_key(engine))
        windows = engine.menu.window_buckets
        measured = step_costs(engine, args.cost_repeats)
        measured_meta = {**run, "load_after": load(), "requests": args.requests, "seed": args.seed,
                         "max_tokens": args.max_tokens, "cost_repeats": args.cost_repeats}
        if args.recordings is not None:
            save_recordings(args.recordings, recorded, measured, profile, windows, measured_meta)
    cost = CostModel.from_profile(profile)
    profiled = {k: cost.base_time(1, k, windows[0]) for k in K_MENU}
    if args.pricing == "measured":
        def price(k, window):
            if window != windows[0]:
                raise ValueError(f"a step at window {window}: step_costs measured {windows[0]} only")
            return measured[k]
    else:
        def price(k, window):
            return cost.base_time(1, k, window)
    print("B = 1 step ms, measured / profiled: " + ", ".join(
        f"k={k} {1e3 * measured[k]:.2f} / {1e3 * profiled[k]:.2f}" for k in K_MENU), file=sys.stderr)
    defaults = load_defaults()
    variants = {"goodput": defaults}
    for text in args.variant:
        name, changes = parse_variant(text)
        variants[name] = dataclasses.replace(defaults, **{
            section: dataclasses.replace(getattr(defaults, section), **kv) for section, kv in changes.items()})

    results = {}
    for name, requests in recorded.items():
        row = {"lookup_check": lookup_check(requests), "outcome_before": outcome_before(requests)}
        for k in K_MENU:
            row["none" if k == 0 else f"fixed:{k}"] = run_policy(requests, lambda k=k: FixedPolicy(k), price,
                                                                   args.cell, windows, args.lag)
        best = max(("none", *(f"fixed:{k}" for k in K_MENU if k)), key=lambda p: row[p]["tokens_per_s"])
        run_states = {(kf, kr): run_policy(requests, lambda kf=kf, kr=kr: RunStatePolicy(kf, kr), price, args.cell,
                                           windows, args.lag) for kf in K_MENU for kr in K_MENU}
        kf, kr = max(run_states, key=lambda pair: run_states[pair]["tokens_per_s"])
        row["runs_best_pair"] = {**run_states[(kf, kr)], "k_full": kf, "k_rejected": kr,
                                 "faster_than_best_fixed": run_states[(kf, kr)]["tokens_per_s"]
                                 / row[best]["tokens_per_s"]}
        row["clairvoyant"] = clairvoyant(requests, price, windows)
        row["clairvoyant"]["faster_than_best_fixed"] = row["clairvoyant"]["tokens_per_s"] / row[best]["tokens_per_s"]
        for vname, vdefaults in variants.items():
            def make(vdefaults=vdefaults):
                return make_policy("goodput", cost_model=CostModel.from_profile(profile, vdefaults.cost_online),
                                   defaults=vdefaults)
            row[vname] = run_policy(requests, make, price, args.cell, windows, args.lag)
            row[vname]["best_fixed"] = best
            row[vname]["slower_than_best_fixed"] = row[best]["tokens_per_s"] / row[vname]["tokens_per_s"]
        results[name] = row
        print(f"{name}: lookup agreement {row['lookup_check']['share']:.3f}; best {best} "
              f"{row[best]['tokens_per_s']:.1f} tok/s; runs {kf}/{kr} "
              f"{row['runs_best_pair']['faster_than_best_fixed']:.3f}x faster; clairvoyant "
              f"{row['clairvoyant']['faster_than_best_fixed']:.3f}x faster; " + "; ".join(
                  f"{v} {row[v]['tokens_per_s']:.1f} ({row[v]['slower_than_best_fixed']:.3f}x slower)"
                  for v in variants), file=sys.stderr)
    meta = {**run, "load_after": load(), "k_menu": K_MENU, "pricing": args.pricing,
            "lag": args.lag,
            "recordings": str(args.recordings) if args.recordings else None,
            "recorded_and_step_costs_measured": measured_meta,
            "step_ms_measured": {k: 1e3 * v for k, v in measured.items()},
            "step_ms_profiled": {k: 1e3 * v for k, v in profiled.items()},
            "variants": {v: [text for text in args.variant if text.startswith(v + ":")] for v in variants}}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    print(f"wrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
