"""Speculative step speed at B = 1 on the default model: tokens/s vs plain decoding for each k.

    python -m benchmarks.spec_speed --tokens 96 --out docs/results/spec_speed.json

Scenarios: (a) prompt lookup on a prompt whose answer copies the input (rewrite a paragraph),
(b) the target as its own draft (acceptance 1 at temperature 0: the cost of drafting with a model
as large as the target). Every k runs the same greedy request in the same process, and every
output is checked equal to plain decoding.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from jaxspec.bench.common import decode_tokens, machine
from jaxspec.engine.build import build_model
from jaxspec.engine.engine import Engine, enable_compilation_cache
from jaxspec.menu import Menu
from jaxspec.speculation.proposers.draft_model import DraftModelProposer
from jaxspec.speculation.proposers.prompt_lookup import PromptLookupProposer

PARAGRAPH = ("The James Webb Space Telescope observes the universe in infrared light. Its primary mirror is "
             "made of eighteen hexagonal segments coated with gold, and a sunshield the size of a tennis court "
             "keeps its instruments cold. From its orbit around the second Lagrange point it studies the first "
             "galaxies, the birth of stars and the atmospheres of planets around other stars.")
COPY_PROMPT = f"Repeat the following text exactly, word for word:\n\n{PARAGRAPH}"


def run_scenario(name, engine, plain, prompt, n_tokens, ks):
    ref, plain_s, plain_steps = decode_tokens(plain, prompt, n_tokens, 0)
    rows = [{"scenario": name, "k": 0, "tokens_per_s": (n_tokens - 1) / plain_s, "speedup": 1.0,
             "tokens_per_step": (n_tokens - 1) / plain_steps, "equal_to_plain": True}]
    for k in ks:
        out, seconds, steps = decode_tokens(engine, prompt, n_tokens, k)
        rows.append({"scenario": name, "k": k, "tokens_per_s": (n_tokens - 1) / seconds,
                     "speedup": plain_s / seconds, "tokens_per_step": (n_tokens - 1) / steps,
                     "equal_to_plain": out == ref})
        print(rows[-1], flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--ks", default="1,2,3,4,5,6,8")
    parser.add_argument("--out", type=Path, default=Path("docs/results/spec_speed.json"))
    args = parser.parse_args(argv)
    ks = tuple(int(x) for x in args.ks.split(","))
    enable_compilation_cache()
    built = build_model(None)
    tok = built.tokenizer
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": COPY_PROMPT}]))
    config = Menu(num_slots=1, max_len=512, batch_buckets=(1,), k_menu=(0,) + ks,
                          window_buckets=(512,), prefill_buckets=(128,))
    plain = Engine(built.model, None, config)
    plain.warmup(progress=True)
    rows = []
    for name, proposer in (("ngram-copy", PromptLookupProposer()), ("self-draft", DraftModelProposer(built.model))):
        engine = Engine(built.model, proposer, config)
        engine.warmup(progress=True)
        rows += run_scenario(name, engine, plain, prompt, args.tokens, ks)
        del engine
    result = {"machine": machine(), "tokens": args.tokens, "prompt_tokens": len(prompt), "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
