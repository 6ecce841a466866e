"""`jaxspec generate PROMPT`: one request through the scheduler, streamed to stdout.

Multi-process (docs/multiprocess.md): process 0 runs the request; the others mirror its engine calls."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time

from jaxspec.engine import distributed
from jaxspec.engine.args import EngineArgs
from jaxspec.scheduling.requests import InvalidRequestError, Request, RequestLimits, validate_request
from jaxspec.scheduling.scheduler import Scheduler, SchedulerConfig
from jaxspec.serving.runtime import build_runtime, follow_runtime
from jaxspec.types import SamplingParams

REQUEST_ID = "generate"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", help="the prompt text")
    EngineArgs.add_arguments(parser, default_menu="generate")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most (default 128)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1.0 = off)")
    parser.add_argument("--top-k", type=int, default=0, help="top-k sampling (default 0 = off)")
    parser.add_argument("--seed", type=int, default=None, help="sampling seed (default: random)")
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object (text, token ids, stats) instead of streaming text")
    distributed.add_arguments(parser)


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    """The request's sampling values, checked before anything loads."""
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                            max_tokens=args.max_tokens, stop_strings=tuple(args.stop))
    params.validate()
    return params


def run(args: argparse.Namespace) -> int:
    if not args.prompt.strip():
        raise ValueError("the prompt is empty")
    engine_args = EngineArgs.from_namespace(args)
    params = sampling_params(args)
    link = distributed.initialize(distributed.DistributedSpec.from_args(args))
    if isinstance(link, distributed.FollowerLink):
        return follow_runtime(engine_args, link)
    with link or contextlib.nullcontext():
        return _generate(args, engine_args, params, link)


def _generate(args: argparse.Namespace, engine_args: EngineArgs, params: SamplingParams,
              leader: distributed.LeaderLink | None) -> int:
    start = time.perf_counter()
    requests: list[Request] = []

    def tokenize_and_check(tokenizer, limits: RequestLimits) -> None:
        text = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}]) if args.chat else args.prompt
        request = Request(REQUEST_ID, tokenizer.encode(text), params)
        try:
            validate_request(request, limits)
        except InvalidRequestError as exc:
            raise ValueError(str(exc).removeprefix(f"request {REQUEST_ID!r}: ")) from None
        requests.append(request)

    runtime = build_runtime(engine_args, progress=True, before_warmup=tokenize_and_check, leader=leader)
    scheduler = Scheduler(runtime.engine, runtime.policy, runtime.tokenizer, SchedulerConfig(overlap=runtime.overlap))
    ready = time.perf_counter()
    handle = scheduler.submit(requests[0])
    scheduler.start()
    try:
        result = None
        for event in handle:
            if not args.json and event.text:
                sys.stdout.write(event.text)
                sys.stdout.flush()
            if event.finished:
                result = event.result
    finally:
        scheduler.stop()
    if result.finish_reason.value == "error":
        print(f"\njaxspec generate: {result.error}", file=sys.stderr)
        return 1
    stats = result.stats()
    trees = {t.nodes: str(t) for t in runtime.engine.menu.tree_envelopes}  # k -> "N:D" where a tree runs
    stats.update(per_step=[{"k": s.k, "proposed": s.proposed, "accepted": s.accepted,
                            **({"tree": trees[s.k]} if s.k in trees else {})} for s in result.steps],
                 tokens_per_step=len(result.token_ids) / max(len(result.steps), 1),
                 tokens_per_s=len(result.token_ids) / max(stats["total_s"] or 0.0, 1e-9),
                 setup_s=ready - start, model=runtime.model_name, proposer=engine_args.proposer,
                 policy=runtime.policy.name, kernels=runtime.engine.kernels.to_json(),
                 finish_reason=result.finish_reason.value)
    log = getattr(runtime.policy, "log", None)
    if log is not None:
        stats["decisions"] = log.to_dicts()
    if args.json:
        print(json.dumps({"text": result.text, "token_ids": list(result.token_ids), "stats": stats}))
    else:
        sys.stdout.write("\n")
        acceptance = "n/a" if stats["acceptance"] is None else f"{stats['acceptance']:.2f}"
        print(f"[{len(result.token_ids)} tokens, {stats['tokens_per_s']:.1f} tok/s, "
              f"acceptance {acceptance}, finish: {result.finish_reason.value}]", file=sys.stderr)
    return 0
