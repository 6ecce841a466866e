"""Offline throughput of an N-prompt batch: batch buckets × {no speculation, fixed k}.

    python -m benchmarks.offline_throughput --model smollm2-135m --proposer ngram --ks 2,4 \
        --buckets 1,4,16 --prompts 32 --max-tokens 128 --out artifacts/offline_throughput.md

Method: two engines over the same target, compiled once: plain decoding ("none", no proposer at
all, so no draft overhead) and the chosen proposer with k_menu = {0} ∪ ks. For each bucket B the
whole batch runs through the scheduler with at most B requests at once (smaller buckets serve the
tail); each row is timed after warm-up, so no compile is inside a measurement (checked).

tokens/s = generated tokens / wall time of the whole batch (prefill included).
acceptance = accepted / proposed draft tokens.   mean k = mean padded k over the steps of the batch.
Greedy and ignore_eos by default, so every row generates the same number of tokens.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np

from jaxspec.engine import compile_counter
from jaxspec.engine.build import build_model, build_proposer
from jaxspec.engine.engine import Engine, enable_compilation_cache
from jaxspec.menu import Menu
from jaxspec.policy.base import Policy
from jaxspec.policy.fixed import FixedPolicy, NoSpeculation
from jaxspec.scheduling.requests import Request
from jaxspec.scheduling.scheduler import Scheduler, SchedulerConfig
from jaxspec.types import SamplingParams

TOPICS = ["a lighthouse keeper", "the history of tea", "how rainbows form", "a robot learning to paint",
          "sorting algorithms", "the moons of Jupiter", "a city under the sea", "writing clean code"]


@dataclasses.dataclass(frozen=True)
class Row:
    bucket: int
    policy: str
    requests: int
    tokens: int
    wall_s: float
    acceptance: float | None
    mean_k: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s


def parse_ints(text: str) -> tuple[int, ...]:
    return tuple(sorted({int(x) for x in text.split(",") if x.strip()}))


def make_prompts(args, tokenizer, vocab: int) -> list[list[int]]:
    if args.input:
        prompts = []
        for line in Path(args.input).read_text(encoding="utf-8").splitlines():
            if line.strip():
                obj = json.loads(line)
                if "messages" in obj:
                    prompts.append(tokenizer.encode(tokenizer.apply_chat_template(obj["messages"]),
                                                    add_special_tokens=False))
                else:
                    prompts.append(tokenizer.encode(obj["prompt"]))
        return (prompts * (args.prompts // max(len(prompts), 1) + 1))[: args.prompts]
    if tokenizer is None:  # a weightless preset: random token ids
        rng = np.random.default_rng(args.seed)
        return [[int(t) for t in rng.integers(3, vocab, size=int(rng.integers(16, 64)))] for _ in range(args.prompts)]
    prompts = []
    for i in range(args.prompts):
        messages = [{"role": "user", "content": f"Write a few paragraphs about {TOPICS[i % len(TOPICS)]}."}]
        if tokenizer.chat_template:
            prompts.append(tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False))
        else:
            prompts.append(tokenizer.encode(messages[0]["content"]))
    return prompts


def run_batch(engine: Engine, tokenizer, policy: Policy, prompts, params: SamplingParams, bucket: int) -> Row:
    scheduler = Scheduler(engine, policy, tokenizer, SchedulerConfig(max_running=bucket))
    requests = [Request(f"p{i}", p, params) for i, p in enumerate(prompts)]
    before = compile_counter.count()
    t0 = time.perf_counter()
    results = scheduler.generate_all(requests)
    wall = time.perf_counter() - t0
    if compile_counter.count() != before:
        raise RuntimeError(f"{compile_counter.count() - before} compiles inside a timed run: the menu is incomplete")
    failed = [r for r in results if r.error]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed, e.g. {failed[0].request_id}: {failed[0].error}")
    proposed = sum(r.proposed for r in results)
    steps = [s.k for r in results for s in r.steps]
    return Row(bucket=bucket, policy=policy.name, requests=len(results), tokens=sum(len(r.token_ids) for r in results),
               wall_s=wall, acceptance=sum(r.accepted for r in results) / proposed if proposed else None,
               mean_k=float(np.mean(steps)) if steps else 0.0)


def markdown(rows: list[Row], title: str) -> str:
    base = {r.bucket: r.tokens_per_s for r in rows if r.policy == "none"}
    lines = [f"### {title}", "",
             "| bucket B | policy | requests | tokens | wall (s) | tokens/s | vs none | acceptance | mean k |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        speedup = f"{r.tokens_per_s / base[r.bucket]:.2f}×" if r.bucket in base else "–"
        acc = "–" if r.acceptance is None else f"{r.acceptance:.3f}"
        lines.append(f"| {r.bucket} | {r.policy} | {r.requests} | {r.tokens} | {r.wall_s:.2f} | {r.tokens_per_s:.1f} "
                     f"| {speedup} | {acc} | {r.mean_k:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model spec (default: the embedded default model)")
    parser.add_argument("--proposer", choices=("ngram", "draft"), default="ngram")
    parser.add_argument("--draft", default=None,
                        help="draft spec for --proposer draft (self, truncated:N, default, ...)")
    parser.add_argument("--ks", type=parse_ints, default=(2, 4), help="fixed k values, comma-separated")
    parser.add_argument("--buckets", type=parse_ints, default=(1, 4, 16), help="batch buckets, comma-separated")
    parser.add_argument("--prompts", type=int, default=32, help="requests in the batch")
    parser.add_argument("--input", default=None, help="JSONL of {prompt | messages} (default: built-in prompts)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--respect-eos", action="store_true", help="stop at EOS (default: generate max-tokens)")
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--windows", type=parse_ints, default=None, help="attention windows (default: 256,max-len)")
    parser.add_argument("--prefill", type=parse_ints, default=(64, 256), help="prefill chunk buckets")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="write the markdown table here too")
    args = parser.parse_args(argv)

    enable_compilation_cache()
    compile_counter.install()
    built = build_model(args.model, seed=args.seed)
    windows = args.windows or tuple(sorted({min(256, args.max_len), args.max_len}))
    menu = Menu(num_slots=max(args.buckets), max_len=args.max_len, batch_buckets=args.buckets, k_menu=(0,),
                        window_buckets=windows, prefill_buckets=tuple(p for p in args.prefill if p <= args.max_len))
    prompts = make_prompts(args, built.tokenizer, built.model.config.vocab_size)
    longest = max(len(p) for p in prompts)
    if longest + 1 > args.max_len:
        parser.error(f"a prompt has {longest} tokens; raise --max-len above {longest}")
    params = SamplingParams(temperature=args.temperature, seed=args.seed if args.temperature > 0 else None,
                            max_tokens=args.max_tokens, ignore_eos=not args.respect_eos)

    plain = Engine(built.model, None, menu)
    spec = Engine(built.model, build_proposer(args.proposer, built.model, args.draft),
                  menu.replace(k_menu=(0, *args.ks)))
    t0 = time.perf_counter()
    plain.warmup()
    spec.warmup()
    shapes = len(plain.shape_keys()) + len(spec.shape_keys())
    print(f"warm-up: {shapes} shapes in {time.perf_counter() - t0:.1f} s", file=sys.stderr)

    rows = []
    for bucket in args.buckets:
        rows.append(run_batch(plain, built.tokenizer, NoSpeculation(), prompts, params, bucket))
        for k in args.ks:
            rows.append(run_batch(spec, built.tokenizer, FixedPolicy(k), prompts, params, bucket))
        print(markdown(rows[-1 - len(args.ks):], f"bucket {bucket}"), file=sys.stderr)
    title = (f"Offline throughput: {built.name}, proposer {args.proposer}"
             f"{' (' + args.draft + ')' if args.draft else ''}, {len(prompts)} prompts × {args.max_tokens} tokens, "
             f"T={args.temperature}")
    table = markdown(rows, title)
    print(table)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(table, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
