"""The engine flags of every engine command (generate, batch, serve, profile, bench), declared once.

Here (not in jaxspec/serving/) because `jaxspec profile` takes them too. The serving runtime
(jaxspec.serving.runtime.build_runtime) builds an engine from an `EngineArgs`.

Each field of `EngineArgs` carries its default and help text; `EngineArgs.add_arguments` turns the
fields a command takes into argparse flags and `EngineArgs.from_namespace` reads them back.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

from jaxspec.dtypes import DTYPES
from jaxspec.engine.build import PROPOSERS
from jaxspec.mesh import MeshSpec
from jaxspec.models.kernel_plan import KERNELS_ENV, KernelChoice, kernel_choice
from jaxspec.policy.spec import HELP as POLICY_HELP
from jaxspec.policy.spec import PolicySpec
from jaxspec.speculation.suffix_tree import SCOPES, SuffixConfig
from jaxspec.types import MAX_LOGPROBS

TOKENIZERS = ("model", "ascii", "bytes")  # the model's own, or a toy one (jaxspec.serving.toy_tokenizer.TOY_TOKENIZERS)


def _ngram_range(text: str) -> tuple[int, int]:
    try:
        low, high = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MIN,MAX (e.g. 1,3), got {text!r}") from None
    if not 1 <= low <= high:
        raise argparse.ArgumentTypeError(f"need 1 <= MIN <= MAX, got {text!r}")
    return low, high


def _flag(default: Any, help_text: str, *, shown: str | None = None, **argparse_kwargs) -> Any:
    """A field with its flag's help text; `shown` describes the default where its value does not."""
    return dataclasses.field(default=default, metadata={"help": help_text, "shown": shown, "argparse": argparse_kwargs})


@dataclasses.dataclass(frozen=True)
class EngineArgs:
    """Which engine to build: target model, proposer, policy, shape menu, tokenizer and dtype."""

    model: str | None = _flag(None, "target model: a name from `jaxspec models`, a .gguf file, or a directory",
                              shown="the embedded SmolLM2-135M-Instruct")
    proposer: str = _flag("none", "speculation proposer", shown="none = plain decoding", choices=PROPOSERS)
    draft: str | None = _flag(None, "draft model for --proposer draft: 'default' (shipped distilled draft), 'feature' "
                              "(shipped EAGLE-style feature draft, reads the target's hidden states), 'feature:DIR', "
                              "'self', 'truncated:N' (first N target layers) or a model spec", shown="default")
    ngram: tuple[int, int] = _flag((1, 3), "n-gram sizes tried by --proposer ngram, longest first", shown="1,3",
                                   type=_ngram_range, metavar="MIN,MAX")
    suffix_scope: str = _flag("global", "whose outputs --proposer suffix proposes from: 'global' (every recent "
                              "request's), 'tenant' (the same tenant's) or 'off' (the request's own prompt and output)",
                              shown="global", metavar="|".join(SCOPES))
    suffix_requests: int = _flag(SuffixConfig.max_requests, "finished requests whose outputs --proposer suffix keeps "
                                 f"(and at most {SuffixConfig.max_tokens} of their tokens; the oldest go first)",
                                 shown=str(SuffixConfig.max_requests), type=int, metavar="N")
    suffix_ahead: bool = _flag(False, "in the overlapped loop, propose for a row whose step is in flight as if that "
                               "step accepts its proposals (the default reads each step first: on this project's CPU "
                               "bench the guesses cost more acceptance than the overlap saved; docs/design.md, 'The "
                               "overlapped loop')", shown="read first", action="store_true")
    policy: str | None = _flag(None, f"speculation policy: {POLICY_HELP}",
                               shown="goodput with a proposer, else none")
    menu: str = _flag("default", "engine shape menu: a name in jaxspec/configs/engine.yaml or a YAML file",
                      shown="default")
    tokenizer: str = _flag("model", "'model' (the model's own), or a toy tokenizer for random-weight presets such as "
                           "--model tiny: 'ascii' (64 ids) or 'bytes' (259 ids)", choices=TOKENIZERS)
    # no argparse choices: a bad value is one line and exit 2 (ValueError in __post_init__), not a usage dump
    dtype: str = _flag("auto", "dtype of weights and KV cache: 'auto' (float32 on CPU, bfloat16 on GPU/TPU), "
                       "'float32' or 'bfloat16'; softmax, norms, logits, sampling and verify stay float32",
                       metavar="|".join(DTYPES))
    tree: str | None = _flag(None, "token-tree envelope N[:D] (--proposer ngram or draft): the step at k = N "
                             "verifies a tree of N proposals at most D deep (default D = ceil(N/2)) in place of "
                             "the chain of N; goodput picks it when it pays, --policy fixed:N every step",
                             shown="none: chains only", metavar="N[:D]")
    mesh: str | None = _flag(None, "device mesh: 'data=D,model=M' (KV cache slots over D devices, tensor parallel over "
                             "M); overrides the engine config's mesh", shown="the engine config's, else data=1,model=1",
                             metavar="data=D,model=M")
    kernels: str | None = _flag(None, "kernel plan: 'auto' (the kernels this backend, dtype, mesh and model allow: "
                                "XLA:CPU's cache attention and panel matmuls, Pallas attention on GPU) or 'xla' (the "
                                "XLA form everywhere); docs/design.md, 'The kernel plan'",
                                shown=f"${KERNELS_ENV}, else auto", metavar="auto|xla")
    no_overlap: bool = _flag(False, "run the synchronous decode loop: read each step's tokens before dispatching the "
                             "next (the default overlaps them: docs/design.md, 'The overlapped loop'); for comparison",
                             shown="overlapped", action="store_true")
    num_pages: int | None = _flag(
        None, "pages of the target's paged KV cache (the cache's memory; requests are admitted while their "
        "prompts' pages are free, and the youngest is preempted when a step finds none): docs/design.md, "
        "'Paged KV cache'", shown="the engine config's num_pages, else what num_slots + 1 slots of max_len take",
        type=int, metavar="N")
    no_prefix_cache: bool = _flag(False, "do not share the KV pages of prompt prefixes between requests (each "
                                  "prompt is computed whole): docs/design.md, 'Prefix caching'",
                                  shown="shared", action="store_true")
    logprobs: int = _flag(0, "N in 1..20: every step also returns the emitted tokens' log-probabilities under the "
                          "target and their top N alternatives, so requests may ask for logprobs (up to N "
                          "top_logprobs); 0 = off (the default step computes none)", type=int, metavar="N")

    SERVE_ONLY = ("logprobs",)  # flags only `jaxspec serve` takes (only= names them; the default set leaves them out)

    def __post_init__(self):
        if self.proposer not in PROPOSERS:
            raise ValueError(f"unknown proposer {self.proposer!r}; choose one of {', '.join(PROPOSERS)}")
        if self.tokenizer not in TOKENIZERS:
            raise ValueError(f"unknown tokenizer {self.tokenizer!r}; choose one of {', '.join(TOKENIZERS)}")
        if not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; choose one of {', '.join(DTYPES)}")
        low, high = self.ngram
        if not 1 <= low <= high:
            raise ValueError(f"ngram needs 1 <= MIN <= MAX, got {self.ngram}")
        self.policy_spec()  # a bad or proposer-less policy fails here, before anything loads
        self.suffix_config()  # a bad suffix scope or bound fails here too
        if self.mesh is not None:
            MeshSpec.parse(self.mesh)  # a bad mesh fails here too
        self.kernel_choice()  # a bad --kernels (or $JAXSPEC_KERNELS) fails here too
        if self.num_pages is not None and self.num_pages < 2:
            raise ValueError(f"--num-pages must be >= 2 (page 0 is scratch), got {self.num_pages}")
        if self.tree is not None:
            self.tree_envelope()  # a bad envelope fails here too
            if self.proposer not in ("ngram", "draft", "suffix"):
                raise ValueError(f"--tree needs --proposer ngram, draft or suffix (a {self.proposer!r} proposer has "
                                 f"no tree)")
            if self.proposer == "draft" and (self.draft or "").startswith("feature"):
                raise ValueError("--tree with the feature draft is not implemented (it drafts chains only): use the "
                                 "token draft (--draft default or a DIR) or --proposer ngram")
            if self.policy_spec().name == "goodput-per-request":
                raise ValueError("--tree with --policy goodput-per-request is not implemented (its per-row k "
                                 "prices chains only): use --policy goodput, fixed:N, heuristic or table")

    def suffix_config(self) -> SuffixConfig:
        """--proposer suffix's index settings (jaxspec.speculation.suffix_tree.SuffixConfig)."""
        return SuffixConfig(scope=self.suffix_scope, max_requests=self.suffix_requests, ahead=self.suffix_ahead)

    def tree_envelope(self):
        """The parsed --tree (a jaxspec.menu.TreeEnvelope), or None."""
        from jaxspec.menu import TreeEnvelope

        return None if self.tree is None else TreeEnvelope.parse(self.tree)

    def engine_menu(self, menu):
        """`menu` with --num-pages and the --tree envelope in it (if any), then only the k values the policy can
        pick."""
        tree = self.tree_envelope()
        menu = menu if tree is None else menu.with_tree(tree)
        menu = menu if self.num_pages is None else menu.replace(num_pages=self.num_pages)
        return menu.with_k_menu(self.policy_spec().k_values(menu.k_menu))

    def kernel_choice(self) -> KernelChoice:
        """--kernels, else $JAXSPEC_KERNELS, else 'auto'."""
        return kernel_choice(self.kernels)

    def mesh_spec(self) -> MeshSpec:
        """--mesh, else the engine config's `mesh:`, else data=1,model=1."""
        from jaxspec.engine.build import load_mesh  # lazy: imports jax and the models

        return MeshSpec.parse(self.mesh) if self.mesh is not None else load_mesh(self.menu)

    def policy_spec(self) -> PolicySpec:
        """The parsed --policy (default: goodput with a proposer, else none); ValueError when it needs
        a proposer and there is none."""
        spec = PolicySpec.default_for(self.proposer) if self.policy is None else PolicySpec.parse(self.policy)
        if spec.needs_proposer and self.proposer == "none":
            raise ValueError(f"policy {str(spec)!r} needs a proposer (--proposer draft|ngram)")
        return spec

    # --- argparse ----------------------------------------------------------------------------

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser, *, default_menu: str = "default",
                      only: Iterable[str] | None = None, defaults: Mapping[str, Any] | None = None,
                      overrides: bool = False) -> None:
        """Add a --flag per field (`only`: these fields; default all). `defaults` replace a field's
        default for this command. overrides=True: every flag defaults to None (it overrides a config
        file, whose values win over the defaults named in the help)."""
        fields = cls._fields(only)
        changed = {"menu": default_menu, **(defaults or {})}
        for f in fields:
            default = changed.get(f.name, f.default)
            shown = f.metadata["shown"] if f.name not in changed or default is None else None
            shown = shown or (",".join(map(str, default)) if isinstance(default, tuple) else default)
            parser.add_argument("--" + f.name.replace("_", "-"), dest=f.name, default=None if overrides else default,
                                help=f"{f.metadata['help']} (default: {shown})", **f.metadata["argparse"])

    @classmethod
    def from_namespace(cls, args: argparse.Namespace, **changes) -> EngineArgs:
        """The fields `args` has (the others, and None for a field whose default is not None, keep
        their defaults), then `changes`."""
        values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
                  if getattr(args, f.name, None) is not None or (hasattr(args, f.name) and f.default is None)}
        return cls(**{**values, **changes})

    @classmethod
    def given(cls, args: argparse.Namespace, only: Iterable[str] | None = None) -> dict[str, Any]:
        """The fields of `args` set on the command line (flags added with overrides=True)."""
        return {f.name: getattr(args, f.name) for f in cls._fields(only) if getattr(args, f.name, None) is not None}

    @classmethod
    def _fields(cls, only: Iterable[str] | None) -> list[dataclasses.Field]:
        fields = {f.name: f for f in dataclasses.fields(cls)}
        if only is None:
            return [f for name, f in fields.items() if name not in cls.SERVE_ONLY]
        unknown = [name for name in only if name not in fields]
        if unknown:
            raise ValueError(f"EngineArgs has no fields {unknown}; known: {', '.join(fields)}")
        return [fields[name] for name in only]


__all__ = ["EngineArgs", "TOKENIZERS"]
