"""Plain greedy decode speed at batch 1: jaxspec vs HF transformers on the same GGUF, and the floor.

    python -m benchmarks.decode_speed --tokens 64 --out docs/results/decode_speed.json

floor = fp32 weight bytes / measured read bandwidth (one pass over the weights per token).
Both engines decode the same prompt greedily in the same process, one after the other; the
outputs are compared token for token.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import jax
import numpy as np

from benchmarks.common import decode_tokens, machine, measured_bandwidth_gbs
from jaxspec.build import build_model
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
    parser.add_argument("--out", type=Path, default=Path("docs/results/decode_speed.json"))
    args = parser.parse_args(argv)
    enable_compilation_cache()

    built = build_model(None)
    prompt = built.tokenizer.encode(built.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}]))
    engine = Engine(built.model, None, Menu(num_slots=1, max_len=512, batch_buckets=(1,), k_menu=(0,),
                                                    window_buckets=(512,), prefill_buckets=(64,)))
    engine.warmup(progress=False)
    times, ours = [], []
    for _ in range(args.repeats):
        ours, seconds, _steps = decode_tokens(engine, prompt, args.tokens + 1, 0)
        times.append(seconds / args.tokens)
    ours_s = float(np.median(times))
    leaves = jax.tree.leaves(engine.placed_weights())  # the serving weights (a streamed model keeps no others)
    weight_bytes = sum(x.size * x.dtype.itemsize for x in leaves)
    bandwidth = measured_bandwidth_gbs(leaves)
    floor_s = weight_bytes / (bandwidth * 1e9)
    hf_tokens, hf_s = hf_decode(prompt, args.tokens, args.repeats)
    result = {
        "machine": machine(), "tokens": args.tokens, "prompt_tokens": len(prompt),
        "jaxspec_ms_per_token": ours_s * 1e3, "hf_ms_per_token": hf_s * 1e3,
        "floor_ms_per_token": floor_s * 1e3, "weight_mb": weight_bytes / 1e6, "bandwidth_gbs": bandwidth,
        "speedup_vs_hf": hf_s / ours_s, "ratio_to_floor": ours_s / floor_s,
        "outputs_equal": ours[:args.tokens] == hf_tokens,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
