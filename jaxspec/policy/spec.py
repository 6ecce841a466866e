"""`--policy` text, parsed once: which policy, its argument, and what it needs from the engine.

    none                  plain decoding; compiles k = 0 only
    fixed:K               always k = K; compiles k = K only (K must be in the menu)
    table | table:N=K,..  batch-size table (defaults from jaxspec/configs/policy.yaml, or inline)
    heuristic             HF-style per-request +2 / -1
    goodput               SmartSpec over a device cost model
    goodput-per-request   the same with per-row k
    goodput:positional    either goodput policy with per-position acceptance rates (goodput:single: one rate
                          per request); without the suffix, as jaxspec/configs/policy.yaml says

Every policy but `none` needs a proposer; the goodput ones need a cost model (a profiled engine).
`jaxspec.policy.registry.make_policy` builds the Policy a spec names.
"""

from __future__ import annotations

import dataclasses

from jaxspec.policy.table import parse_table

NAMES = ("none", "fixed", "table", "heuristic", "goodput", "goodput-per-request")
GOODPUT = ("goodput", "goodput-per-request")
RATES = ("positional", "single")  # the goodput policies' acceptance rates: per position, or one per request
FORMS = ("none", "fixed:K", "table", "table:N=K,...", "heuristic", "goodput[:positional|:single]",
         "goodput-per-request[:positional|:single]")
HELP = "none | fixed:K | table[:N=K,...] | heuristic | goodput[:positional|:single] | goodput-per-request[:...]"


@dataclasses.dataclass(frozen=True)
class PolicySpec:
    """A parsed policy spec. name: one of NAMES; arg: the text after ':' ('' when none);
    k: fixed:K's K; table: table:N=K,...'s entries as sorted (N, K) pairs (None: the defaults);
    positional: a goodput policy's per-position rates (True), one rate per request (False), or the default (None)."""

    name: str
    arg: str = ""
    k: int | None = None
    table: tuple[tuple[int, int], ...] | None = None
    positional: bool | None = None

    @classmethod
    def parse(cls, text: str) -> PolicySpec:
        """'fixed:4' -> PolicySpec('fixed', '4', k=4); ValueError naming the accepted forms otherwise."""
        if not isinstance(text, str):
            raise ValueError(f"a policy spec is text, got {type(text).__name__}")
        spec = text.strip()
        name, sep, arg = spec.partition(":")
        if name not in NAMES:
            raise ValueError(f"unknown policy {spec!r}; expected one of: {', '.join(FORMS)}")
        if name == "fixed":
            if not arg.isdigit():
                raise ValueError(f"bad policy {spec!r}: expected fixed:K with an integer K >= 0, e.g. fixed:4")
            return cls(name, arg, k=int(arg))
        if name == "table" and sep:
            return cls(name, arg, table=tuple(sorted(parse_table(arg).items())))
        if name in GOODPUT and sep:
            if arg not in RATES:
                raise ValueError(f"bad policy {spec!r}: expected {name}:positional or {name}:single")
            return cls(name, arg, positional=arg == "positional")
        if sep:
            raise ValueError(f"bad policy {spec!r}: {name!r} takes no argument; expected one of: {', '.join(FORMS)}")
        return cls(name)

    @classmethod
    def default_for(cls, proposer: str) -> PolicySpec:
        """goodput with a proposer, none without ('none')."""
        return cls("goodput") if proposer != "none" else cls("none")

    @property
    def needs_cost_model(self) -> bool:
        """The goodput policies predict from a device cost profile (a warmed-up, profiled engine)."""
        return self.name in GOODPUT

    @property
    def needs_proposer(self) -> bool:
        """Every policy but `none` speculates."""
        return self.name != "none"

    def k_values(self, menu_k: tuple[int, ...]) -> tuple[int, ...]:
        """The k values to compile out of the menu's `menu_k`: (0,) for none, (K,) for fixed:K
        (ValueError if the menu lacks K), the whole menu for the others."""
        if self.name == "none":
            return (0,)
        if self.name == "fixed":
            if self.k not in menu_k:
                raise ValueError(f"fixed:{self.k} is not in the menu's k values {tuple(menu_k)}")
            return (self.k,)
        return tuple(menu_k)

    def __str__(self) -> str:
        return f"{self.name}:{self.arg}" if self.arg else self.name


__all__ = ["FORMS", "GOODPUT", "HELP", "NAMES", "RATES", "PolicySpec"]
