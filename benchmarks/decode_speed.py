"""Plain greedy decode speed at batch 1: jaxspec vs HF transformers on the same GGUF, and the floor.

    python -m benchmarks.decode_speed --tokens 64 --out docs/results/decode_speed.json

The floor is the bare matmul chain of the model's own serving weights (`benchmarks.floor`): the
same matmuls at the same shapes over the same placed arrays, nothing else, jitted, at T = k + 1.
The engine's compiled step executable is timed alone at every (k, W) of the menu at B = 1 next to
it, in the same process, and the table reports engine / bare (with the machine load before and
after each row: numbers taken above a load of about 1 on a 2-core machine are distorted).
Both engines decode the same prompt greedily in the same process, one after the other; the
outputs are compared token for token (--skip-hf leaves transformers out).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np

from benchmarks.common import decode_tokens, machine
from benchmarks.floor import format_rows, load, step_vs_bare, weight_mb
from jaxspec.build import build_model, build_proposer
from jaxspec.engine import Engine, enable_compilation_cache
from jaxspec.menu import Menu
from models.loading import resolve_model

PROMPT = ("Write a short story about a lighthouse keeper who finds a message in a bottle. "
          "Describe the sea, the weather and the keeper's thoughts in detail.")


def hf_decode(prompt_ids: list[int], n_tokens: int, repeats: int) -> tuple[list[int], float]:
    """Greedy generate with transformers on the same GGUF; returns (tokens, seconds per token)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(os.cpu_count() or 1)
    path = resolve_model(None).path
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                 dtype=torch.float32).eval()
    ids = torch.tensor([prompt_ids])
    times = []
    with torch.no_grad():
        model.generate(ids, max_new_tokens=4, do_sample=False)  # warm-up
        for _ in range(repeats):
            t = time.perf_counter()
            out = model.generate(ids, max_new_tokens=n_tokens, min_new_tokens=n_tokens, do_sample=False)
            times.append((time.perf_counter() - t) / n_tokens)
    return out[0, len(prompt_ids):].tolist(), float(np.median(times))


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
    print(format_rows(rows))
    times, ours = [], []
    for _ in range(args.repeats):
        ours, seconds, _steps = decode_tokens(engine, prompt, args.tokens + 1, 0)
        times.append(seconds / args.tokens)
    ours_s = float(np.median(times))
    result = {
        "machine": machine(), "tokens": args.tokens, "prompt_tokens": len(prompt),
        "weight_mb": weight_mb(engine), "load_before": load_before,
        "jaxspec_ms_per_token": ours_s * 1e3,
        # k = 0 at the first window (where this decode runs): the step alone vs the bare chain at T = 1
        "floor_ms_per_token": rows[0]["bare_ms"], "ratio_to_floor": ours_s * 1e3 / rows[0]["bare_ms"],
        "step_vs_bare": rows,
    }
    if not args.skip_hf:
        hf_tokens, hf_s = hf_decode(prompt, args.tokens, args.repeats)
        result.update(hf_ms_per_token=hf_s * 1e3, speedup_vs_hf=hf_s / ours_s,
                      outputs_equal=ours[:args.tokens] == hf_tokens)
    result["load_after"] = load()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
