"""`--policy` specs (parsed by `jaxspec.policy.spec.PolicySpec`) -> Policy objects.

    none                  plain decoding (k = 0)
    fixed:K               always k = K (clamped to the menu and the rows' room)
    table                 batch-size table from jaxspec/configs/policy.yaml
    table:1=4,4=2,8=1     batch-size table given inline (live batch ≥ N -> k)
    heuristic             HF-style per-request +2 / −1
    goodput               SmartSpec: argmax_k Σ E_i(k) / T(B, k)      (needs cost_model=)
    goodput-per-request   the same with per-row k_i ≤ K               (needs cost_model=)
    goodput:positional    per-position acceptance rates (goodput:single: one per request; else the default)

Dependencies (keyword arguments of `make_policy`):
    cost_model: CostModel           required by the goodput policies
    acceptance: AcceptanceTracker   optional; else a fresh one from the defaults
    defaults: PolicyDefaults        optional; else `load_defaults()` (jaxspec/configs/policy.yaml)
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import yaml

from jaxspec.policy.acceptance import AcceptanceConfig, AcceptanceTracker
from jaxspec.policy.base import Policy
from jaxspec.policy.cost_model import CostModel, OnlineCostConfig
from jaxspec.policy.fixed import FixedPolicy, NoSpeculation
from jaxspec.policy.goodput import GoodputConfig, GoodputPerRequestPolicy, GoodputPolicy
from jaxspec.policy.heuristic import HeuristicConfig, HeuristicPolicy
from jaxspec.policy.spec import PolicySpec
from jaxspec.policy.table import TablePolicy
from jaxspec.resources import config_file

DEFAULT_CONFIG = config_file("policy.yaml")
_DEPS = frozenset({"cost_model", "acceptance", "defaults"})


@dataclasses.dataclass(frozen=True)
class PolicyDefaults:
    """jaxspec/configs/policy.yaml, typed."""

    table: tuple[tuple[int, int], ...]
    heuristic: HeuristicConfig
    acceptance: AcceptanceConfig
    cost_online: OnlineCostConfig
    goodput: GoodputConfig


def load_defaults(path: str | os.PathLike | None = None) -> PolicyDefaults:
    """Read the policy defaults; every section is required and unknown keys are errors."""
    path = Path(path) if path is not None else DEFAULT_CONFIG
    if not path.exists():
        raise FileNotFoundError(f"policy defaults {path} not found")
    data = yaml.safe_load(path.read_text()) or {}
    sections = {"table", "heuristic", "acceptance", "cost_online", "goodput"}
    if set(data) != sections:
        raise ValueError(f"{path}: expected sections {sorted(sections)}, got {sorted(data)}")
    try:
        return PolicyDefaults(
            table=tuple(sorted((int(n), int(k)) for n, k in data["table"].items())),
            heuristic=HeuristicConfig(**data["heuristic"]),
            acceptance=AcceptanceConfig(**data["acceptance"]),
            cost_online=OnlineCostConfig(**data["cost_online"]),
            goodput=GoodputConfig(**data["goodput"]),
        )
    except TypeError as exc:  # unknown or missing keys
        raise ValueError(f"{path}: {exc}") from None


def make_policy(spec: str | PolicySpec, **deps) -> Policy:
    """Build the policy named by `spec` (text or a PolicySpec; see the module doc). Bad specs raise ValueError."""
    unknown = set(deps) - _DEPS
    if unknown:
        raise TypeError(f"make_policy got unknown dependencies {sorted(unknown)}; known: {sorted(_DEPS)}")
    spec = spec if isinstance(spec, PolicySpec) else PolicySpec.parse(spec)
    defaults: PolicyDefaults = deps["defaults"] if deps.get("defaults") is not None else load_defaults()

    if spec.name == "none":
        return NoSpeculation()
    if spec.name == "fixed":
        return FixedPolicy(spec.k)
    if spec.name == "table":
        return TablePolicy(dict(spec.table or defaults.table), log_size=defaults.goodput.log_size)
    if spec.name == "heuristic":
        return HeuristicPolicy(defaults.heuristic, log_size=defaults.goodput.log_size)
    cost = deps.get("cost_model")  # the goodput policies
    if not isinstance(cost, CostModel):
        raise ValueError(f"policy {spec.name!r} needs cost_model=CostModel (from a `jaxspec profile` "
                         f"profile: CostModel.from_profile(...)), got {type(cost).__name__}")
    acceptance = deps.get("acceptance")
    if acceptance is None:
        acceptance = AcceptanceTracker(defaults.acceptance)
    cls = GoodputPolicy if spec.name == "goodput" else GoodputPerRequestPolicy
    config = defaults.goodput if spec.positional is None else dataclasses.replace(defaults.goodput,
                                                                                 positional=spec.positional)
    return cls(cost, acceptance, config)
