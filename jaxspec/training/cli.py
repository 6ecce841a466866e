"""`jaxspec distill`: train a draft (`--kind token`, jaxspec.training.distill) or a feature draft (`--kind feature`,
jaxspec.training.feature_distill) for a target; `--save-prompts` writes the training prompts and exits."""

from __future__ import annotations

import argparse
from pathlib import Path

from jaxspec.engine.draft_artifacts import DEFAULT_ARCH
from jaxspec.resources import draft_archs
from jaxspec.training import distill, feature_distill
from jaxspec.training.prompts import save_training_prompts


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kind", choices=("token", "feature"), default="token",
                        help="token: a small LM draft (--arch); feature: an EAGLE-style draft reading the target's "
                             "features (jaxspec/training/feature_distill.py, "
                             "written to jaxspec/drafts/<target>/feature)")
    parser.add_argument("--model", default=None, help="target model spec (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--arch", default=DEFAULT_ARCH,
                        help=f"draft architecture: a YAML path or one of {', '.join(draft_archs())}")
    parser.add_argument("--out", default=None,
                        help="output directory (default: the shipped draft, jaxspec/drafts/<target name> inside the "
                             "installed package; in an editable install that is the repository's jaxspec/drafts/)")
    parser.add_argument("--work", default=None,
                        help="work dir for shards/checkpoints (default: artifacts/distill/<arch> here)")
    parser.add_argument("--data", default=None, help="shard directory to reuse (default: <work>/../data)")
    parser.add_argument("--prompts", type=int, default=640, help="training prompts (ShareGPT + HumanEval)")
    parser.add_argument("--code-prompts", type=int, default=32, help="of which HumanEval stubs")
    parser.add_argument("--all-turns", action="store_true",
                        help="a prompt from every user turn of a ShareGPT conversation, after the turns before it "
                             "(default: first turns only)")
    parser.add_argument("--sharegpt-mb", type=int, default=32,
                        help="MB of the 125 MB ShareGPT file read for training prompts (more: more prompts)")
    parser.add_argument("--save-prompts", type=Path, default=None, metavar="FILE.npz",
                        help="write the training prompts (token ids) to FILE.npz and exit, for a machine without "
                             "the data packages (an accelerator): --prompts-file reads them there")
    parser.add_argument("--prompts-file", type=Path, default=None, metavar="FILE.npz",
                        help="the training prompts from a --save-prompts file instead of ShareGPT and HumanEval")
    parser.add_argument("--rows", type=int, default=16, help="target generation batch")
    parser.add_argument("--prompt-len", type=int, default=112)
    parser.add_argument("--gen-len", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=32, help="target log-probs kept per position")
    parser.add_argument("--data-minutes", type=float, default=10.0, help="budget for target generation")
    parser.add_argument("--tf-minutes", type=float, default=3.0,
                        help="budget for teacher-forced target labels on ShareGPT answers (0: none)")
    parser.add_argument("--tf-sequences", type=int, default=600)
    parser.add_argument("--vocab-keep", type=int, default=None, help="override the arch's pruned vocabulary")
    parser.add_argument("--steps", type=int, default=450)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1.5e-3)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--ckpt-every", type=int, default=25)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--feature-layers", type=int, default=1, help="--kind feature: decoder layers of the draft")
    parser.add_argument("--feature-fuse", default=None, metavar="L1,L2,..", type=_layer_list,
                        help="--kind feature: fuse the target's hidden states after these layers (EAGLE-3, e.g. "
                             "2,15,30; the last must be the target's last layer; default: its last layer only)")
    parser.add_argument("--ttt-passes", type=int, default=3,
                        help="--kind feature: training-time-test passes (the proposal depths trained)")
    parser.add_argument("--reg-weight", type=float, default=1.0,
                        help="--kind feature: weight of the feature regression next to the KL")
    parser.add_argument("--no-progress", action="store_true")


def _layer_list(text: str) -> tuple[int, ...]:
    """'2,15,30' -> (2, 15, 30) for --feature-fuse (an argparse type: a bad list is a usage error)."""
    try:
        layers = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer numbers, got {text!r}") from None
    if list(layers) != sorted(set(layers)) or layers[0] < 1:
        raise argparse.ArgumentTypeError(f"layers must be distinct, ascending and >= 1, got {text!r}")
    return layers


def run(args: argparse.Namespace) -> int:
    if args.save_prompts is not None:
        return save_training_prompts(args)
    if args.kind == "feature":
        return feature_distill.run(args)
    return distill.run(args)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="jaxspec distill", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
