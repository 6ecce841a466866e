"""The kernel plan: which form each hot operation of a model takes, resolved once per engine (docs/design.md,
"The kernel plan").

A `KernelPlan` names the attention form (the XLA form that gathers the window, the XLA:CPU kernel that reads
the cache in place, or the Pallas kernel on GPU), the layout the XLA attention form contracts in, the matmul
form of the layers' weights (XLA's dot, or column panels on XLA:CPU) and the LM head's form. `resolve_kernel_plan`
picks them from the backend, the dtype, the mesh and the model's shape, including each kernel's own limits, and
records why a kernel was not taken. The plan is passed explicitly to the model functions that trace with it
(`Llama.forward_cached(..., kernels=plan)`, `Llama.unembed(..., kernels=plan)`); nothing reads an ambient flag
while tracing. `XLA_PLAN`, the default of those functions, is the reference form every kernel is tested against.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Literal

import jax.numpy as jnp

from jaxspec.models.config import ModelConfig

AttentionForm = Literal["xla", "cpu-cache-kernel", "pallas"]
MatmulForm = Literal["xla", "cpu-panels"]
HeadForm = Literal["xla", "cpu-table"]
KernelChoice = Literal["auto", "xla"]
KERNEL_CHOICES: tuple[str, ...] = ("auto", "xla")
KERNELS_ENV = "JAXSPEC_KERNELS"  # overrides the default choice (`auto`) of every engine command

# the XLA attention form contracts k/v in their cache layout for at most this many kv heads on XLA:CPU
# (`jaxspec.models.llama.attention`, block_diagonal; docs/results/step_profile.md)
BLOCK_DIAGONAL_MAX_KV_HEADS = 4


@dataclasses.dataclass(frozen=True)
class KernelPlan:
    """The forms one engine's executables trace with.

    attention            how a step attends over its window (`attention_max_rows` new tokens a row at most;
                         larger calls, prefill chunks, take the XLA form)
    xla_block_diagonal   the XLA attention form contracts k/v in their cache layout (XLA:CPU, few kv heads,
                         unsplit) instead of a matmul batched over kv heads
    matmul               the layers' weights: XLA's layout, or column panels read by the panel kernel
    lm_head              the tied LM head: XLA's dot, or the table kernel reading the embedding in place
    notes                why a kernel was not taken (empty when every kernel that exists for the backend was)
    interpret            run the Pallas kernel in interpret mode (tests of the GPU kernel on CPU; never fast)
    """

    attention: AttentionForm = "xla"
    attention_max_rows: int = 0
    xla_block_diagonal: bool = False
    matmul: MatmulForm = "xla"
    lm_head: HeadForm = "xla"
    notes: tuple[str, ...] = ()
    interpret: bool = False

    def attention_form(self, rows: int) -> AttentionForm:
        """The form a call with `rows` new tokens per row attends in."""
        return self.attention if rows <= self.attention_max_rows else "xla"

    @property
    def panels(self) -> bool:
        return self.matmul == "cpu-panels"

    @property
    def table_head(self) -> bool:
        return self.lm_head == "cpu-table"

    def describe(self) -> str:
        text = f"attention={self.attention}"
        if self.attention != "xla":
            text += f" (T<={self.attention_max_rows})"
        text += f", matmul={self.matmul}, lm_head={self.lm_head}"
        return text + "".join(f"; {note}" for note in self.notes)

    def to_json(self) -> dict:
        return {"attention": self.attention, "attention_max_rows": self.attention_max_rows,
                "xla_block_diagonal": self.xla_block_diagonal, "matmul": self.matmul, "lm_head": self.lm_head,
                "notes": list(self.notes), **({"interpret": True} if self.interpret else {})}


XLA_PLAN = KernelPlan()


def kernel_choice(flag: str | None) -> KernelChoice:
    """`--kernels` (None: not given) or else $JAXSPEC_KERNELS, else 'auto'; anything else is a ValueError."""
    choice = flag if flag is not None else os.environ.get(KERNELS_ENV, "auto")
    if choice not in KERNEL_CHOICES:
        source = "--kernels" if flag is not None else f"${KERNELS_ENV}"
        raise ValueError(f"{source} must be one of {', '.join(KERNEL_CHOICES)}, got {choice!r}")
    return choice  # type: ignore[return-value]


def resolve_kernel_plan(config: ModelConfig, backend: str, dtype, mesh_size: int, cache_kv_heads: int,
                        tensor_parallel: bool, choice: KernelChoice = "auto", max_len: int | None = None,
                        page_size: int | None = None) -> KernelPlan:
    """The plan for `config` served in `dtype` on `backend` ('cpu', 'gpu' or 'tpu') over `mesh_size` devices.

    `cache_kv_heads`: the kv heads the cache holds (G, or G repeated up to the model axis); `tensor_parallel`:
    the layers are split over more than one device (`TensorParallelLayout.groups > 1`).
    `choice='xla'` takes the XLA form everywhere; `page_size`: the positions per page of a paged cache (the
    target's); else `max_len`: a per-slot cache's positions per slot, when known (the Pallas kernel reads a slot
    as pages that must tile it)."""
    notes: list[str] = []
    block_diagonal = (backend == "cpu" and not tensor_parallel
                      and cache_kv_heads <= BLOCK_DIAGONAL_MAX_KV_HEADS)
    if choice == "xla":
        return KernelPlan(xla_block_diagonal=block_diagonal, notes=("--kernels xla",))
    attention: AttentionForm = "xla"
    max_rows = 0
    matmul: MatmulForm = "xla"
    head: HeadForm = "xla"
    if backend == "cpu":
        from jaxspec.models import cache_attention, cpu_kernels, panel_matmul

        cpu_reason = None
        if jnp.dtype(dtype) != jnp.float32:
            cpu_reason = f"the XLA:CPU kernels take float32, not {jnp.dtype(dtype).name}"
        elif mesh_size != 1:
            cpu_reason = f"the XLA:CPU kernels run on one device, not a mesh of {mesh_size}"
        if cpu_reason is None and not cache_attention.head_dim_supported(config.head_dim):
            cpu_reason = f"the XLA:CPU attention kernel takes head dims that are multiples of 8 up to " \
                         f"{cache_attention.MAX_HEAD_DIM}, not {config.head_dim}"
        if cpu_reason is not None:
            notes.append(cpu_reason)
        else:
            if cache_attention.kernel_available():
                attention, max_rows = "cpu-cache-kernel", cache_attention.MAX_STEP_TOKENS
            else:
                notes.append(cache_attention.kernel_unavailable_reason())
            if panel_matmul.kernel_available():
                matmul = "cpu-panels"
                head = "cpu-table" if config.tie_embeddings else "xla"
            else:
                notes.append(panel_matmul.kernel_unavailable_reason())
            if attention == "xla" or matmul == "xla":
                cpu_kernels.note_xla_form()  # once per process, on stderr: why, and how to get the kernels
    elif backend == "gpu":
        from jaxspec.models import pallas_attention

        limit = pallas_attention.attention_limits(
            platform="gpu", dtype=dtype, head_dim=config.head_dim, num_heads=config.num_heads,
            num_kv_heads=config.num_kv_heads, block_tokens=pallas_attention.MAX_STEP_TOKENS,
            page_size=page_size or pallas_attention.SLOT_PAGE_SIZE, max_len=None if page_size else max_len)
        if limit is None:
            attention, max_rows = "pallas", pallas_attention.MAX_STEP_TOKENS
        else:
            notes.append(f"Pallas attention: {limit}")
    else:
        notes.append(f"no attention kernel for backend {backend!r}: the XLA form")
    return KernelPlan(attention=attention, attention_max_rows=max_rows, xla_block_diagonal=block_diagonal,
                      matmul=matmul, lm_head=head, notes=tuple(notes))


__all__ = ["BLOCK_DIAGONAL_MAX_KV_HEADS", "KERNELS_ENV", "KERNEL_CHOICES", "KernelPlan", "XLA_PLAN", "kernel_choice",
           "resolve_kernel_plan"]
