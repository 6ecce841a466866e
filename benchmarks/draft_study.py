"""Draft study: acceptance, draft latency and end-to-end tokens/s through the real engine.

    PYTHONPATH=. python benchmarks/draft_study.py --drafts jaxspec/drafts/smollm2-135m artifacts/drafts/deep4 \
        --out artifacts/study.json

For every draft (a directory written by `jaxspec distill`) on held-out ShareGPT chat prompts
(crc32(id) % 10 == 0, never trained on):
  * per-token acceptance = Σ accepted / Σ proposed (StepResult), greedy and at temperature 1,
    with k = --accept-k at B = 8;
  * draft step latency: one cached single-token draft forward, B = 1 and B = 8;
  * end-to-end decode tokens/s (prefill excluded) at B = 1 for each k in --ks and at B = 8 for
    --ks-b8, against plain decoding (an engine without a proposer) on the same prompts, the two
    interleaved prompt group by prompt group (the machine is shared: load from other jobs then
    hits both alike); wall-clock and process-CPU-time throughput are both recorded;
  * greedy outputs are compared with plain decoding token for token (must be equal).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from jaxspec.engine.draft_artifacts import load_draft
from jaxspec.engine.engine import Engine, enable_compilation_cache
from jaxspec.menu import Menu, PrefillKey, StepKey
from jaxspec.speculation.proposers.draft_model import DraftModelProposer
from jaxspec.training import distill_data as dd
from jaxspec.training.distill import draft_step_latency, measure_engine
from jaxspec.training.trainer import load_target


def engine_config(ks, ks_b8) -> Menu:
    k_menu = tuple(sorted({0, *ks, *ks_b8}))
    return Menu(num_slots=8, max_len=256, batch_buckets=(1, 8), k_menu=k_menu, window_buckets=(256,),
                        prefill_buckets=(128,))


def warm(engine: Engine, ks, ks_b8) -> float:
    t0 = time.time()
    keys = [StepKey(1, k, 256) for k in ks] + [StepKey(8, k, 256) for k in ks_b8] + [PrefillKey(128, 256)]
    engine.warmup(keys, progress=False)
    return time.time() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--drafts", nargs="+", required=True)
    ap.add_argument("--prompts", type=int, default=16, help="held-out prompts for acceptance (B = 8)")
    ap.add_argument("--speed-prompts", type=int, default=4, help="prompts for the B = 1 speed sweep")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--accept-k", type=int, default=4)
    ap.add_argument("--ks", default="1,2,3,4,5,6,7,8", help="k values for the B = 1 sweep")
    ap.add_argument("--ks-b8", default="2,4", help="k values at B = 8")
    ap.add_argument("--skip-temp1", action="store_true")
    ap.add_argument("--out", default="artifacts/study.json")
    args = ap.parse_args(argv)
    enable_compilation_cache()
    ks = [int(k) for k in args.ks.split(",") if k]
    ks_b8 = [int(k) for k in args.ks_b8.split(",") if k]
    ks_all = sorted({args.accept_k, *ks_b8})

    target, loaded = load_target(args.model)
    tok, eos = loaded.tokenizer, loaded.config.eos_token_ids
    prompts = dd.chat_prompts(tok, "heldout", args.prompts, 112)
    speed_prompts = prompts[: args.speed_prompts]
    results = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "model": loaded.config.name,
               "prompts": len(prompts), "max_tokens": args.max_tokens, "drafts": {}}

    base = Engine(target, None, Menu(num_slots=8, max_len=256, batch_buckets=(1, 8), k_menu=(0,),
                                             window_buckets=(256,), prefill_buckets=(128,)))
    base.warmup([StepKey(1, 0, 256), StepKey(8, 0, 256), PrefillKey(128, 256)], progress=False)
    reference = measure_engine(base, prompts, 0, 8, 0.0, args.max_tokens, eos).outputs
    results["plain"] = {}

    def paired(engine, group_prompts, k, batch, temperature=0.0, seed=0):
        """Plain and speculative runs interleaved group by group (same prompts), so load from
        other jobs on the shared machine hits both alike."""
        plain = spec = None
        for g in range(0, len(group_prompts), batch):
            grp = group_prompts[g:g + batch]
            mp = measure_engine(base, grp, 0, batch, temperature, args.max_tokens, eos, seed=seed + g)
            ms = measure_engine(engine, grp, k, batch, temperature, args.max_tokens, eos, seed=seed + g)
            plain = mp if plain is None else plain.merge(mp)
            spec = ms if spec is None else spec.merge(ms)
        return plain, spec

    def speed(plain, spec):
        return {"tok_s": spec.tok_s, "plain_tok_s": plain.tok_s, "speedup": spec.tok_s / plain.tok_s,
                "cpu_tok_s": spec.cpu_tok_s, "plain_cpu_tok_s": plain.cpu_tok_s,
                "cpu_speedup": spec.cpu_tok_s / plain.cpu_tok_s, "alpha": spec.alpha, "accept": spec.accept_rate,
                "tokens_per_step": spec.tokens_per_step}

    for path in args.drafts:
        draft = load_draft(path, target)
        info = json.loads((Path(path) / "draft.json").read_text())
        name = info["arch"]["name"] if info["arch"]["name"] not in results["drafts"] else Path(path).name
        engine = Engine(target, DraftModelProposer(draft), engine_config(ks, ks_all))
        compile_s = warm(engine, ks, ks_all)
        r = {"path": str(path), "arch": info["arch"], "own_params": info.get("own_params"),
             "num_kept": info.get("num_kept"), "compile_s": compile_s,
             "latency_ms": {f"b{b}": 1e3 * draft_step_latency(draft, b) for b in (1, 8)}}
        plain8, g = paired(engine, prompts, args.accept_k, 8)
        r["alpha_t0"] = g.alpha
        r["accept_t0"] = g.accept_rate
        r["tokens_per_step_t0"] = g.tokens_per_step
        r["greedy_equal"] = float(np.mean([a == b for a, b in zip(g.outputs, reference)]))
        r["b8"] = {args.accept_k: speed(plain8, g)}
        if not args.skip_temp1:
            s = measure_engine(engine, prompts, args.accept_k, 8, 1.0, args.max_tokens, eos, seed=1)
            r["alpha_t1"] = s.alpha
            r["accept_t1"] = s.accept_rate
        for k in ks_b8:
            if k != args.accept_k:
                r["b8"][k] = speed(*paired(engine, prompts, k, 8))
        r["b1"] = {}
        for k in ks:
            r["b1"][k] = v = speed(*paired(engine, speed_prompts, k, 1))
            print(f"{name} B=1 k={k}: {v['tok_s']:.1f} vs plain {v['plain_tok_s']:.1f} tok/s "
                  f"({v['speedup']:.2f}x wall, {v['cpu_speedup']:.2f}x cpu), alpha {v['alpha']:.3f}, "
                  f"accepted/proposed {v['accept']:.3f}", flush=True)
        best_b1 = max(r["b1"].items(), key=lambda kv: kv[1]["speedup"]) if r["b1"] else None
        best_b8 = max(r["b8"].items(), key=lambda kv: kv[1]["speedup"])
        r["best_b1"] = best_b1 and {"k": best_b1[0], **best_b1[1]}
        r["best_b8"] = {"k": best_b8[0], **best_b8[1]}
        results["drafts"][name] = r
        print(json.dumps({name: r}, indent=1, default=float), flush=True)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=1, default=float))
        del engine

    print("\n| draft | own params | α T=0 (acc/prop) | α T=1 | draft ms B=1 / B=8 | best B=1 speedup wall / cpu (k) "
          "| best B=8 speedup wall / cpu (k) | greedy == plain |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in results["drafts"].items():
        b1r, b8r = r["best_b1"], r["best_b8"]
        print(f"| {name} | {r['own_params'] / 1e6:.2f}M | {r['alpha_t0']:.3f} ({r['accept_t0']:.3f}) | "
              f"{r.get('alpha_t1', float('nan')):.3f} | {r['latency_ms']['b1']:.2f} / {r['latency_ms']['b8']:.2f} | "
              + (f"{b1r['speedup']:.2f}x / {b1r['cpu_speedup']:.2f}x ({b1r['k']}) | " if b1r else "- | ")
              + f"{b8r['speedup']:.2f}x / {b8r['cpu_speedup']:.2f}x ({b8r['k']}) | {r['greedy_equal']:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
