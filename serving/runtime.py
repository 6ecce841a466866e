"""Shared engine flags and the warmed-up runtime behind `generate`, `batch`, `serve` and `bench`."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from jaxspec import compile_counter
from jaxspec.build import PROPOSERS, build_model, build_proposer, load_engine_config
from jaxspec.engine import Engine, EngineConfig, enable_compilation_cache
from jaxspec.policy.base import Policy


@dataclasses.dataclass(frozen=True)
class Runtime:
    """A warmed-up engine with its tokenizer and speculation policy."""

    engine: Engine
    tokenizer: object | None
    policy: Policy
    model_name: str


def add_engine_arguments(parser: argparse.ArgumentParser, *, default_menu: str = "default") -> None:
    """--model / --proposer / --draft / --policy / --menu, shared by every engine command."""
    parser.add_argument("--model", default=None,
                        help="target model: a name from `jaxspec models`, a .gguf file, or a directory "
                             "(default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--proposer", default="none", choices=PROPOSERS,
                        help="speculation proposer (default: none = plain decoding)")
    parser.add_argument("--draft", default=None,
                        help="draft model for --proposer draft: 'default' (shipped distilled draft), 'self', "
                             "'truncated:N' (first N target layers) or a model spec (default: 'default')")
    parser.add_argument("--ngram", default="1,3", type=_ngram_range, metavar="MIN,MAX",
                        help="n-gram sizes tried by --proposer ngram, longest first (default: 1,3)")
    parser.add_argument("--policy", default=None,
                        help="speculation policy: none | fixed:K | table[:B=K,...] | heuristic | goodput | "
                             "goodput-per-request (default: goodput with a proposer, else none)")
    parser.add_argument("--menu", default=default_menu,
                        help=f"engine shape menu: a name in configs/engine.yaml or a YAML file "
                             f"(default: {default_menu})")


def _ngram_range(text: str) -> tuple[int, int]:
    try:
        low, high = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MIN,MAX (e.g. 1,3), got {text!r}") from None
    if not 1 <= low <= high:
        raise argparse.ArgumentTypeError(f"need 1 <= MIN <= MAX, got {text!r}")
    return low, high


def policy_spec(args: argparse.Namespace) -> str:
    if args.policy is None:
        return "goodput" if args.proposer != "none" else "none"
    if args.proposer == "none" and args.policy != "none":
        raise ValueError(f"policy {args.policy!r} needs a proposer (--proposer draft|ngram)")
    return args.policy


def _menu_for(spec: str, config: EngineConfig) -> EngineConfig:
    """Only compile the k values the policy can pick."""
    name, _, arg = spec.partition(":")
    if name == "none":
        return config.replace(k_menu=(0,))
    if name == "fixed":
        if not arg.isdigit():
            raise ValueError(f"bad policy {spec!r}: expected fixed:K with an integer K >= 0, e.g. fixed:4")
        k = int(arg)
        if k not in config.k_menu:
            raise ValueError(f"fixed:{k} is not in the menu's k values {config.k_menu}")
        return config.replace(k_menu=(k,))
    return config


def build_policy(spec: str, max_len: int, engine: Engine | None = None, progress: bool = True) -> Policy:
    """The policy named by `spec`; goodput policies load (or measure) the engine's cost profile."""
    from jaxspec.policy.registry import load_defaults, make_policy

    name = spec.partition(":")[0]
    if name not in ("goodput", "goodput-per-request"):
        return make_policy(spec, max_len=max_len)
    if engine is None:
        raise ValueError(f"policy {spec!r} needs a warmed-up engine to profile")
    from jaxspec.policy.cost_model import CostModel, load_matching_profile
    from jaxspec.profiler import profile_engine, profile_key

    profile = load_matching_profile(profile_key(engine))
    if profile is None:
        print("no cost profile for this device/model/menu yet: profiling once (saved for next time)",
              file=sys.stderr)
        from jaxspec.policy.cost_model import default_profile_dir
        profile = profile_engine(engine, progress=progress)
        profile.save(default_profile_dir() / profile.key.filename())
    cost = CostModel.from_profile(profile, online=load_defaults().cost_online)
    return make_policy(spec, cost_model=cost, max_len=max_len)


def build_runtime(args: argparse.Namespace, progress: bool = True, before_warmup=None, **menu_overrides) -> Runtime:
    """Load the model, build proposer + menu, compile the menu ahead of time, build the policy.

    `before_warmup(tokenizer, engine_config)` may validate user input (e.g. prompt length)
    before the minutes of compilation start.
    """
    enable_compilation_cache()
    compile_counter.install()
    spec = policy_spec(args)
    config = _menu_for(spec, load_engine_config(args.menu, **menu_overrides))
    early_policy = None
    if spec.partition(":")[0] not in ("goodput", "goodput-per-request"):
        early_policy = build_policy(spec, max_len=config.max_len)  # bad specs fail before loading anything
    built = build_model(args.model)
    if built.tokenizer is None:
        raise ValueError(f"model {built.name!r} has no tokenizer (a weightless preset); "
                         f"text commands need a real model")
    if before_warmup is not None:
        before_warmup(built.tokenizer, config)
    proposer = build_proposer(args.proposer, built.model, args.draft, ngram=getattr(args, "ngram", (1, 3)))
    engine = Engine(built.model, proposer, config)
    engine.warmup(progress=progress)
    policy = early_policy or build_policy(spec, max_len=config.max_len, engine=engine, progress=progress)
    return Runtime(engine, built.tokenizer, policy, built.name)
