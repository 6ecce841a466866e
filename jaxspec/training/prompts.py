"""The training prompts of `jaxspec distill` (both kinds) and the flags that choose them."""

from __future__ import annotations

import argparse

import numpy as np

from jaxspec.models.loading.registry import load_model
from jaxspec.training import distill_data as dd
from jaxspec.training.trainer import ARTIFACTS


def training_prompts(tokenizer, args: argparse.Namespace) -> list[list[int]]:
    """The training prompts of `jaxspec distill` (both kinds), shuffled by --seed: --prompts of them, at most
    --prompt-len tokens each, from --prompts-file, else train-split ShareGPT user turns (--all-turns, --sharegpt-mb)
    and --code-prompts HumanEval stubs. Fewer than asked when the sources run out (printed)."""
    if args.prompts_file is not None:
        try:
            prompts = dd.load_prompt_ids(args.prompts_file, tokenizer.vocab_size)
        except (OSError, KeyError, ValueError) as exc:
            raise SystemExit(f"--prompts-file {args.prompts_file}: {exc}") from None
        longest = max(map(len, prompts), default=0)
        if longest > args.prompt_len:
            raise SystemExit(f"{args.prompts_file} holds a prompt of {longest} tokens > --prompt-len {args.prompt_len}")
        prompts = prompts[:args.prompts]
    else:
        n_code = min(args.code_prompts, args.prompts)
        prompts = dd.chat_prompts(tokenizer, "train", args.prompts - n_code, args.prompt_len,
                                  all_turns=args.all_turns, max_bytes=args.sharegpt_mb << 20)
        prompts += dd.code_prompts(tokenizer, n_code, args.prompt_len)
    if len(prompts) < args.prompts:
        more = [] if args.prompts_file is not None else [
            *(["raise --sharegpt-mb (at most 125)"] if args.sharegpt_mb < 125 else []), "raise --prompt-len",
            *(["use --all-turns"] if not args.all_turns else [])]
        print(f"{len(prompts)} training prompts of the {args.prompts} asked for: the sources ran out"
              + (f" ({', '.join(more)})" if more else ""))
    rng = np.random.default_rng(args.seed)
    return [prompts[i] for i in rng.permutation(len(prompts))]


def prompt_flags(args: argparse.Namespace) -> str:
    """The recipe's flags that choose the training prompts (for the command recorded with a draft)."""
    flags = f" --prompt-len {args.prompt_len} --rows {args.rows}"
    if args.prompts_file is not None:
        return flags + f" --prompts-file {args.prompts_file}"
    return flags + (" --all-turns" if args.all_turns else "") + (
        f" --sharegpt-mb {args.sharegpt_mb}" if args.sharegpt_mb != 32 else "")


def save_training_prompts(args: argparse.Namespace) -> int:
    """--save-prompts: the training prompts as token ids in a file, then exit (nothing generated or trained)."""
    tokenizer = load_model(args.model, cache_dir=ARTIFACTS / "model_cache").tokenizer
    prompts = training_prompts(tokenizer, args)
    dd.save_prompt_ids(args.save_prompts, prompts, tokenizer.vocab_size)
    print(f"wrote {len(prompts)} prompts ({sum(map(len, prompts))} tokens) to {args.save_prompts}")
    return 0
