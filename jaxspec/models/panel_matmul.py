"""Serving matmuls on XLA:CPU with weights stored in column panels: an XLA FFI custom call
(jaxspec/models/csrc/panel_matmul.cc; docs/design.md, "Matmuls on XLA:CPU").

XLA:CPU's dot costs about twice a one-row product for 2…16 rows (the library repacks the weight on every
call), and that factor is what a verify step of k + 1 tokens pays on top of a plain step. A `PanelWeight`
holds a [K, N] weight as panels [Q, K, 64] (each 64 columns, contiguous, Q = ceil(N / 64)); `panel_matmul`
reads each panel once per call for all rows, so 9 rows cost about 1.2× one row, and each output is summed in
the same order whatever the number of rows (a verify step's logits are bitwise the plain step's for the same
context).

Serving weights are packed where they are placed (`jaxspec.models.sharding.Placement(panels=True)`) when the
kernel plan says so (XLA:CPU, float32, one device: jaxspec.models.kernel_plan); the layers then call `dense`, which
takes either form. The LM head of a tied embedding needs no packing: `table_matmul` multiplies by the embedding
[V, D] as it lies, 64 rows at a time (`jaxspec.models.llama.Llama.unembed` with the plan's `cpu-table` head).

The kernels are optional (built by setup.py where a C++17 compiler works): `kernel_available()` says whether this
install has them and `kernel_unavailable_reason()` why not; without them the weights keep XLA's layout.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.models import cpu_kernels

try:
    from jaxspec.models import _panel_matmul  # built by setup.py from jaxspec/models/csrc/panel_matmul.cc
except ImportError as error:
    _panel_matmul = None
    cpu_kernels.record_missing("_panel_matmul", error)

TARGET = "jaxspec_panel_matmul"
TABLE_TARGET = "jaxspec_table_matmul"
if _panel_matmul is not None:
    jax.ffi.register_ffi_target(TARGET, _panel_matmul.handler(), platform="cpu")
    jax.ffi.register_ffi_target(TABLE_TARGET, _panel_matmul.table_handler(), platform="cpu")

PANEL = 64  # columns per panel
# the fused serving weights stored as panels, and how many leading dims of each are contracted
# (jaxspec.models.llama.fuse_layer: wqkv [D, P, E/P], wo [N, H, D], w_gate_up [D, P, 2F/P], w_down [F, D])
CONTRACTED_DIMS = {"wqkv": 1, "wo": 2, "w_gate_up": 1, "w_down": 1}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PanelWeight:
    """A weight of logical `shape` (K flattened contraction dims first, then the output dims) stored as
    panels [Q, K, 64]: panels[q, k, c] = weight[k, 64q + c] with the output dims flattened, zero past N."""

    panels: jax.Array
    shape: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))

    @property
    def k_len(self) -> int:
        return self.shape[0]

    @property
    def n_len(self) -> int:
        return math.prod(self.shape[1:])

    @property
    def dtype(self):
        return self.panels.dtype


def kernel_available() -> bool:
    """Whether this install has the compiled panel and table kernels (setup.py builds them where a C++17 compiler
    works)."""
    return _panel_matmul is not None


def kernel_unavailable_reason() -> str | None:
    """Why the compiled kernels are not available, or None if they are."""
    return cpu_kernels.unavailable_reason("_panel_matmul")


def _require_kernels(name: str) -> None:
    if not kernel_available():
        raise RuntimeError(f"{name}: {kernel_unavailable_reason()}; {cpu_kernels.HOW_TO_GET_THEM}")


def pack_panels(weight: np.ndarray | jax.Array, contracted_dims: int = 1) -> tuple[np.ndarray, tuple[int, ...]]:
    """A weight [*contracted, *out] as host panels [Q, K, 64] (K = prod(contracted), N = prod(out)) and its
    logical shape (K, *out)."""
    host = np.asarray(weight)
    k_len = math.prod(host.shape[:contracted_dims])
    out_dims = tuple(host.shape[contracted_dims:])
    n_len = math.prod(out_dims)
    q_panels = -(-n_len // PANEL)
    flat = host.reshape(k_len, n_len)  # [K, N]
    padded = np.zeros((k_len, q_panels * PANEL), host.dtype)  # [K, 64Q]
    padded[:, :n_len] = flat
    panels = np.ascontiguousarray(padded.reshape(k_len, q_panels, PANEL).transpose(1, 0, 2))  # [Q, K, 64]
    return panels, (k_len, *out_dims)


def unpack_panels(weight: PanelWeight) -> jax.Array:
    """The logical weight [K, *out] of a PanelWeight (a copy: for references and tests)."""
    q_panels = weight.panels.shape[0]
    flat = jnp.transpose(weight.panels, (1, 0, 2)).reshape(weight.k_len, q_panels * PANEL)  # [K, 64Q]
    return flat[:, :weight.n_len].reshape(weight.shape)  # [K, *out]


def panel_matmul(x: jax.Array, weight: PanelWeight) -> jax.Array:
    """x [..., K] @ weight -> [..., *out] (float32 in and out)."""
    _require_kernels("panel_matmul")
    if x.shape[-1] != weight.k_len:
        raise ValueError(f"panel_matmul: x has {x.shape[-1]} columns, the weight {weight.k_len} rows")
    lead = x.shape[:-1]
    rows = x.reshape(-1, weight.k_len)  # [M, K]
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((rows.shape[0], weight.n_len), jnp.float32))
    y = call(rows.astype(jnp.float32), weight.panels)  # [M, N]
    return y.reshape(*lead, *weight.shape[1:])  # [..., *out]


def table_matmul(x: jax.Array, table: jax.Array) -> jax.Array:
    """x [..., D] @ table [V, D] transposed -> [..., V] (float32 in and out), reading the table where it lies;
    each output is summed in the same order whatever the number of rows."""
    _require_kernels("table_matmul")
    if table.ndim != 2 or x.shape[-1] != table.shape[1] or table.dtype != jnp.float32:
        raise ValueError(f"table_matmul: x {x.shape} and table {table.dtype} {table.shape} do not agree "
                         "(expected x [..., D] and a float32 table [V, D])")
    lead = x.shape[:-1]
    rows = x.reshape(-1, table.shape[1])  # [M, D]
    call = jax.ffi.ffi_call(TABLE_TARGET, jax.ShapeDtypeStruct((rows.shape[0], table.shape[0]), jnp.float32))
    y = call(rows.astype(jnp.float32), table)  # [M, V]
    return y.reshape(*lead, table.shape[0])  # [..., V]


def dense(x: jax.Array, weight: jax.Array | PanelWeight, spec: str) -> jax.Array:
    """x contracted with a serving weight: `jnp.einsum(spec, x, weight)` for an array, `panel_matmul` for
    a PanelWeight (whose shape already flattens what the einsum contracts)."""
    if isinstance(weight, PanelWeight):
        return panel_matmul(x, weight)
    return jnp.einsum(spec, x, weight)


__all__ = ["CONTRACTED_DIMS", "PANEL", "PanelWeight", "dense", "kernel_available", "kernel_unavailable_reason",
           "pack_panels", "panel_matmul", "table_matmul", "unpack_panels"]
