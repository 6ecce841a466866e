"""Per-depth acceptance of the feature draft vs the token draft vs prompt lookup, through the real engine.

    PYTHONPATH=. python benchmarks/feature_draft_study.py --out docs/results/feature_draft/acceptance.json

On held-out ShareGPT chat prompts (crc32(id) % 10 == 0, never trained on), every proposer runs k = --k at
B = 8, at temperature 0 and 1, on the same prompts; recorded per proposer and temperature:
  * per-depth acceptance a_j = P(proposal j accepted | proposals < j accepted), over row-steps that verified
    all k proposals (jaxspec.training.distill.EngineMeasure.depth_acceptance);
  * per-token acceptance α (the geometric-model MLE the goodput policy uses) and tokens per step;
  * greedy outputs compared with plain decoding token for token (must be equal);
and per proposer the step time at B = 1 for k = 0 and k = --k: each proposer's compiled step executable
alone (`jaxspec.bench.floor.step_call`, the menu's window 256), every proposer's two steps called in turn, --repeats
rounds, the median of each (so drift and other load hit every proposer alike; a proposer timed after another is
not compared across minutes). The draft's cost per proposed token relative to a target step is
(T(1, k) - T(1, 0)) / (k · T(1, 0)) (this includes verifying the k extra positions).
The machine load (`os.getloadavg`) is recorded before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from jaxspec.bench.common import heldout_chat_setup
from jaxspec.bench.floor import interleaved_medians, step_call
from jaxspec.engine.build import build_proposer
from jaxspec.engine.engine import Engine
from jaxspec.menu import Menu
from jaxspec.training.distill import measure_engine
from jaxspec.types import SamplingParams

PROPOSERS = {"feature": ("draft", "feature"), "token": ("draft", "default"), "ngram": ("ngram", None)}


def proposer_spec(name: str) -> tuple[str, str | None]:
    """(kind, draft spec) of a --proposers entry: a name in PROPOSERS, or feature:DIR (a saved feature draft)."""
    if name.startswith("feature:"):
        return "draft", name
    if name not in PROPOSERS:
        raise SystemExit(f"unknown proposer {name!r}: choose from {', '.join(PROPOSERS)} or feature:DIR")
    return PROPOSERS[name]


def step_seconds(engine: Engine, prompt: list[int], k: int, repeats: int) -> float:
    """Median seconds of one B = 1 step at speculation length k, host work included (fresh context each repeat;
    used by benchmarks/tree_study.py)."""
    times = []
    for _ in range(repeats):
        engine.prefill(0, prompt, SamplingParams())
        engine.step([0], k)  # the first step after prefill may catch up: not timed
        t0 = time.perf_counter()
        engine.step([0], k)
        times.append(time.perf_counter() - t0)
        engine.free(0)
    return float(np.median(times))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=24, help="held-out chat prompts")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=40, help="rounds of the interleaved step timing")
    ap.add_argument("--proposers", default="feature,token,ngram",
                    help="comma-separated: feature, token, ngram, or feature:DIR (a feature draft saved there)")
    ap.add_argument("--out", default="artifacts/feature_draft_study.json")
    args = ap.parse_args(argv)
    target, loaded, prompts, load_before = heldout_chat_setup(args.prompts)
    eos = loaded.config.eos_token_ids
    menu = Menu(num_slots=8, max_len=256, batch_buckets=(1, 8), k_menu=(0, args.k), window_buckets=(256,),
                prefill_buckets=(128,))
    plain = Engine(target, None, menu)
    plain.warmup(progress=False)
    reference = measure_engine(plain, prompts, 0, 8, 0.0, args.max_tokens, eos).outputs
    results = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "model": loaded.config.name,
               "prompts": len(prompts), "max_tokens": args.max_tokens, "k": args.k, "batch": 8,
               "command": "PYTHONPATH=. python benchmarks/feature_draft_study.py "
                          + " ".join(sys.argv[1:] if argv is None else argv),
               "proposers": {}}
    engines = {}
    for name in args.proposers.split(","):
        kind, spec = proposer_spec(name)
        engine = Engine(target, build_proposer(kind, target, spec), menu)
        engine.warmup(progress=False)
        r = {}
        for temperature in (0.0, 1.0):
            m = measure_engine(engine, prompts, args.k, 8, temperature, args.max_tokens, eos, seed=1)
            r[f"t{temperature:g}"] = {"depth_acceptance": [round(a, 4) for a in m.depth_acceptance],
                                      "alpha": round(m.alpha, 4), "tokens_per_step": round(m.tokens_per_step, 3),
                                      "full_steps": m.full_steps}
            if temperature == 0.0:
                r["greedy_equal"] = float(np.mean([a == b for a, b in zip(m.outputs, reference)]))
        results["proposers"][name] = r
        engines[name] = engine
        print(name, json.dumps(r), flush=True)
    calls, window = [], menu.window_buckets[-1]
    for engine in engines.values():
        engine.reset()
        engine.prefill(0, prompts[0], SamplingParams(temperature=0.0))
        calls += [step_call(engine, 0, window), step_call(engine, args.k, window)]
    medians = interleaved_medians(calls, args.repeats)
    for i, r in enumerate(results["proposers"].values()):
        t0, tk = medians[2 * i], medians[2 * i + 1]
        r["step_ms"] = {"k0": round(1e3 * t0, 2), f"k{args.k}": round(1e3 * tk, 2)}
        r["cost_per_proposed_token"] = round((tk - t0) / (args.k * t0), 4)
    results["load_before_after"] = [round(x, 2) for x in load_before] + [round(x, 2) for x in os.getloadavg()]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    print("\n| proposer | T | a_1 .. a_k | α | tokens/step | greedy == plain | step ms k=0 / k | cost per token |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in results["proposers"].items():
        for t in ("t0", "t1"):
            d = r[t]
            print(f"| {name} | {t[1:]} | {' '.join(f'{a:.2f}' for a in d['depth_acceptance'])} | {d['alpha']:.3f} | "
                  f"{d['tokens_per_step']:.2f} | {r['greedy_equal']:.2f} | {r['step_ms']['k0']} / "
                  f"{r['step_ms'][f'k{args.k}']} | {r['cost_per_proposed_token']:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
