"""The warmed-up runtime behind `generate`, `batch`, `serve` and `bench`: engine, tokenizer and policy
built from `EngineArgs` (jaxspec.engine.args). In a multi-process run (jaxspec.engine.distributed) process 0 builds
it around a `LeaderEngine` and the others build the same engine and `follow_runtime`."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from typing import Any

from jaxspec.engine import compile_counter
from jaxspec.engine.api import EngineAPI
from jaxspec.engine.args import EngineArgs
from jaxspec.engine.build import build_model, build_proposer, load_menu
from jaxspec.engine.distributed import FollowerLink, LeaderEngine, LeaderLink, follow
from jaxspec.engine.engine import Engine, enable_compilation_cache
from jaxspec.menu import Menu
from jaxspec.policy.base import Policy
from jaxspec.policy.spec import PolicySpec
from jaxspec.scheduling.requests import RequestLimits

TokenizerLike = Any  # encode / token_bytes / eos_token_ids / apply_chat_template (TextTokenizer or a toy)


@dataclasses.dataclass(frozen=True)
class Runtime:
    """A warmed-up engine (a `LeaderEngine` on process 0 of a multi-process run) with its tokenizer and
    speculation policy; `overlap`: the scheduler's loop (False: `--no-overlap`, the synchronous loop)."""

    engine: EngineAPI
    tokenizer: TokenizerLike
    policy: Policy
    model_name: str
    overlap: bool = True


def resolve_tokenizer(spec: str, model_tokenizer: TokenizerLike | None, model_name: str) -> TokenizerLike:
    """'model': the model's own tokenizer (an error for presets, which have none); 'ascii' / 'bytes': a toy."""
    from jaxspec.serving.toy_tokenizer import TOY_TOKENIZERS

    if spec == "model":
        if model_tokenizer is None:
            raise ValueError(f"model {model_name!r} has no tokenizer (a preset with random weights): pass "
                             f"--tokenizer ascii (64 ids) or --tokenizer bytes (259 ids)")
        return model_tokenizer
    if spec in TOY_TOKENIZERS:
        return TOY_TOKENIZERS[spec]()
    raise ValueError(f"unknown tokenizer {spec!r}; choose 'model', {', '.join(map(repr, TOY_TOKENIZERS))}")


def build_policy(spec: PolicySpec | str, engine: EngineAPI | None = None, progress: bool = True) -> Policy:
    """The policy named by `spec`; goodput policies load (or measure) the engine's cost profile."""
    from jaxspec.policy.registry import load_defaults, make_policy

    spec = spec if isinstance(spec, PolicySpec) else PolicySpec.parse(spec)
    if not spec.needs_cost_model:
        return make_policy(spec)
    if engine is None:
        raise ValueError(f"policy {str(spec)!r} needs a warmed-up engine to profile")
    from jaxspec.engine.profiler import profile_engine, profile_key
    from jaxspec.policy.cost_model import CostModel, default_profile_dir, load_matching_profile

    profile = load_matching_profile(profile_key(engine))
    if profile is None:
        print("no cost profile for this device/model/menu yet: profiling once (saved for next time)",
              file=sys.stderr)
        profile = profile_engine(engine, progress=progress)
        profile.save(default_profile_dir() / profile.key.filename())
    cost = CostModel.from_profile(profile, online=load_defaults().cost_online)
    return make_policy(spec, cost_model=cost)


InputCheck = Callable[[TokenizerLike, RequestLimits], None]


def assemble_engine(engine_args: EngineArgs, menu: Menu,
                    before_proposer: InputCheck | None = None) -> tuple[Engine, TokenizerLike, str]:
    """(engine, tokenizer, model name) for `engine_args` on `menu`; nothing compiled yet.
    `before_proposer(tokenizer, limits)` runs once the target is loaded, before the draft is."""
    mesh = engine_args.mesh_spec()
    kernels = engine_args.kernel_choice()
    built = build_model(engine_args.model, dtype=engine_args.dtype, mesh=mesh, kernels=kernels)
    tokenizer = resolve_tokenizer(engine_args.tokenizer, built.tokenizer, built.name)
    if before_proposer is not None:
        before_proposer(tokenizer, RequestLimits(max_len=menu.max_len, vocab_size=built.model.config.vocab_size,
                                                 stop_strings_allowed=True))
    proposer = build_proposer(engine_args.proposer, built.model, engine_args.draft, ngram=engine_args.ngram, mesh=mesh,
                              kernels=kernels, suffix=engine_args.suffix_config())
    engine = Engine(built.model, proposer, menu, mesh=mesh, kernels=kernels, logprobs=engine_args.logprobs,
                    prefix_cache=not engine_args.no_prefix_cache)
    print(f"kernels: {engine.kernels.describe()}", file=sys.stderr)
    if engine.prefix_cache_note:
        print(engine.prefix_cache_note, file=sys.stderr)
    if mesh.size > 1:
        print(f"mesh {mesh}: {mesh.size} {engine.mesh.devices.flat[0].platform} devices", file=sys.stderr)
    for note in engine.sharding_notes:  # what was replicated or padded to fit the mesh (jaxspec.models.sharding)
        print(f"mesh {mesh}: {note}", file=sys.stderr)
    return engine, tokenizer, built.name


def build_runtime(engine_args: EngineArgs, progress: bool = True, before_warmup: InputCheck | None = None,
                  leader: LeaderLink | None = None, **menu_overrides) -> Runtime:
    """Load the model, build proposer + menu, compile the menu ahead of time, build the policy.

    `before_warmup(tokenizer, limits)` may validate user input against the engine's request limits
    (jaxspec.scheduling.requests.validate_request) before the draft loads and the minutes of compilation start.
    `leader`: process 0 of a multi-process run; warm-up, profiling and every later engine call are mirrored
    on the other processes (`follow_runtime`).
    """
    enable_compilation_cache()
    compile_counter.install()
    spec = engine_args.policy_spec()
    menu = engine_args.engine_menu(load_menu(engine_args.menu, **menu_overrides))
    early_policy = None
    if not spec.needs_cost_model:
        early_policy = build_policy(spec)  # bad specs fail before loading anything
    local, tokenizer, model_name = assemble_engine(engine_args, menu, before_warmup)
    engine: EngineAPI = local if leader is None else LeaderEngine(local, leader)
    engine.warmup(progress=progress)
    policy = early_policy or build_policy(spec, engine=engine, progress=progress)
    return Runtime(engine, tokenizer, policy, model_name, overlap=not engine_args.no_overlap)


def follow_runtime(engine_args: EngineArgs, link: FollowerLink, **menu_overrides) -> int:
    """A process other than 0 of a multi-process run: build the engine `build_runtime` builds on process 0
    (same flags, same menu), then make every engine call process 0 sends (jaxspec.engine.distributed.follow).
    Returns the exit code."""
    try:
        enable_compilation_cache()
        compile_counter.install()
        menu = engine_args.engine_menu(load_menu(engine_args.menu, **menu_overrides))
        engine, _, _ = assemble_engine(engine_args, menu)
    except Exception as exc:  # noqa: BLE001 - reported to process 0, which then exits too
        link.fail(f"building the engine failed: {type(exc).__name__}: {exc}")
    return follow(engine, link)
