"""The kernel plan of a model served on a mesh (jaxspec.models.kernel_plan; docs/design.md, "The kernel plan").

Resolved once per model placement: the target's plan (split over `model`), a draft's (replicated). The builder
loads weights in the plan's layout (column panels or XLA's) and the engine traces every executable with it.
"""

from __future__ import annotations

from jaxspec.mesh import MeshSpec, make_mesh
from jaxspec.models.config import ModelConfig
from jaxspec.models.kernel_plan import KernelChoice, KernelPlan, resolve_kernel_plan
from jaxspec.models.sharding import plan_layout, replicated_layout


def kernel_plan_for(config: ModelConfig, mesh: MeshSpec, choice: KernelChoice = "auto",
                    tensor_parallel: bool = True, max_len: int | None = None,
                    page_size: int | None = None) -> KernelPlan:
    """The plan for `config` served on `mesh`: split over `model` (`tensor_parallel`) or replicated (a draft);
    `page_size`: the target's paged cache's; `max_len`: a draft's per-slot cache's positions per slot."""
    device_mesh = make_mesh(mesh)
    layout = plan_layout(config, mesh.model) if tensor_parallel else replicated_layout(config, mesh.model)
    return resolve_kernel_plan(config, backend=device_mesh.devices.flat[0].platform, dtype=config.dtype,
                               mesh_size=device_mesh.size, cache_kv_heads=layout.kv_heads_for(config),
                               tensor_parallel=layout.groups > 1, choice=choice, max_len=max_len,
                               page_size=page_size)
