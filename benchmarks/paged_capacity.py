"""Requests served at once at equal KV cache bytes: the paged cache against the per-slot layout.

    python -m benchmarks.paged_capacity --out docs/results/paged/capacity.json

The workload is ShareGPT's mixed lengths: per conversation the first human turn (chat-templated) is the prompt
and the first gpt turn's token count is the request's output length (ignore_eos, max_tokens = that count), the
prompt cut to `--max-prompt` tokens and the output to what keeps prompt + output < max_len. All requests are
submitted at once (`Scheduler.generate_all`), plain decoding (no proposer), to two engines over the same model
whose target caches take the same bytes:

    per-slot  page_size = max_len, num_slots = S, num_pages = S + 1: each request holds one max_len page, which is
              exactly the per-slot layout (S slots and a scratch one); batch buckets those of --batch-buckets <= S
              (S included)
    paged     page_size = --page-size (16), num_pages = (S + 1) * max_len / page_size (the same bytes), and the
              larger row limit --paged-slots (16) with --batch-buckets (1, 4, 8, 16)

Both have the window buckets (max_len,) (per-slot cannot have smaller ones: a window is a page count) and prefix
caching off (the chat template's shared system prompt would fill paged pages only: this measures capacity alone).
Per layout, a step listener records each decode step's running requests (`StepStats.view.batch_size`), its
`elapsed_s` and the queue's length; the report gives the time-weighted mean (and the mean while requests were
still waiting, the saturated phase) and peak of running requests, output tokens per second over the run's wall
time, and the scheduler's preemptions, then paged / per-slot (goal: >= 3x requests at once). `--rounds` > 1
alternates the layouts (per-slot first in even rounds). Record the load with the result (it is saved).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import sys
import time
from pathlib import Path

import numpy as np

DEFAULT_BUCKETS = (1, 4, 8, 16)


def encode_prompt(tokenizer, text: str) -> list[int]:
    """A user message as prompt ids: chat-templated when the tokenizer has a template."""
    if getattr(tokenizer, "chat_template", None):
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}])
        return list(tokenizer.encode(rendered, add_special_tokens=False))
    return list(tokenizer.encode(text))


def sharegpt_requests(tokenizer, n: int, max_len: int, max_prompt: int, seed: int) -> list[dict]:
    """`n` seeded ShareGPT requests: {prompt (ids), output_len, gpt_len (uncut)}; prompt + output_len < max_len."""
    from jaxspec.training.distill_data import iter_sharegpt

    pairs = []
    for conv in iter_sharegpt(max_bytes=8 << 20):
        turns = conv.get("conversations") or []
        if len(turns) < 2 or turns[0].get("from") != "human" or turns[1].get("from") != "gpt":
            continue
        human, gpt = (turns[0].get("value") or "").strip(), (turns[1].get("value") or "").strip()
        if len(human) >= 16 and gpt:
            pairs.append((human, gpt))
        if len(pairs) >= 4 * n:
            break
    if len(pairs) < n:
        raise ValueError(f"only {len(pairs)} ShareGPT conversations with a human and a gpt turn (wanted {n})")
    out = []
    for i in np.random.default_rng(seed).permutation(len(pairs))[:n]:
        human, gpt = pairs[int(i)]
        prompt = encode_prompt(tokenizer, human)[:max_prompt]
        gpt_len = len(tokenizer.encode(gpt, add_special_tokens=False))
        output_len = max(1, min(gpt_len, max_len - 1 - len(prompt)))
        out.append({"prompt": prompt, "gpt_len": gpt_len, "output_len": output_len})
    return out


def layouts(args) -> dict:
    """The two menus of equal target-cache bytes (see the module doc)."""
    from jaxspec.menu import Menu

    s, m = args.per_slot_slots, args.max_len
    if (s + 1) * m % args.page_size:
        raise SystemExit(f"(S + 1) * max_len = {(s + 1) * m} is not a multiple of --page-size {args.page_size}")
    per_slot_buckets = tuple(sorted({b for b in args.batch_buckets if b < s} | {s}))
    common = dict(max_len=m, k_menu=(0,), window_buckets=(m,), prefill_buckets=args.prefill_buckets)
    return {
        "per-slot": Menu(num_slots=s, batch_buckets=per_slot_buckets, page_size=m, num_pages=s + 1, **common),
        "paged": Menu(num_slots=args.paged_slots, batch_buckets=args.batch_buckets, page_size=args.page_size,
                      num_pages=(s + 1) * m // args.page_size, **common),
    }


def serve(engine, requests: list[dict], tag: str) -> dict:
    """Submit every request at once to a fresh scheduler over `engine`; per-step and per-request raw numbers."""
    from jaxspec.scheduling.requests import Request
    from jaxspec.scheduling.scheduler import Scheduler
    from jaxspec.types import SamplingParams

    engine.reset()
    scheduler = Scheduler(engine)
    steps = []

    def listen(stats):
        page = engine.page_stats()
        steps.append({"running": stats.view.batch_size, "elapsed_s": stats.elapsed_s,
                      "waiting": scheduler.num_waiting, "pages_in_use": page.in_use})

    scheduler.add_step_listener(listen)
    batch = [Request(f"{tag}-{i}", r["prompt"], SamplingParams(max_tokens=r["output_len"], ignore_eos=True))
             for i, r in enumerate(requests)]
    t0 = time.perf_counter()
    results = scheduler.generate_all(batch)
    wall = time.perf_counter() - t0
    asked = {b.request_id: b.params.max_tokens for b in batch}
    bad = [r for r in results if r.error or len(r.token_ids) != asked[r.request_id]]
    if bad:
        raise RuntimeError(f"{tag}: {len(bad)} requests did not finish as asked, e.g. {bad[0].request_id}: "
                           f"{bad[0].finish_reason} {bad[0].error} ({len(bad[0].token_ids)} tokens)")
    return {"wall_s": wall, "steps": steps, "preemptions": scheduler.preemptions,
            "requests": [{"prompt_len": r.prompt_len, "tokens": len(r.token_ids), "preemptions": r.preemptions,
                          "ttft_s": r.timings.ttft_s, "total_s": r.timings.total_s} for r in results]}


def summarize(run: dict) -> dict:
    """Time-weighted mean and peak running requests, the same over the saturated steps (queue non-empty),
    output tokens per second over the wall time."""
    steps = run["steps"]
    if not steps:
        raise RuntimeError("the step listener recorded no decode step (did it fail? see the log above)")
    running = np.array([s["running"] for s in steps], float)
    elapsed = np.array([s["elapsed_s"] for s in steps], float)
    saturated = np.array([s["waiting"] > 0 for s in steps])
    tokens = sum(r["tokens"] for r in run["requests"])
    weighted = lambda mask: float((running[mask] * elapsed[mask]).sum() / elapsed[mask].sum()) if mask.any() \
        else float("nan")  # noqa: E731
    return {"mean_running": weighted(np.ones_like(saturated)), "peak_running": int(running.max()),
            "saturated_mean_running": weighted(saturated), "saturated_s": float(elapsed[saturated].sum()),
            "decode_steps": len(steps), "output_tokens": tokens, "wall_s": run["wall_s"],
            "output_tokens_per_s": tokens / run["wall_s"], "preemptions": run["preemptions"],
            "peak_pages_in_use": max(s["pages_in_use"] for s in steps)}


def main(argv: list[str] | None = None) -> int:
    ints = lambda v: tuple(int(x) for x in v.split(","))  # noqa: E731
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model spec or random-weights preset (default: SmolLM2-135M)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--requests", type=int, default=64, help="ShareGPT requests, all submitted at once")
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--max-prompt", type=int, default=512, help="prompt tokens kept (its head)")
    parser.add_argument("--per-slot-slots", type=int, default=4, help="S: the per-slot layout's slots")
    parser.add_argument("--paged-slots", type=int, default=16, help="the paged layout's row limit (num_slots)")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--batch-buckets", type=ints, default=DEFAULT_BUCKETS)
    parser.add_argument("--prefill-buckets", type=ints, default=(64, 256))
    parser.add_argument("--rounds", type=int, default=1, help="runs of each layout, alternated")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)

    from jaxspec.bench.common import machine
    from jaxspec.bench.workloads import ByteIds
    from jaxspec.engine.build import build_model
    from jaxspec.engine.engine import Engine, enable_compilation_cache

    load_before = os.getloadavg()
    enable_compilation_cache()
    built = build_model(args.model, dtype=args.dtype)
    tokenizer = built.tokenizer or ByteIds(built.model.config.vocab_size)
    requests = sharegpt_requests(tokenizer, args.requests, args.max_len, args.max_prompt, args.seed)
    menus = layouts(args)
    engines = {}
    for name, menu in menus.items():
        engines[name] = Engine(built.model, None, menu, prefix_cache=False)
        t0 = time.perf_counter()
        engines[name].warmup(progress=False)
        print(f"{name}: warm-up {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    runs: dict[str, list[dict]] = {name: [] for name in menus}
    for round_ in range(args.rounds):
        for name in (("per-slot", "paged") if round_ % 2 == 0 else ("paged", "per-slot")):
            run = serve(engines[name], requests, f"{name}{round_}")
            run["summary"] = summarize(run)
            runs[name].append(run)
            s = run["summary"]
            print(f"round {round_} {name:>8}: mean running {s['mean_running']:.2f} (saturated "
                  f"{s['saturated_mean_running']:.2f}, peak {s['peak_running']}), {s['output_tokens_per_s']:.1f} "
                  f"tokens/s, {s['preemptions']} preemptions, {s['wall_s']:.1f} s", file=sys.stderr)
    med = lambda name, key: float(np.median([r["summary"][key] for r in runs[name]]))  # noqa: E731
    keys = ("mean_running", "saturated_mean_running", "peak_running", "output_tokens_per_s", "preemptions")
    table = {name: {key: med(name, key) for key in keys} for name in menus}
    ratio = {key: table["paged"][key] / table["per-slot"][key] if table["per-slot"][key] else float("nan")
             for key in keys if key != "preemptions"}
    load_after = os.getloadavg()
    print(json.dumps({"per-slot": table["per-slot"], "paged": table["paged"], "paged / per-slot": ratio}, indent=1))
    bytes_per_position = 2 * built.model.config.num_layers * built.model.config.num_kv_heads \
        * built.model.config.head_dim * np.dtype(built.model.config.dtype).itemsize
    report = {
        "command": shlex.join([sys.executable, *sys.argv]),
        "date": datetime.datetime.now().isoformat(timespec="seconds"), "machine": machine(),
        "load_before": load_before, "load_after": load_after, "model": built.name,
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "menus": {name: {"num_slots": m.num_slots, "page_size": m.page_size, "num_pages": m.pool_pages,
                         "usable_positions": (m.pool_pages - 1) * m.page_size,
                         "cache_bytes": m.pool_pages * m.page_size * bytes_per_position,
                         "batch_buckets": m.batch_buckets, "window_buckets": m.window_buckets,
                         "prefill_buckets": m.prefill_buckets} for name, m in menus.items()},
        "workload": {"prompt_len": [len(r["prompt"]) for r in requests],
                     "output_len": [r["output_len"] for r in requests], "gpt_len": [r["gpt_len"] for r in requests]},
        "summary": table, "ratio": ratio, "goal": "paged / per-slot mean running >= 3",
        "runs": runs,
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
