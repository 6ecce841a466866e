"""The package's data files: configs (jaxspec/configs/) and shipped drafts (jaxspec/drafts/).

Found with `importlib.resources`, so a source checkout, an editable install and an installed wheel all read
the same files (they ship as package data: see pyproject.toml). The package must be installed as plain files
(not imported from a zip archive): `jaxspec distill` writes the shipped draft in place and the loaders take paths.

Public API: config_file, draft_arch_file, draft_archs, shipped_drafts_dir, shipped_draft_dir.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path


def _package_dir(name: str) -> Path:
    root = files("jaxspec")
    if not isinstance(root, Path):
        raise RuntimeError(f"jaxspec is imported from {root!r}, not a directory: install it unpacked "
                           "(pip install . or pip install -e .)")
    return root / name


def config_file(name: str) -> Path:
    """jaxspec/configs/<name>, e.g. config_file("engine.yaml"); FileNotFoundError if the package lacks it."""
    path = _package_dir("configs") / name
    if not path.is_file():
        raise FileNotFoundError(f"packaged config {name!r} not found at {path} (is the package data installed?)")
    return path


def draft_archs() -> list[str]:
    """Names of the packaged draft architectures (jaxspec/configs/drafts/*.yaml), sorted."""
    return sorted(p.stem for p in (_package_dir("configs") / "drafts").glob("*.yaml"))


def draft_arch_file(name: str) -> Path:
    """jaxspec/configs/drafts/<name>.yaml; FileNotFoundError naming the known architectures if absent."""
    path = _package_dir("configs") / "drafts" / f"{name}.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"unknown draft architecture {name!r} (known: {', '.join(draft_archs())})")
    return path


def shipped_drafts_dir() -> Path:
    """jaxspec/drafts/: one directory per target name holding draft.json + weights.npz. In an editable
    install this is the repository's jaxspec/drafts/ (where `jaxspec distill` writes by default)."""
    return _package_dir("drafts")


def shipped_draft_dir(target_name: str) -> Path:
    """jaxspec/drafts/<target_name>/ (may not exist: callers check for draft.json)."""
    return shipped_drafts_dir() / target_name
