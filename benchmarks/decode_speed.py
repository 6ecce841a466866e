"""Plain greedy decode speed at batch 1: jaxspec vs HF transformers on the same GGUF, and the floor.

    python -m benchmarks.decode_speed --tokens 64 --out docs/results/decode_speed.json

The floor is the bare matmul chain of the model's own serving weights (`jaxspec.bench.floor`): the
same matmuls at the same shapes over the same placed arrays, nothing else, jitted, at T = k + 1.
The engine's compiled step executable is timed alone at every (k, W) of the menu at B = 1 next to
it, in the same process, and the table reports engine / bare (with the machine load before and
after each row: numbers taken above a load of about 1 on a 2-core machine are distorted). Where the
engine's weights are column panels (`jaxspec.models.panel_matmul`, XLA:CPU) the table also times the chain with
XLA's dot. `--xla-form` adds a second engine, the model loaded again under
`kernels='xla'` (XLA's weight layout and attention form), alternated with the
first: what this project's XLA:CPU kernels buy.
Both engines decode the same prompt greedily in the same process, alternating, `--repeats` times
(medians reported, every repeat kept); prefill is excluded on both sides; the outputs are compared
token for token (--skip-hf leaves transformers out). `--prompt-lookup K` adds the same comparison with
prompt lookup on both sides (jaxspec at fixed k = K, transformers with `prompt_lookup_num_tokens=K`) on a
prompt whose answer copies the input (`benchmarks.spec_speed.COPY_PROMPT`).

`--model PRESET --dtype bfloat16` times a random-weights preset instead (e.g. `qwen2.5-1.5b` on a GPU,
where the floor shows what a verify of k + 1 tokens costs there): the prompt is then fixed token ids,
since a preset has no tokenizer, and transformers is left out (`--skip-hf` is required).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import jax
import numpy as np

from benchmarks.spec_speed import COPY_PROMPT
from jaxspec.bench.common import decode_tokens, machine
from jaxspec.bench.floor import format_growth, format_rows, load, step_vs_bare, weight_mb, window_growth
from jaxspec.engine.build import build_model, build_proposer
from jaxspec.engine.engine import Engine, enable_compilation_cache
from jaxspec.menu import Menu
from jaxspec.models.loading import resolve_model

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

    def generate(self, prompt_ids: list[int], n_tokens: int, prompt_lookup: int = 0) -> tuple[list[int], float]:
        """(the n new tokens, wall seconds of the whole generate call, prefill included); prompt lookup of
        `prompt_lookup` tokens when > 0."""
        ids = self.torch.tensor([prompt_ids])
        lookup = {"prompt_lookup_num_tokens": prompt_lookup} if prompt_lookup else {}
        with self.torch.no_grad():
            t = time.perf_counter()
            out = self.model.generate(ids, max_new_tokens=n_tokens, min_new_tokens=n_tokens, do_sample=False,
                                      **lookup)
            return out[0, len(prompt_ids):].tolist(), time.perf_counter() - t


def side_by_side(engine: Engine, hf: HFDecoder | None, prompt: list[int], n_tokens: int, k: int,
                 repeats: int) -> dict:
    """Alternating, `repeats` times: ms per token after the first (prefill excluded) of the engine at fixed k and
    of transformers (prompt lookup of k tokens when k > 0, its time as (generate(n+1) - generate(1)) / n), with
    every repeat kept and the outputs compared."""
    if hf is not None:
        hf.generate(prompt, 4, k)  # warm-up
    ours_times, hf_times, ours, hf_tokens = [], [], [], []
    for _ in range(repeats):
        ours, seconds, _steps = decode_tokens(engine, prompt, n_tokens + 1, k)
        ours_times.append(seconds / n_tokens)
        if hf is not None:
            hf_tokens, whole = hf.generate(prompt, n_tokens + 1, k)
            _, first = hf.generate(prompt, 1, k)
            hf_times.append((whole - first) / n_tokens)
    ours_s = float(np.median(ours_times))
    out = {"k": k, "jaxspec_ms_per_token": ours_s * 1e3, "jaxspec_ms_per_token_all": [1e3 * t for t in ours_times]}
    if hf is not None:
        hf_s = float(np.median(hf_times))
        out.update(hf_ms_per_token=hf_s * 1e3, hf_ms_per_token_all=[1e3 * t for t in hf_times],
                   speedup_vs_hf=hf_s / ours_s, outputs_equal=ours[:n_tokens + 1] == hf_tokens)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None,
                        help="model spec or random-weights preset (default: the embedded SmolLM2-135M)")
    parser.add_argument("--dtype", default="float32", help="weight dtype (float32 on CPU; bfloat16 on GPU/TPU)")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--k-menu", type=lambda v: tuple(int(x) for x in v.split(",")), default=(0, 4),
                        help="k values of the engine-vs-bare table (k > 0 uses prompt lookup)")
    parser.add_argument("--windows", type=lambda v: tuple(int(x) for x in v.split(",")), default=(128, 512))
    parser.add_argument("--step-repeats", type=int, default=20, help="timed calls per row of the table")
    parser.add_argument("--skip-hf", action="store_true", help="leave out the transformers comparison")
    parser.add_argument("--prompt-lookup", type=int, default=0, metavar="K",
                        help="also compare prompt lookup of K tokens on both sides on a copying prompt (K in --k-menu)")
    parser.add_argument("--xla-form", action="store_true",
                        help="also time each step of a second engine (the model loaded again) in the XLA form, "
                             "alternated: attention and matmuls without this project's XLA:CPU kernels")
    parser.add_argument("--out", type=Path, default=Path("docs/results/decode_speed.json"))
    args = parser.parse_args(argv)
    if args.prompt_lookup and args.prompt_lookup not in args.k_menu:
        parser.error(f"--prompt-lookup {args.prompt_lookup} must be in --k-menu {args.k_menu}")
    enable_compilation_cache()

    built = build_model(args.model, dtype=args.dtype)
    if built.tokenizer is None:  # a random-weights preset: fixed ids, no transformers side, no copying prompt
        if not args.skip_hf or args.prompt_lookup:
            parser.error(f"--model {args.model} has no tokenizer: use --skip-hf and leave out --prompt-lookup")
        prompt = [2 + (7 * i) % (built.model.config.vocab_size - 2) for i in range(40)]
    else:
        prompt = built.tokenizer.encode(built.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}]))
    proposer = build_proposer("ngram", built.model) if any(k > 0 for k in args.k_menu) else None
    menu = Menu(num_slots=1, max_len=max(args.windows), batch_buckets=(1,), k_menu=args.k_menu,
                window_buckets=args.windows, prefill_buckets=(64,))
    engine = Engine(built.model, proposer, menu)
    engine.warmup(progress=False)
    reference = None
    if args.xla_form:
        # XLA's weight layout (a second load) and the XLA form in everything it compiles
        ref_model = build_model(args.model, dtype=args.dtype, kernels="xla").model
        reference = Engine(ref_model, build_proposer("ngram", ref_model, kernels="xla") if proposer else None, menu,
                           kernels="xla")
        reference.warmup(progress=False)
    load_before = load()
    rows = step_vs_bare(engine, repeats=args.step_repeats, reference=reference)
    del reference
    growth = window_growth(engine, rows)
    print(format_rows(rows))
    print(format_growth(growth))
    # alternate the two engines, repeated; per-token decode time excludes prefill on both sides: ours times
    # the steps after the first token, HF's is (generate(n) - generate(1)) / (n - 1)
    hf = None if args.skip_hf else HFDecoder()
    plain = side_by_side(engine, hf, prompt, args.tokens, 0, args.repeats)
    ours_s = plain["jaxspec_ms_per_token"] / 1e3
    result = {
        "command": "python -m benchmarks.decode_speed " + " ".join(argv if argv is not None else sys.argv[1:]),
        "model": built.name, "dtype": args.dtype, "devices": [str(d) for d in jax.devices()],
        "machine": machine(), "tokens": args.tokens, "prompt_tokens": len(prompt), "repeats": args.repeats,
        "weight_mb": weight_mb(engine), "load_before": load_before,
        "jaxspec_ms_per_token": ours_s * 1e3, "jaxspec_ms_per_token_all": plain["jaxspec_ms_per_token_all"],
        # k = 0 at the first window (where this decode runs): the step alone vs the bare chain at T = 1
        "floor_ms_per_token": rows[0]["bare_ms"], "ratio_to_floor": ours_s * 1e3 / rows[0]["bare_ms"],
        "step_vs_bare": rows, "window_growth": growth,
    }
    if hf is not None:
        result.update({key: plain[key] for key in ("hf_ms_per_token", "hf_ms_per_token_all", "speedup_vs_hf",
                                                   "outputs_equal")})
    if args.prompt_lookup:
        copy = built.tokenizer.encode(built.tokenizer.apply_chat_template([{"role": "user", "content": COPY_PROMPT}]))
        result["prompt_lookup"] = {"prompt_tokens": len(copy), "plain": side_by_side(engine, hf, copy, args.tokens, 0,
                                                                                     args.repeats),
                                   "lookup": side_by_side(engine, hf, copy, args.tokens, args.prompt_lookup,
                                                          args.repeats)}
    result["load_after"] = load()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
