"""Hardware-efficient draft models (arXiv 2402.01528): shared frozen embedding, pruned output vocab.

`DraftLlama` is a `Llama` (same stacked layers, same `forward_cached` contract, `.config`
whose `vocab_size` is the target's) with three differences:

* its token embedding is the target's, frozen (`Frozen` variable, not an `nnx.Param`), so
  nothing of the 49152 x 576 table has to be trained or shipped;
* if the draft width D differs from the embedding width E, trainable projections map
  E -> D after the embedding and D -> E before the (tied) output head;
* its output head covers only `keep_ids` (the most frequent tokens): the logits it returns
  are full-vocabulary with -inf outside the kept set, so q = softmax(logits) is a proper
  distribution over the whole vocabulary that is zero outside the kept tokens, and the
  engine's `DraftModelProposer` / rejection sampling work unchanged.

    tokens [B,T] --embed (frozen, [V,E])--> [B,T,E] --in_proj?--> [B,T,D] --L layers-->
    --final norm--> [B,T,D] --out_proj?--> [B,T,E] --x head[Vk,E]^T--> [B,T,Vk]
    --scatter into -inf--> logits [B,T,V]
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxspec.models.config import ModelConfig
from jaxspec.models.kernel_plan import XLA_PLAN, KernelPlan
from jaxspec.models.llama import Llama, rms_norm


class Frozen(nnx.Variable):
    """A weight the draft uses but never trains (the target's embedding, the kept ids)."""


class DraftLlama(Llama):
    """A Llama whose embedding is shared (frozen) and whose output vocabulary may be pruned.

    config:   draft architecture; `vocab_size` must be the target's full vocabulary.
    embed:    [V, E] the target's token embedding (shared, frozen).
    keep_ids: ids of the output vocabulary the draft may propose (None: all V).
    """

    def __init__(self, config: ModelConfig, *, embed, keep_ids=None, rngs: nnx.Rngs):
        embed = jnp.asarray(embed)
        v, e = embed.shape
        if v != config.vocab_size:
            raise ValueError(f"embedding has {v} rows but config.vocab_size={config.vocab_size}")
        # Build the layer stack with a dummy 1-row embedding, then install the shared one.
        super().__init__(config.replace(vocab_size=1, tie_embeddings=True), rngs=rngs)
        self.config = config.replace(tie_embeddings=True)
        dtype = jnp.dtype(config.dtype)
        d = config.hidden_size
        self.embed_dim = int(e)
        self.embed = Frozen(embed.astype(dtype))
        if d != e:
            self.in_proj = nnx.Param((jax.random.normal(rngs.params(), (e, d)) / np.sqrt(e)).astype(dtype))
            self.out_proj = nnx.Param((jax.random.normal(rngs.params(), (d, e)) / np.sqrt(d)).astype(dtype))
        keep = np.arange(v) if keep_ids is None else np.unique(np.asarray(keep_ids, np.int64))
        if keep.size == 0 or keep[0] < 0 or keep[-1] >= v:
            raise ValueError(f"keep_ids must be non-empty ids in [0, {v})")
        self.pruned = bool(keep.size < v)
        self.keep_ids = Frozen(jnp.asarray(keep, jnp.int32))
        # head: [Vk, E] rows of the shared embedding (tied output head), gathered once
        self.head = Frozen(self.embed.value[jnp.asarray(keep)])

    @property
    def projected(self) -> bool:
        return self.config.hidden_size != self.embed_dim

    @property
    def num_kept(self) -> int:
        return int(self.keep_ids.value.shape[0])

    def embed_tokens(self, tokens: jax.Array) -> jax.Array:
        """tokens [B, T] -> hidden [B, T, D]."""
        x = jnp.take(self.embed.value, tokens, axis=0)  # [B, T, E]
        if self.projected:
            x = jnp.einsum("BTE,ED->BTD", x, self.in_proj.value)
        return x

    def kept_logits(self, hidden: jax.Array) -> jax.Array:
        """hidden [B, T, D] -> logits over the kept tokens [B, T, Vk] (fp32)."""
        h = rms_norm(hidden, self.final_norm.value, self.config.rms_norm_eps)
        if self.projected:
            h = jnp.einsum("BTD,DE->BTE", h, self.out_proj.value)
        return jnp.einsum("BTE,VE->BTV", h, self.head.value, preferred_element_type=jnp.float32)

    def unembed(self, hidden: jax.Array, kernels: KernelPlan = XLA_PLAN) -> jax.Array:
        """hidden [B, T, D] -> full-vocabulary logits [B, T, V], -inf outside the kept ids. The pruned head is its
        own matmul: a plan with the table head (a full tied head) is an error."""
        if kernels.table_head:
            raise ValueError("a draft's pruned head has no table-kernel form: its plan's lm_head must be 'xla'")
        kept = self.kept_logits(hidden)
        if not self.pruned:
            return kept
        full = jnp.full(kept.shape[:-1] + (self.config.vocab_size,), -jnp.inf, jnp.float32)
        return full.at[..., self.keep_ids.value].set(kept)


def trainable_state(draft: DraftLlama) -> dict[str, np.ndarray]:
    """The draft's own weights (everything but the shared embedding) as float32 numpy."""
    _, params, _ = nnx.split(draft, nnx.Param, ...)
    return {"/".join(str(p) for p in path): np.asarray(v.value if hasattr(v, "value") else v, np.float32)
            for path, v in params.flat_state()}


def load_trainable_state(draft: DraftLlama, weights: dict[str, np.ndarray]) -> DraftLlama:
    """Install weights saved by `trainable_state` (shapes checked)."""
    dtype = jnp.dtype(draft.config.dtype)
    expected = trainable_state_shapes(draft)
    if set(expected) != set(weights):
        raise ValueError(f"draft weights mismatch: missing {sorted(set(expected) - set(weights))[:4]}, "
                         f"unexpected {sorted(set(weights) - set(expected))[:4]}")
    for name, value in weights.items():
        if tuple(value.shape) != expected[name]:
            raise ValueError(f"{name}: expected shape {expected[name]}, got {tuple(value.shape)}")
        getattr(draft, name).value = jnp.asarray(value, dtype)
    return draft


def trainable_state_shapes(draft: DraftLlama) -> dict[str, tuple[int, ...]]:
    _, params, _ = nnx.split(draft, nnx.Param, ...)
    return {"/".join(str(p) for p in path): tuple(v.value.shape if hasattr(v, "value") else v.shape)
            for path, v in params.flat_state()}
