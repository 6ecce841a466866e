"""The device mesh an engine runs on (docs/design.md, "Sharding"): `--mesh data=D,model=M` or `mesh:` in the
engine config.

`data` splits the KV cache slots, `model` is tensor parallelism (`jaxspec.models.sharding`). D × M devices are
taken from `jax.devices()` (all processes' devices under multi-process JAX, `jaxspec.engine.distributed`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # jax is imported where a mesh is made: MeshSpec is a plain value (the fake engine has one)
    from jax.sharding import Mesh

DATA, MODEL = "data", "model"  # the axis names jaxspec.models.sharding splits arrays over


@dataclasses.dataclass(frozen=True)
class MeshSpec:
    """Mesh axis sizes: `data` (cache slots) × `model` (tensor parallel)."""

    data: int = 1
    model: int = 1

    def __post_init__(self):
        for axis in (DATA, MODEL):
            value = getattr(self, axis)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"mesh axis {axis} must be a positive integer, got {value!r}")

    @property
    def size(self) -> int:
        return self.data * self.model

    def __str__(self) -> str:
        return f"data={self.data},model={self.model}"

    @classmethod
    def parse(cls, text: str) -> MeshSpec:
        """'data=D,model=M' (either may be left out: it is 1)."""
        values: dict[str, int] = {}
        for part in (p.strip() for p in text.split(",") if p.strip()):
            axis, sep, number = part.partition("=")
            axis = axis.strip()
            if not sep or axis not in (DATA, MODEL) or axis in values:
                raise ValueError(f"bad mesh {text!r}: expected data=D,model=M (e.g. data=1,model=2)")
            try:
                values[axis] = int(number)
            except ValueError:
                raise ValueError(f"bad mesh {text!r}: {axis} must be an integer, got {number.strip()!r}") from None
        return cls(**values)

    @classmethod
    def from_mapping(cls, values: Mapping[str, int], source: str) -> MeshSpec:
        """`mesh: {data: D, model: M}` from a config file."""
        unknown = set(values) - {DATA, MODEL}
        if unknown:
            raise ValueError(f"{source}: mesh has unknown axes {sorted(unknown)}; known: {DATA}, {MODEL}")
        return cls(**{k: int(v) for k, v in values.items()})


def make_mesh(spec: MeshSpec) -> Mesh:
    """A jax Mesh (axes data, model) over the first D × M devices; a clear error when there are fewer."""
    import jax
    from jax.sharding import AxisType

    from jaxspec.models import sharding

    assert (sharding.DATA, sharding.MODEL) == (DATA, MODEL)
    devices = jax.devices()
    if spec.size > len(devices):
        hint = (" (on CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N gives N host devices)"
                if jax.default_backend() == "cpu" else "")
        raise ValueError(f"mesh {spec} needs {spec.size} devices, but {len(devices)} {jax.default_backend()} "
                         f"device(s) are visible{hint}")
    return jax.make_mesh((spec.data, spec.model), (DATA, MODEL), axis_types=(AxisType.Auto, AxisType.Auto),
                         devices=devices[: spec.size])


__all__ = ["MeshSpec", "make_mesh"]
