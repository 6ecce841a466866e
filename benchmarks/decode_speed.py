"""Plain greedy decode speed at batch 1: jaxspec vs HF transformers on the same GGUF, and the floor.

    python -m benchmarks.decode_speed --tokens 64 --out docs/results/decode_speed.json

The floor is the bare matmul chain of the model's own serving weights (`jaxspec.floor`): the
same matmuls at the same shapes over the same placed arrays, nothing else, jitted, at T = k + 1.
The engine's compiled step executable is timed alone at every (k, W) of the menu at B = 1 next to
it, in the same process, and the table reports engine / bare (with the machine load before and
after each row: numbers taken above a load of about 1 on a 2-core machine are distorted).
Both engines decode the same prompt greedily in the same process, alternating, `--repeats` times
(medians reported, every repeat kept); prefill is excluded on both sides; the outputs are compared
token for token (--skip-hf leaves transformers out).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np

from benchmarks.common import decode_tokens, machine
from jaxspec.build import build_model, build_proposer
from jaxspec.engine import Engine, enable_compilation_cache
from jaxspec.floor import format_growth, format_rows, load, step_vs_bare, weight_mb, window_growth
from jaxspec.menu import Menu
from models.loading import resolve_model

PROMPT = ("Write a short story about a lighthouse keeper who finds a message in a bottle. "
          "Describe the sea, the weather and the keeper's thoughts in detail.")


class HFDecoder:
    """Greedy generation with transformers on the same GGUF (torch CPU, fp32)."""

    def __init__(self):
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(os.cpu_count() or 1)
        path = resolve_model(None).path
        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                          dtype=torch.float32).eval()

    def generate(self, prompt_ids: list[int], n_tokens: int) -> tuple[list[int], float]:
        """(the n new tokens, wall seconds of the whole generate call, prefill included)."""
        ids = self.torch.tensor([prompt_ids])
        with self.torch.no_grad():
            t = time.perf_counter()
            out = self.model.generate(ids, max_new_tokens=n_tokens, min_new_tokens=n_tokens, do_sample=False)
            return out[0, len(prompt_ids):].tolist(), time.perf_counter() - t


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--k-menu", type=lambda v: tuple(int(x) for x in v.split(",")), default=(0, 4),
                        help="k values of the engine-vs-bare table (k > 0 uses prompt lookup)")
    parser.add_argument("--windows", type=lambda v: tuple(int(x) for x in v.split(",")), default=(128, 512))
    parser.add_argument("--step-repeats", type=int, default=20, help="timed calls per row of the table")
    parser.add_argument("--skip-hf", action="store_true", help="leave out the transformers comparison")
    parser.add_argument("--out", type=Path, default=Path("docs/results/decode_speed.json"))
    args = parser.parse_args(argv)
    enable_compilation_cache()

    built = build_model(None)
    prompt = built.tokenizer.encode(built.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}]))
    proposer = build_proposer("ngram", built.model) if any(k > 0 for k in args.k_menu) else None
    engine = Engine(built.model, proposer, Menu(num_slots=1, max_len=max(args.windows), batch_buckets=(1,),
                                                k_menu=args.k_menu, window_buckets=args.windows,
                                                prefill_buckets=(64,)))
    engine.warmup(progress=False)
    load_before = load()
    rows = step_vs_bare(engine, repeats=args.step_repeats)
    growth = window_growth(engine, rows)
    print(format_rows(rows))
    print(format_growth(growth))
    # alternate the two engines, repeated; per-token decode time excludes prefill on both sides: ours times
    # the steps after the first token, HF's is (generate(n) - generate(1)) / (n - 1)
    hf = None if args.skip_hf else HFDecoder()
    if hf is not None:
        hf.generate(prompt, 4)  # warm-up
    ours_times, hf_times, ours, hf_tokens = [], [], [], []
    for _ in range(args.repeats):
        ours, seconds, _steps = decode_tokens(engine, prompt, args.tokens + 1, 0)
        ours_times.append(seconds / args.tokens)
        if hf is not None:
            hf_tokens, whole = hf.generate(prompt, args.tokens + 1)
            _, first = hf.generate(prompt, 1)
            hf_times.append((whole - first) / args.tokens)
    ours_s = float(np.median(ours_times))
    result = {
        "machine": machine(), "tokens": args.tokens, "prompt_tokens": len(prompt), "repeats": args.repeats,
        "weight_mb": weight_mb(engine), "load_before": load_before,
        "jaxspec_ms_per_token": ours_s * 1e3, "jaxspec_ms_per_token_all": [1e3 * t for t in ours_times],
        # k = 0 at the first window (where this decode runs): the step alone vs the bare chain at T = 1
        "floor_ms_per_token": rows[0]["bare_ms"], "ratio_to_floor": ours_s * 1e3 / rows[0]["bare_ms"],
        "step_vs_bare": rows, "window_growth": growth,
    }
    if hf is not None:
        hf_s = float(np.median(hf_times))
        result.update(hf_ms_per_token=hf_s * 1e3, hf_ms_per_token_all=[1e3 * t for t in hf_times],
                      speedup_vs_hf=hf_s / ours_s, outputs_equal=ours[:args.tokens + 1] == hf_tokens)
    result["load_after"] = load()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
