"""Converted weights saved with orbax, so a model loads without re-reading or re-dequantising its source.

Layout of a converted directory:
    jaxspec_model.json   format marker, ModelConfig, where the weights came from (written last)
    params/              orbax PyTree checkpoint of the HF-named float32 state dict
    tokenizer.json, tokenizer_config.json   when a tokenizer was saved with it
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import orbax.checkpoint as ocp

from jaxspec.models.config import ModelConfig
from jaxspec.models.loading.errors import ModelLoadError
from jaxspec.models.loading.layout import (
    StateDict,
    check_state_dict,
    config_from_json,
    config_to_json,
    expected_shapes,
    read_json_object,
)

MARKER_FILE = "jaxspec_model.json"
PARAMS_DIR = "params"
FORMAT = "jaxspec-converted"
VERSION = 1


def is_converted_dir(directory: str | os.PathLike[str]) -> bool:
    return (Path(directory) / MARKER_FILE).is_file()


def save_converted(
    directory: str | os.PathLike[str],
    config: ModelConfig,
    state_dict: Mapping[str, np.ndarray],
    *,
    tokenizer: Any = None,
    source: str | None = None,
) -> None:
    """Save `state_dict` (checked against `config`) and `config`; replaces an earlier save there."""
    check_state_dict(config, state_dict, "state dict to save")
    d = Path(directory).absolute()
    d.mkdir(parents=True, exist_ok=True)
    (d / MARKER_FILE).unlink(missing_ok=True)  # a save cut short leaves no marker behind
    with ocp.PyTreeCheckpointer() as checkpointer:
        checkpointer.save(d / PARAMS_DIR, {k: np.asarray(v) for k, v in state_dict.items()}, force=True)
    if tokenizer is not None:
        tokenizer.save(d)
    marker = {"format": FORMAT, "version": VERSION, "config": config_to_json(config), "source": source}
    (d / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")


def read_converted_info(directory: str | os.PathLike[str]) -> tuple[ModelConfig, str | None]:
    """(config, source) of a converted directory, without loading weights."""
    d = Path(directory)
    marker = read_json_object(d / MARKER_FILE)
    if marker.get("format") != FORMAT or marker.get("version") != VERSION:
        raise ModelLoadError(
            f"{d / MARKER_FILE}: format {marker.get('format')!r} v{marker.get('version')}, "
            f"expected {FORMAT!r} v{VERSION}"
        )
    return config_from_json(marker.get("config") or {}, str(d / MARKER_FILE)), marker.get("source")


def load_converted(directory: str | os.PathLike[str]) -> tuple[ModelConfig, StateDict]:
    """Config and float32 numpy weights saved by `save_converted`."""
    d = Path(directory).absolute()
    if not d.is_dir():
        raise ModelLoadError(f"{d}: no such directory" if not d.exists() else f"{d}: not a directory")
    config, _ = read_converted_info(d)
    restore_args = {name: ocp.RestoreArgs(restore_type=np.ndarray) for name in expected_shapes(config)}
    try:
        with ocp.PyTreeCheckpointer() as checkpointer:
            restored = checkpointer.restore(d / PARAMS_DIR, restore_args=restore_args)
    except Exception as e:  # orbax raises assorted errors (FileNotFoundError, ValueError, tensorstore's) on damage
        raise ModelLoadError(f"{d / PARAMS_DIR}: cannot restore orbax checkpoint ({type(e).__name__}: {e})") from e
    state = {name: np.asarray(value) for name, value in restored.items()}
    check_state_dict(config, state, str(d))
    return config, state
