"""`jaxspec models`: list presets and where each is found; `jaxspec models convert` for fast loads."""

from __future__ import annotations

import argparse

from jaxspec.models.loading import list_models, load_model, save_converted


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="models_command", metavar="ACTION")
    sub.add_parser("list", help="list known models (the default)")
    convert = sub.add_parser("convert", help="dequantise/convert a model once into an orbax checkpoint")
    convert.add_argument("model", help="a model spec (name, .gguf file or directory)")
    convert.add_argument("output", help="output directory (load it later with --model DIR)")


def run(args: argparse.Namespace) -> int:
    if getattr(args, "models_command", None) == "convert":
        loaded = load_model(args.model)
        save_converted(args.output, loaded.config, loaded.state_dict, tokenizer=loaded.tokenizer,
                       source=str(loaded.source.path))
        print(f"converted {loaded.source.name} -> {args.output}")
        return 0
    entries = list_models()
    width = max(len(e.name) for e in entries)
    for e in entries:
        print(f"{e.name:<{width}}  {e.location}\n{'':<{width}}  {e.description}")
    return 0
