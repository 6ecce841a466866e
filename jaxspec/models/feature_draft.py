"""Feature draft (EAGLE-style, docs/design.md "The feature draft"): one decoder layer that reads the target's features.

The target's feature f_p is its last hidden state after token p, before the final norm (what its LM head
decodes into the distribution of token p+1). The draft's entry at position p fuses the embedding of token
p with the feature of position p-1 (zeros at p = 0), runs one decoder layer at the target's width with its
own KV cache, and predicts f_p; the target's final norm and (pruned) LM head decode that prediction::

    tokens [B,T] --embed (target's, frozen)--> e [B,T,D] --norm--┐
                                                                 concat [B,T,2D] --fuse [2D,D]--> [B,T,D]
    features [B,T,D] (f_{p-1}, or the draft's own prediction) --norm--┘
        --1 decoder layer--> predicted feature [B,T,D] --target final norm + head[Vk,D]--> logits [B,T,V]

With n > 1 feature layers (EAGLE-3's low/mid/high fusion, `feature_layers`, the last one the target's last
layer) the target's feature of a position is the concatenation [n·D] of its hidden states after those layers;
each is normed on its own and `reduce` [n·D, D] maps them to one D-wide feature before the fusion above. The
draft's own predictions (depth > 1) are D wide and skip `reduce`. `reduce` starts as the identity on the last
layer's block, so an untrained fused draft is the single-layer one.

At depth j > 1 the draft feeds itself: the entry at s+j-1 fuses the proposed token d_{j-1} with the
draft's predicted feature of s+j-2. The logits are full-vocabulary with -inf outside the kept ids, so
q = warp(logits) is exact under rejection sampling (as `jaxspec.models.draft.DraftLlama`).

`ttt_features` is the training-time forward (EAGLE-3's "training-time test"): U passes over a teacher-forced
sequence, pass j at position p being the depth-j entry of a draft anchored at s = p-j+1, attending to what
that entry sees in serving (real-feature entries up to s, then the anchor's own depth-2..j entries).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxspec.models.config import ModelConfig
from jaxspec.models.draft import DraftLlama, Frozen
from jaxspec.models.kernel_plan import XLA_PLAN, KernelPlan
from jaxspec.models.kv_cache import KVCache
from jaxspec.models.llama import StepInputs, attention, rms_norm


def feature_draft_config(target: ModelConfig, num_layers: int = 1) -> ModelConfig:
    """The draft's decoder at the target's shapes (width, heads, FFN), `num_layers` deep."""
    return target.replace(name=f"{target.name}-feature", num_layers=num_layers)


class FeatureDraft(DraftLlama):
    """One (or a few) decoder layers over fuse(token embedding, target feature); the target's LM head.

    config:         `feature_draft_config(target)`; `vocab_size` and width are the target's.
    embed:          [V, D] the target's input embedding (shared, frozen).
    feature_layers: the target layer counts (1 .. L, ascending, the last = L) whose hidden states it reads.
    head:           [V, D] the target's output head rows (its tied embedding, or lm_head transposed; frozen).
    keep_ids:       the output vocabulary the draft may propose (None: all V).
    """

    def __init__(self, config: ModelConfig, *, embed, feature_layers: tuple[int, ...], head=None, keep_ids=None,
                 rngs: nnx.Rngs):
        super().__init__(config, embed=embed, keep_ids=keep_ids, rngs=rngs)
        if self.projected:
            raise ValueError("a feature draft runs at the target's width")
        d = config.hidden_size
        dtype = jnp.dtype(config.dtype)
        feature_layers = tuple(int(i) for i in feature_layers)
        if not feature_layers or list(feature_layers) != sorted(set(feature_layers)) or feature_layers[0] < 1:
            raise ValueError(f"feature_layers must be distinct ascending layer counts >= 1, got {feature_layers}")
        self.feature_layers = feature_layers
        if head is not None:  # an untied target: decode with its own LM head rows
            head = jnp.asarray(head).astype(dtype)
            if head.shape != (config.vocab_size, d):
                raise ValueError(f"head must be [V, D] = {(config.vocab_size, d)}, got {head.shape}")
            self.head = Frozen(head[self.keep_ids.value])
        self.embed_norm = nnx.Param(jnp.ones((d,), dtype))
        self.feature_norm = nnx.Param(jnp.ones((d,), dtype))
        # fuse: [2D, D], initialised to add the two normed inputs (identity blocks, scaled)
        eye = np.eye(d, dtype=np.float32) / np.sqrt(2.0)
        self.fuse = nnx.Param(jnp.asarray(np.concatenate([eye, eye], axis=0), dtype))
        n = len(feature_layers)
        if n > 1:
            self.layer_norms = nnx.Param(jnp.ones((n, d), dtype))
            # reduce: [n·D, D], the identity on the last layer's block
            self.reduce = nnx.Param(jnp.asarray(np.concatenate([np.zeros(((n - 1) * d, d), np.float32),
                                                                np.eye(d, dtype=np.float32)]), dtype))

    @property
    def feature_width(self) -> int:
        """Width of a stored target feature: n·D."""
        return len(self.feature_layers) * self.config.hidden_size

    def _one_feature(self, features: jax.Array) -> jax.Array:
        """features [B, T, n·D] (the target's) or [B, T, D] (the draft's own prediction) -> [B, T, D]."""
        d, n = self.config.hidden_size, len(self.feature_layers)
        if n == 1 or features.shape[-1] == d:
            return features
        # per layer: [B, T, n, D] normed with its own weights -> [B, T, n·D] x [n·D, D] -> [B, T, D]
        per_layer = features.reshape(*features.shape[:-1], n, d)
        normed = rms_norm(per_layer, self.layer_norms.value, self.config.rms_norm_eps)
        return jnp.einsum("BTE,ED->BTD", normed.reshape(features.shape), self.reduce.value)

    def fused_inputs(self, tokens: jax.Array, features: jax.Array) -> jax.Array:
        """tokens [B, T], features of the previous position -> first-layer input [B, T, D]; features are the
        target's [B, T, n·D] or the draft's own predictions [B, T, D]."""
        eps = self.config.rms_norm_eps
        e = rms_norm(jnp.take(self.embed.value, tokens, axis=0), self.embed_norm.value, eps)  # [B, T, D]
        f = rms_norm(self._one_feature(features.astype(e.dtype)), self.feature_norm.value, eps)  # [B, T, D]
        # [B, T, 2D] x [2D, D] -> [B, T, D]
        return jnp.einsum("BTE,ED->BTD", jnp.concatenate([e, f], axis=-1), self.fuse.value)

    def forward_features(self, inputs: StepInputs, features: jax.Array, cache: KVCache, window: int,
                         layers: tuple[dict, ...] | None = None,
                         kernels: KernelPlan = XLA_PLAN) -> tuple[jax.Array, KVCache]:
        """Write T entries per row (tokens `inputs.tokens`, previous-position `features` [B, T, n·D or D]) into
        the draft cache; returns the predicted features [B, T, D] (decode them with `unembed`) and the cache."""
        return self.forward_cached_hidden(inputs, cache, window, layers=layers,
                                          embeds=self.fused_inputs(inputs.tokens, features), kernels=kernels)

    def ttt_features(self, tokens: jax.Array, features: jax.Array, passes: int) -> jax.Array:
        """Training-time test: predicted features [U, B, T, D] of U passes over a teacher-forced sequence.

        tokens [B, T]; features [B, T, n·D] the target's real features. Pass 1 is the draft on real features
        (entry p: token p, f_{p-1}); pass j feeds entry p with pass j-1's prediction at p-1, and attends to
        pass-1 keys at q <= p-j+1 and to pass-i keys (2 <= i <= j) at q = p-j+i: exactly the cache a depth-j
        entry of a draft anchored at s = p-j+1 sees in serving (`ttt_mask`).
        """
        b, t = tokens.shape
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))  # [B, T]
        shift = lambda x: jnp.pad(x, ((0, 0), (1, 0), (0, 0)))[:, :-1]  # noqa: E731 [B, T, ·] position p <- p-1
        previous = shift(features)  # [B, T, n·D]
        stacked = self._layer_params()
        layers = tuple({name: w[i] for name, w in stacked.items()} for i in range(self.config.num_layers))
        outputs = []
        keys: list[tuple[list, list]] = [([], []) for _ in layers]
        for j in range(1, passes + 1):
            mask = jnp.asarray(ttt_mask(t, j))  # [T, j·T]

            def attend(index, q, k, v, state, mask=mask):
                ks, vs = keys[index]
                ks.append(k)
                vs.append(v)
                # q: [B, T, N, H] over the keys of passes 1..j: [B, j·T, G, H]
                kk, vv = jnp.concatenate(ks, axis=1), jnp.concatenate(vs, axis=1)
                return attention(q, kk, vv, jnp.broadcast_to(mask, (b, *mask.shape))), state

            x, _, _ = self._run_layers(self.fused_inputs(tokens, previous), positions, attend, (), layers)  # [B, T, D]
            outputs.append(x)
            previous = shift(x)
        return jnp.stack(outputs)  # [U, B, T, D]


def ttt_mask(t: int, j: int) -> np.ndarray:
    """mask [T, j·T]: query p of pass j attends key q of pass i (key column (i-1)·T + q) iff
    i = 1 and q <= p-j+1, or 2 <= i <= j and q = p-j+i."""
    p = np.arange(t)[:, None]
    q = np.arange(t)[None, :]
    blocks = [q <= p - j + 1] + [q == p - j + i for i in range(2, j + 1)]
    return np.concatenate(blocks, axis=1)
