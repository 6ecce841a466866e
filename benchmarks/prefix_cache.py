"""Time to first token with a shared ~1,000-token system prompt: the prefix cache warm against cold.

    python -m benchmarks.prefix_cache --out docs/results/paged/prefix_cache.json

A chat workload whose requests share one system prompt (an aclsum paper's title, abstract and body, tokenized and
cut to `--system-tokens`, 1,000) followed by different ShareGPT first user turns (each cut to `--max-user` tokens),
chat-templated as a system and a user message (byte ids of "system\\n\\nuser" for a weightless preset). Two engines
over the same model and menu (max_len 2048, one slot, prefill buckets (64, 256), window buckets multiples of the
page size, plain decoding): `warm` with prefix caching on, `cold` with `prefix_cache=False`. Each first serves one
unmeasured request (on `warm` it writes the prefix's pages), then every request runs on both, one at a time
(c = 1), the two engines alternated request by request (cold first on even requests, warm first on odd ones), each
with its own `Scheduler`, greedy, `--max-tokens` (1) tokens.

Reported per engine: TTFT (`RequestResult.timings.ttft_s`) mean and median, and prompt tokens computed over prompt
tokens (sum of prompt_len - cached_prompt_tokens over sum of prompt_len); then cold / warm of the mean and median
TTFT and the median of the per-request ratios (goal: >= 5x), and how many requests' first tokens agree (greedy:
the cached prefix's keys and values are the ones a cold prefill computes, up to float rounding of other chunking).
Record the load with the result (it is saved).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path


def cut_text(tokenizer, text: str, tokens: int) -> str:
    """The head of `text` that is about `tokens` tokens (decoded back; byte ids: bytes)."""
    if hasattr(tokenizer, "decode"):
        return tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)[:tokens])
    return text.encode("utf-8")[:tokens].decode("utf-8", errors="ignore")


def chat_prompt(tokenizer, system: str, user: str) -> list[int]:
    """A system and a user message as prompt ids: chat-templated when the tokenizer has a template."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": user}])
        return list(tokenizer.encode(text, add_special_tokens=False))
    return list(tokenizer.encode(f"{system}\n\n{user}"))


def system_text(tokenizer, tokens: int) -> str:
    """The first aclsum paper (title, abstract, body) cut to about `tokens` tokens."""
    from jaxspec.bench.workloads import package_files

    paper = json.loads(package_files("aclsum", "paper_jsons/", ".json")[0].read_text(encoding="utf-8"))
    body = " ".join(p.get("text", "") for p in (paper.get("pdf_parse") or {}).get("body_text", []))
    text = f"Title: {paper.get('title', '')}\n\nAbstract: {paper.get('abstract', '')}\n\n{body}"
    return cut_text(tokenizer, text, tokens)


def user_turns(tokenizer, n: int, max_user: int) -> list[str]:
    """`n` ShareGPT first user turns (at least 16 characters), each cut to `max_user` tokens."""
    from jaxspec.training.distill_data import iter_sharegpt

    out = []
    for conv in iter_sharegpt(max_bytes=8 << 20):
        turns = conv.get("conversations") or []
        if turns and turns[0].get("from") == "human" and len((turns[0].get("value") or "").strip()) >= 16:
            out.append(cut_text(tokenizer, turns[0]["value"].strip(), max_user))
        if len(out) == n:
            return out
    raise ValueError(f"only {len(out)} ShareGPT user turns (wanted {n})")


def shared_prefix(prompts: list[list[int]]) -> int:
    """Tokens every prompt starts with."""
    n = min(len(p) for p in prompts)
    return next((i for i in range(n) if len({p[i] for p in prompts}) > 1), n)


def main(argv: list[str] | None = None) -> int:
    ints = lambda v: tuple(int(x) for x in v.split(","))  # noqa: E731
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model spec or random-weights preset (default: SmolLM2-135M)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--requests", type=int, default=32, help="measured requests (each on both engines)")
    parser.add_argument("--system-tokens", type=int, default=1000)
    parser.add_argument("--max-user", type=int, default=256, help="tokens kept of each user turn (its head)")
    parser.add_argument("--max-tokens", type=int, default=1)
    parser.add_argument("--max-len", type=int, default=2048)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--window-buckets", type=ints, default=(512, 1024, 1536, 2048))
    parser.add_argument("--prefill-buckets", type=ints, default=(64, 256))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)

    from jaxspec.bench.common import machine
    from jaxspec.bench.workloads import ByteIds
    from jaxspec.engine.build import build_model
    from jaxspec.engine.engine import Engine, enable_compilation_cache
    from jaxspec.menu import Menu
    from jaxspec.scheduling.requests import Request
    from jaxspec.scheduling.scheduler import Scheduler
    from jaxspec.types import SamplingParams

    load_before = os.getloadavg()
    enable_compilation_cache()
    built = build_model(args.model, dtype=args.dtype)
    tokenizer = built.tokenizer or ByteIds(built.model.config.vocab_size)
    system = system_text(tokenizer, args.system_tokens)
    prompts = [chat_prompt(tokenizer, system, user) for user in user_turns(tokenizer, args.requests + 1, args.max_user)]
    longest = max(len(p) for p in prompts)
    if longest + args.max_tokens > args.max_len:
        raise SystemExit(f"a prompt of {longest} tokens and --max-tokens {args.max_tokens} exceed --max-len "
                         f"{args.max_len}")
    menu = Menu(num_slots=1, max_len=args.max_len, batch_buckets=(1,), k_menu=(0,), window_buckets=args.window_buckets,
                prefill_buckets=args.prefill_buckets, page_size=args.page_size)
    schedulers = {}
    for name, prefix_cache in (("cold", False), ("warm", True)):
        engine = Engine(built.model, None, menu, prefix_cache=prefix_cache)
        t0 = time.perf_counter()
        engine.warmup(progress=False)
        print(f"{name}: warm-up {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        schedulers[name] = Scheduler(engine)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)

    def serve(name: str, i: int, prompt: list[int]) -> dict:
        result = schedulers[name].generate_all([Request(f"{name}-{i}", prompt, params)])[0]
        if result.error:
            raise RuntimeError(f"{name} request {i} failed: {result.error}")
        return {"ttft_s": result.timings.ttft_s, "prompt_len": result.prompt_len,
                "cached_prompt_tokens": result.cached_prompt_tokens, "first_token": result.token_ids[0]}

    primed = {name: serve(name, -1, prompts[0]) for name in schedulers}  # warm: writes the prefix's pages
    rows = []
    for i, prompt in enumerate(prompts[1:]):
        order = ("cold", "warm") if i % 2 == 0 else ("warm", "cold")
        rows.append({name: serve(name, i, prompt) for name in order})
        r = rows[-1]
        print(f"{i:>3}: prompt {len(prompt)}, cold {r['cold']['ttft_s'] * 1e3:.1f} ms, warm "
              f"{r['warm']['ttft_s'] * 1e3:.1f} ms ({r['warm']['cached_prompt_tokens']} cached)", file=sys.stderr)
    load_after = os.getloadavg()

    summary = {}
    for name in schedulers:
        ttft = [r[name]["ttft_s"] for r in rows]
        prompt_tokens = sum(r[name]["prompt_len"] for r in rows)
        computed = sum(r[name]["prompt_len"] - r[name]["cached_prompt_tokens"] for r in rows)
        summary[name] = {"mean_ttft_ms": statistics.mean(ttft) * 1e3, "median_ttft_ms": statistics.median(ttft) * 1e3,
                         "prompt_tokens": prompt_tokens, "computed_prompt_tokens": computed,
                         "computed_fraction": computed / prompt_tokens}
    ratios = {"mean_ttft": summary["cold"]["mean_ttft_ms"] / summary["warm"]["mean_ttft_ms"],
              "median_ttft": summary["cold"]["median_ttft_ms"] / summary["warm"]["median_ttft_ms"],
              "median_of_per_request": statistics.median(r["cold"]["ttft_s"] / r["warm"]["ttft_s"] for r in rows)}
    agree = sum(r["cold"]["first_token"] == r["warm"]["first_token"] for r in rows)
    print(json.dumps({"summary": summary, "cold / warm": ratios, "first tokens agree": f"{agree}/{len(rows)}"},
                     indent=1))
    if args.out:
        report = {
            "command": shlex.join([sys.executable, *sys.argv]),
            "date": datetime.datetime.now().isoformat(timespec="seconds"), "machine": machine(),
            "load_before": load_before, "load_after": load_after, "model": built.name,
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "menu": {"num_slots": menu.num_slots, "max_len": menu.max_len, "page_size": menu.page_size,
                     "num_pages": menu.pool_pages, "window_buckets": menu.window_buckets,
                     "prefill_buckets": menu.prefill_buckets},
            "shared_prefix_tokens": shared_prefix(prompts), "prompt_lens": [len(p) for p in prompts[1:]],
            "summary": summary, "ratio_cold_over_warm": ratios, "goal": "cold / warm TTFT >= 5",
            "first_tokens_agree": agree, "primed": primed, "rows": rows,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
