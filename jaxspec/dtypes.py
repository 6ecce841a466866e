"""The dtype policy of weights and KV cache (docs/design.md, "Dtypes"): `--dtype auto|float32|bfloat16`.

Only weights and the KV cache take the chosen dtype; softmax, norms, RoPE, logits, sampling and
verification compute in float32 whatever it is.
"""

from __future__ import annotations

DTYPES = ("auto", "float32", "bfloat16")  # what --dtype accepts
ACCELERATOR_BACKENDS = ("gpu", "cuda", "rocm", "tpu")  # jax.default_backend() names where auto is bfloat16


def resolve_dtype(name: str, backend: str) -> str:
    """The concrete dtype ('float32' or 'bfloat16') of `name` on `backend` (a jax.default_backend() name).

    'auto' is float32 on 'cpu' (bf16 matmuls are ~10x slower on XLA:CPU) and bfloat16 on GPU/TPU;
    an explicit dtype is returned as given on every backend. ValueError for an unknown name, or for
    'auto' on a backend this function does not know (say which dtype to use instead of guessing).
    """
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {', '.join(DTYPES)}")
    if name != "auto":
        return name
    if backend == "cpu":
        return "float32"
    if backend in ACCELERATOR_BACKENDS:
        return "bfloat16"
    raise ValueError(f"--dtype auto does not know backend {backend!r}: pass --dtype float32 or --dtype bfloat16")


__all__ = ["DTYPES", "resolve_dtype"]
