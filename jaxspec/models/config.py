"""Frozen model configurations and named presets.

A `ModelConfig` fully determines parameter shapes; it is hashable so it can be a
static argument of jitted functions. Per-request values never live here.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Llama-family decoder (Llama, SmolLM2, Qwen2, Mistral)."""

    name: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_embeddings: bool = True
    qkv_bias: bool = False
    max_position_embeddings: int = 2048
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        for field in ("vocab_size", "hidden_size", "num_layers", "num_heads", "head_dim", "intermediate_size"):
            if getattr(self, field) <= 0:
                raise ValueError(f"{field} must be positive, got {getattr(self, field)}")

    @property
    def num_params(self) -> int:
        """Parameter count (embedding counted once when tied)."""
        d, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        attn = d * q + 2 * d * kv + q * d + (q + 2 * kv if self.qkv_bias else 0)
        per_layer = attn + 3 * d * f + 2 * d
        head = 0 if self.tie_embeddings else v * d
        return v * d + self.num_layers * per_layer + d + head

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)


# --- Named presets -----------------------------------------------------------------

SMOLLM2_135M = ModelConfig(
    name="smollm2-135m",
    vocab_size=49152,
    hidden_size=576,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    intermediate_size=1536,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    tie_embeddings=True,
    max_position_embeddings=8192,
    bos_token_id=1,
    eos_token_ids=(2,),
)

QWEN25_05B = ModelConfig(
    name="qwen2.5-0.5b",
    vocab_size=151936,
    hidden_size=896,
    num_layers=24,
    num_heads=14,
    num_kv_heads=2,
    head_dim=64,
    intermediate_size=4864,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_embeddings=True,
    qkv_bias=True,
    max_position_embeddings=32768,
    eos_token_ids=(151645, 151643),
)

QWEN25_15B = ModelConfig(
    name="qwen2.5-1.5b",
    vocab_size=151936,
    hidden_size=1536,
    num_layers=28,
    num_heads=12,
    num_kv_heads=2,
    head_dim=128,
    intermediate_size=8960,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_embeddings=True,
    qkv_bias=True,
    max_position_embeddings=32768,
    eos_token_ids=(151645, 151643),
)

LLAMA_7B_SHAPED = ModelConfig(
    name="llama-7b-shaped",
    vocab_size=32000,
    hidden_size=4096,
    num_layers=32,
    num_heads=32,
    num_kv_heads=32,
    head_dim=128,
    intermediate_size=11008,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    tie_embeddings=False,
    max_position_embeddings=4096,
    eos_token_ids=(2,),
)

# Tiny configs for tests: seconds to compile on a 2-core CPU.
TINY = ModelConfig(
    name="tiny",
    vocab_size=64,
    hidden_size=32,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    intermediate_size=64,
    rope_theta=10000.0,
    tie_embeddings=False,
    max_position_embeddings=256,
    eos_token_ids=(1,),
)

TINY_QWEN = TINY.replace(name="tiny-qwen", qkv_bias=True, tie_embeddings=True, num_kv_heads=1)

TINY_DRAFT = TINY.replace(name="tiny-draft", num_layers=1, hidden_size=16, num_heads=2, num_kv_heads=1,
                          intermediate_size=32)

PRESETS: dict[str, ModelConfig] = {
    c.name: c
    for c in (SMOLLM2_135M, QWEN25_05B, QWEN25_15B, LLAMA_7B_SHAPED, TINY, TINY_QWEN, TINY_DRAFT)
}


def get_preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise KeyError(f"unknown model preset {name!r}; known: {', '.join(sorted(PRESETS))}") from None
