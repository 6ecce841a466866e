"""Tokens per verified step of draft-model token trees vs chains at the same verify width, through the engine.

    PYTHONPATH=. python benchmarks/tree_study.py --out docs/results/tree/draft_tree_study.json

On held-out ShareGPT chat prompts (crc32(id) % 10 == 0, never trained on), with the shipped token draft
(`--draft`), every configuration runs at a fixed k at B = 8, at each of `--temperatures` (default 0 and 1), on
the same prompts: the chains of `--chains` and the tree envelopes of `--trees` (each at k = its node count, so
a tree of N nodes verifies N + 1 tokens per row like the chain of N). Recorded per configuration and temperature: tokens
per row-step (accepted + the bonus token), greedy outputs compared with plain decoding (must be equal), and
the B = 1 step time at one context (median of `--repeats`). The machine load is recorded before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.feature_draft_study import step_seconds
from jaxspec.bench.cli import _floats, _ints
from jaxspec.bench.common import heldout_chat_setup
from jaxspec.engine.build import build_proposer
from jaxspec.engine.engine import Engine
from jaxspec.menu import Menu, TreeEnvelope
from jaxspec.training.distill import measure_engine


def _engine_groups(trees: list[TreeEnvelope]) -> list[tuple[TreeEnvelope, ...]]:
    """Tree envelopes grouped so that no two in a group share a k (one menu holds one envelope per k)."""
    groups: list[list[TreeEnvelope]] = []
    for t in trees:
        group = next((g for g in groups if all(o.nodes != t.nodes for o in g)), None)
        if group is None:
            groups.append([t])
        else:
            group.append(t)
    return [tuple(sorted(g, key=lambda t: t.nodes)) for g in groups]  # a menu's k must increase


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=16, help="held-out chat prompts")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--trees", default="4:2,6:3,8:4,6:2,8:3", help="comma-separated envelopes N:D")
    ap.add_argument("--chains", type=_ints, default=(1, 2, 3, 4, 6, 8), help="comma-separated chain lengths k")
    ap.add_argument("--temperatures", type=_floats, default=(0.0, 1.0), help="comma-separated sampling temperatures")
    ap.add_argument("--draft", default="default", help="--draft spec of the token draft")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--out", default="artifacts/draft_tree_study.json")
    args = ap.parse_args(argv)
    target, loaded, prompts, load_before = heldout_chat_setup(args.prompts)
    eos = loaded.config.eos_token_ids
    trees = [TreeEnvelope.parse(t) for t in args.trees.split(",")]
    chains, temperatures = args.chains, args.temperatures
    ks = sorted(set(chains) | {t.nodes for t in trees})
    max_len = -(-max(256, 112 + args.max_tokens + max(ks) + 16) // 16) * 16  # prompt + output + widest step, in pages
    menu = Menu(num_slots=8, max_len=max_len, batch_buckets=(1, 8), k_menu=(0, *ks), window_buckets=(max_len,),
                prefill_buckets=(128,))
    plain = Engine(target, None, menu)
    plain.warmup(progress=False)
    reference = measure_engine(plain, prompts, 0, 8, 0.0, args.max_tokens, eos).outputs
    del plain
    command = " ".join(sys.argv[1:] if argv is None else argv)
    results = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "model": loaded.config.name,
               "draft": args.draft, "prompts": len(prompts), "max_tokens": args.max_tokens, "batch": 8,
               "command": "PYTHONPATH=. python benchmarks/tree_study.py " + command, "configs": {}}
    runs = [("chain", menu.with_k_menu((0, *chains)), [(str(k), k) for k in chains])]
    for group in _engine_groups(trees):
        tree_menu = menu.with_k_menu((0, *(t.nodes for t in group)))
        for t in group:
            tree_menu = tree_menu.with_tree(t)
        runs.append(("tree", tree_menu, [(f"tree {t}", t.nodes) for t in group]))
    for _, run_menu, configs in runs:
        engine = Engine(target, build_proposer("draft", target, args.draft), run_menu)
        engine.warmup(progress=False)
        for name, k in configs:
            r = {"k": k}
            for temperature in temperatures:
                m = measure_engine(engine, prompts, k, 8, temperature, args.max_tokens, eos, seed=1)
                r[f"t{temperature:g}"] = {"tokens_per_step": round(m.tokens_per_step, 3), "row_steps": m.row_steps}
                if temperature == 0.0:
                    r["greedy_equal"] = float(np.mean([a == b for a, b in zip(m.outputs, reference)]))
            r["step_ms_b1"] = round(1e3 * step_seconds(engine, prompts[0], k, args.repeats), 2)
            results["configs"][name] = r
            print(name, json.dumps(r), flush=True)
        del engine
    results["load_before_after"] = [round(x, 2) for x in load_before] + [round(x, 2) for x in os.getloadavg()]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    columns = "".join(f" tokens/step T={t:g} |" for t in temperatures)
    print(f"\n| config | verify width |{columns} greedy == plain | step ms (B=1) |")
    print("|---|---:|" + "---:|" * len(temperatures) + "---:|---:|")
    for name, r in results["configs"].items():
        cells = "".join(f" {r[f't{t:g}']['tokens_per_step']:.2f} |" for t in temperatures)
        print(f"| {name} | {r['k'] + 1} |{cells} {r.get('greedy_equal', float('nan')):.2f} | {r['step_ms_b1']} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
