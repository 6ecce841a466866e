"""Llama-family decoder in flax.nnx: Llama, SmolLM2, Qwen2 (qkv bias), Mistral.

Weights are stored stacked along a leading layer axis. Serving runs the layers unrolled over
per-layer arrays (`serving_split`, `fuse_layer`: each matmul reads its weights in place; on XLA:CPU they are
stored as column panels, `jaxspec.models.panel_matmul`); a
`jax.lax.scan` over the stacked weights remains for training and tests (fast to compile).

Dimension names (docs/design.md, "Dimension names"):
  B batch rows   T new tokens per row   S slots (+1 scratch)   M cache positions (max_len)
  I pages in a paged cache's pool   X positions per page
  W attended window   D model width   F FFN width   E a fused projection's output width
  N query heads   G kv heads   R = N // G query heads per kv head   H head dim   V vocab
  J positions whose logits are kept   L layers   P tensor-parallel groups (mesh `model` size)
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as PS

from jaxspec.models.cache_attention import cache_attention, paged_cache_attention
from jaxspec.models.config import ModelConfig
from jaxspec.models.kernel_plan import XLA_PLAN, KernelPlan
from jaxspec.models.kv_cache import KVCache, PagedKVCache, gather_window, page_slots
from jaxspec.models.pallas_attention import WindowMask, paged_attention, slot_attention
from jaxspec.models.panel_matmul import PanelWeight, dense, table_matmul
from jaxspec.models.sharding import Placement, TensorParallelLayout

# Names of the stacked per-layer weights, in a fixed order.
LAYER_WEIGHTS = (
    "attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down",
)
LAYER_BIASES = ("bq", "bk", "bv")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepInputs:
    """Where T new tokens per row go and what they may attend to.

    tokens:      [B, T] int32 token ids.
    slot_ids:    [B] int32 cache slot of each row (padded rows use the scratch slot).
    start:       [B] int32 first cache position written by this call (= committed length).
    depth:       [B, T] int32 position offset of each token (chain: 0..T-1; tree: node depth).
    step_mask:   [B, T, T] bool, step_mask[b, t, u]: query t may attend new token u
                 (chain: lower-triangular; tree: ancestor-or-self).
    block_table: [B, ceil(W/X)] int32, the pages of each row's window in a paged cache
                 (jaxspec.models.kv_cache.PagedKVCache); None for a per-slot cache.
    """

    tokens: jax.Array
    slot_ids: jax.Array
    start: jax.Array
    depth: jax.Array
    step_mask: jax.Array
    block_table: jax.Array | None = None


def chain_inputs(tokens: jax.Array, slot_ids: jax.Array, start: jax.Array,
                 block_table: jax.Array | None = None) -> StepInputs:
    """StepInputs for a plain causal chain of T tokens per row (`block_table` for a paged cache)."""
    b, t = tokens.shape
    # depth: [B, T] = 0..T-1 ; step_mask: [B, T, T] lower-triangular
    depth = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    step_mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
    return StepInputs(tokens, slot_ids, start, depth, step_mask, block_table)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm computed in fp32, returned in x's dtype."""
    x32 = x.astype(jnp.float32)
    # x32: [..., D] -> variance [..., 1]
    variance = jnp.mean(x32 * x32, axis=-1, keepdims=True)
    return (x32 * jax.lax.rsqrt(variance + eps)).astype(x.dtype) * weight


ServingParams = tuple  # (nnx.State with empty stacked placeholders, per-layer weights from `fuse_layer`)


_SERVING_SPLITS: weakref.WeakKeyDictionary[Llama, dict[Placement, tuple]] = weakref.WeakKeyDictionary()


def serving_split(model: Llama, placement: Placement = Placement()) -> tuple[nnx.GraphDef, ServingParams]:
    """Split a model for the serving path: graphdef and (params, per-layer weights), placed by `placement`.

    The stacked layer weights are replaced by empty placeholders in the params, and the
    per-layer arrays that `forward_cached(layers=)` reads in place are built once per model
    object and placement: engines over the same model (a plain and a speculative one) share them.
    Each layer is fused, placed and its host copy dropped before the next (`fuse_layer`).
    Call outside jit, and do not mutate the model's weights afterwards.
    """
    splits = _SERVING_SPLITS.setdefault(model, {})
    if placement not in splits:
        if is_serving_only(model):
            raise ValueError(f"{model.config.name} was loaded straight into its serving layout for one placement "
                             f"({placement_name(next(iter(splits)))}); it cannot be re-split for "
                             f"{placement_name(placement)}: load it again with that mesh")
        stacked = model._layer_params()
        layers = tuple({name: placement.put_param(name, value) for name, value in
                        fuse_layer(model.config, {n: np.asarray(w[i]) for n, w in stacked.items()},
                                   placement.layout).items()}
                       for i in range(model.config.num_layers))
        register_serving_split(model, placement, layers)
    return splits[placement]


def register_serving_split(model: Llama, placement: Placement, layers: tuple[dict, ...]) -> None:
    """Record `layers` (built by `fuse_layer`, placed by `placement`) as the model's serving weights
    there, and place its other weights (embedding, final norm, LM head) by the same placement."""
    stacked = set(model.stacked_weight_names())
    graphdef, params = nnx.split(model)
    placed = []
    for path, state in params.flat_state():
        name = str(path[-1])
        if name in stacked:  # the layers are read from `layers`; keep an empty placeholder
            placed.append((path, state.replace(placement.put(np.zeros((0,), state.value.dtype), PS()))))
        else:
            placed.append((path, state.replace(placement.put_param(name, state.value))))
    params = nnx.State.from_flat_path(placed)
    _SERVING_SPLITS.setdefault(model, {})[placement] = (graphdef, (params, layers))


def serving_layers(model: Llama) -> tuple[dict, ...]:
    """The per-layer serving weights of a serving-only model (a streamed one). Inside jit the model is a
    copy that is not registered: pass these to `__call__(layers=)` as a jit argument instead."""
    if model not in _SERVING_SPLITS:
        raise ValueError(f"{model.config.name} has no registered serving layers (inside jit, pass layers= "
                         f"from serving_layers(model) as an argument)")
    return next(iter(_SERVING_SPLITS[model].values()))[1][1]


def is_serving_only(model: Llama) -> bool:
    """True for a model loaded straight into its serving layout (its stacked weights are empty)."""
    return model.attn_norm.value.size == 0


def placement_name(placement: Placement) -> str:
    mesh = placement.mesh
    where = "one device" if mesh is None else ", ".join(f"{k}={v}" for k, v in mesh.shape.items())
    return where + (", column panels" if placement.panels else "")


def fuse_layer(config: ModelConfig, w: dict[str, jax.Array], layout: TensorParallelLayout) -> dict[str, jax.Array]:
    """One layer's weights (`LAYER_WEIGHTS` shapes, numpy or jax arrays) in the fused serving layout of `layout`.

    P = layout.groups. Q/K/V and gate/up are each one matmul per layer (the CPU pays per kernel),
    grouped by tensor-parallel shard so each of the P groups is one contiguous block:
    wqkv [D, P, (N + 2G')H / P], w_gate_up [D, P, 2F / P]. kv heads are repeated to G' first when
    the layout asks (an exactly equivalent model). P = 1 is the plain fused layout. Traceable
    (`serving_shapes` runs it under jax.eval_shape).
    """
    c = config
    p, d = layout.groups, c.hidden_size
    repeat = layout.kv_heads_for(c) // c.num_kv_heads
    kv = lambda x: jnp.repeat(x, repeat, axis=1)  # noqa: E731  [D, G, H] -> [D, G', H]
    grouped = lambda x: jnp.reshape(x, (d, p, -1))  # noqa: E731  [D, heads, H] or [D, F] -> [D, P, E/P]
    fused = {"attn_norm": w["attn_norm"], "mlp_norm": w["mlp_norm"], "wo": w["wo"], "w_down": w["w_down"],
             # [D, P, nq/P | G'H/P | G'H/P]: q | k | v per group
             "wqkv": jnp.concatenate([grouped(w["wq"]), grouped(kv(w["wk"])), grouped(kv(w["wv"]))], axis=2),
             "w_gate_up": jnp.concatenate([grouped(w["w_gate"]), grouped(w["w_up"])], axis=2)}  # [D, P, 2F/P]
    if c.qkv_bias:
        bias = lambda x: jnp.reshape(x, (p, -1))  # noqa: E731  [heads, H] -> [P, heads/P * H]
        fused["bqkv"] = jnp.concatenate([bias(w["bq"]), bias(jnp.repeat(w["bk"], repeat, axis=0)),
                                         bias(jnp.repeat(w["bv"], repeat, axis=0))], axis=1)  # [P, E/P]
    return {name: jnp.asarray(value) for name, value in fused.items()}


def serving_shapes(config: ModelConfig, layout: TensorParallelLayout) -> dict[str, jax.ShapeDtypeStruct]:
    """Global shape and dtype of every serving weight of one layer and of embed / lm_head / final_norm,
    by name (no memory: jax.eval_shape). With `jaxspec.models.sharding.param_spec` it gives per-device shapes."""
    model = nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0)))
    one_layer = {name: jax.ShapeDtypeStruct(getattr(model, name).value.shape[1:], getattr(model, name).value.dtype)
                 for name in model.stacked_weight_names()}
    shapes = dict(jax.eval_shape(lambda w: fuse_layer(config, w, layout), one_layer))
    for name in ("embed", "final_norm") + (() if config.tie_embeddings else ("lm_head",)):
        value = getattr(model, name).value
        shapes[name] = jax.ShapeDtypeStruct(value.shape, value.dtype)
    return shapes


def rope_tables(positions: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """cos, sin [B, T, 1, H] for HF-style (rotate-half) rotary embedding at positions [B, T]."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))  # [H/2]
    # angles: [B, T, H/2] = positions[B,T,1] * inv_freq
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    cos = jnp.concatenate([jnp.cos(angles)] * 2, axis=-1)[:, :, None, :]
    sin = jnp.concatenate([jnp.sin(angles)] * 2, axis=-1)[:, :, None, :]
    return cos, sin


def rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate x [B, T, heads, H] by the tables from `rope_tables`."""
    x32 = x.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)  # [B, T, heads, H]
    return (x32 * cos + rotated * sin).astype(x.dtype)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, block_diagonal: bool = False) -> jax.Array:
    """Grouped-query attention.

    q: [B, T, N, H]; k, v: [B, W, G, H]; mask: [B, T, W] bool -> [B, T, N, H].

    `block_diagonal`: contract k and v in their cache layout [B, W, G·H] (a free reshape) against a
    block-diagonal query [B, T·N, G·H] (head n's values in its own group's H columns, exact zeros
    elsewhere), instead of a matmul batched over G, for which XLA:CPU first copies k and v of the
    window into G-major layouts every layer. It does G times the multiply-adds and, with the kv
    heads split over a mesh, would contract over a sharded dimension: `forward_cached` uses it only
    for few kv heads on an unsplit layout (docs/results/step_profile.md).
    """
    b, t, n, h = q.shape
    w, kv_heads = k.shape[1], k.shape[2]
    if block_diagonal:
        # member: [G, N] one-hot, member[g, n] = 1 iff query head n reads kv head g
        member = (np.arange(n)[None, :] // (n // kv_heads) == np.arange(kv_heads)[:, None]).astype(q.dtype)
        # q_bd: [B, T·N, G·H]
        q_bd = jnp.einsum("BTNH,GN->BTNGH", q, member).reshape(b, t * n, kv_heads * h)
        # scores: [B, T·N, W]
        scores = jnp.einsum("BXE,BWE->BXW", q_bd, k.reshape(b, w, kv_heads * h), preferred_element_type=jnp.float32)
        scores = scores * (1.0 / np.sqrt(h))
        scores = jnp.where(jnp.repeat(mask, n, axis=1), scores, jnp.finfo(jnp.float32).min)  # mask row t·N + n
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)  # [B, T·N, W]
        # out: [B, T·N, G·H] -> [B, T, N, G, H] -> each head's own group -> [B, T, N, H]
        out = jnp.einsum("BXW,BWE->BXE", probs, v.reshape(b, w, kv_heads * h)).reshape(b, t, n, kv_heads, h)
        return jnp.einsum("BTNGH,GN->BTNH", out, member)
    # q: [B, T, N, H] -> [B, T, G, R, H]
    q = q.reshape(b, t, kv_heads, n // kv_heads, h)
    # scores: [B, G, R, T, W]
    scores = jnp.einsum("BTGRH,BWGH->BGRTW", q, k, preferred_element_type=jnp.float32)
    scores = scores * (1.0 / np.sqrt(h))
    scores = jnp.where(mask[:, None, None, :, :], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)  # [B, G, R, T, W]
    # out: [B, T, G, R, H] -> [B, T, N, H]
    out = jnp.einsum("BGRTW,BWGH->BTGRH", probs, v)
    return out.reshape(b, t, n, h)


def window_mask(inputs: StepInputs, window: int) -> jax.Array:
    """Mask [B, T, W] over cache positions 0..W-1 of each row's slot.

    For row b with start s and T new tokens written at cache positions s..s+T-1::

        key position j:   0 ........ s-1 | s ...... s+T-1 | s+T ... W-1
        query t sees:     all (history)  | step_mask[t,:] | nothing (stale)
    """
    return block_window_mask(inputs.step_mask, inputs.start, window)


def block_window_mask(block_mask: jax.Array, block_start: jax.Array, window: int) -> jax.Array:
    """Mask [B, T, W]: every position before block_start [B] (history), then block_mask [B, T, U] over
    the U positions from block_start on, nothing after. `window_mask` is the case U = T (the call's own
    tokens); a draft tree's level call attends to a block of earlier nodes as well (U > T)."""
    b, t, u = block_mask.shape
    # rel: [B, W] key position relative to the block start
    rel = jnp.arange(window, dtype=jnp.int32)[None, :] - block_start[:, None]
    history = rel < 0  # [B, W]
    in_block = (rel >= 0) & (rel < u)  # [B, W]
    # block_part: [B, T, W] = block_mask[b, t, rel[b, w]] where rel is inside the block
    idx = jnp.broadcast_to(jnp.clip(rel, 0, u - 1)[:, None, :], (b, t, window))
    block_part = jnp.take_along_axis(block_mask, idx, axis=2)
    return history[:, None, :] | (in_block[:, None, :] & block_part)


class Llama(nnx.Module):
    """Decoder-only transformer with stacked layer weights."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.config = config
        c = config
        dtype = jnp.dtype(c.dtype)
        L, D, F, N, G, H = (c.num_layers, c.hidden_size, c.intermediate_size, c.num_heads,
                            c.num_kv_heads, c.head_dim)

        def normal(shape, fan_in):
            return (jax.random.normal(rngs.params(), shape, jnp.float32) / np.sqrt(fan_in)).astype(dtype)

        self.embed = nnx.Param(normal((c.vocab_size, D), 1.0))
        self.attn_norm = nnx.Param(jnp.ones((L, D), dtype))
        self.wq = nnx.Param(normal((L, D, N, H), D))
        self.wk = nnx.Param(normal((L, D, G, H), D))
        self.wv = nnx.Param(normal((L, D, G, H), D))
        self.wo = nnx.Param(normal((L, N, H, D), N * H))
        if c.qkv_bias:
            self.bq = nnx.Param(normal((L, N, H), 10.0))
            self.bk = nnx.Param(normal((L, G, H), 10.0))
            self.bv = nnx.Param(normal((L, G, H), 10.0))
        self.mlp_norm = nnx.Param(jnp.ones((L, D), dtype))
        self.w_gate = nnx.Param(normal((L, D, F), D))
        self.w_up = nnx.Param(normal((L, D, F), D))
        self.w_down = nnx.Param(normal((L, F, D), F))
        self.final_norm = nnx.Param(jnp.ones((D,), dtype))
        if not c.tie_embeddings:
            self.lm_head = nnx.Param(normal((D, c.vocab_size), D))

    # --- pieces -------------------------------------------------------------------

    def stacked_weight_names(self) -> tuple[str, ...]:
        """Attribute names of the stacked per-layer weights."""
        return LAYER_WEIGHTS + (LAYER_BIASES if self.config.qkv_bias else ())

    def _layer_params(self) -> dict[str, jax.Array]:
        return {name: getattr(self, name).value for name in self.stacked_weight_names()}

    def embed_tokens(self, tokens: jax.Array) -> jax.Array:
        """tokens [B, T] -> hidden [B, T, D]."""
        return jnp.take(self.embed.value, tokens, axis=0)

    def unembed(self, hidden: jax.Array, kernels: KernelPlan = XLA_PLAN) -> jax.Array:
        """Final norm + LM head: hidden [B, T, D] -> logits [B, T, V] (fp32). With `kernels.table_head` the tied
        embedding is read in place by `jaxspec.models.panel_matmul.table_matmul` (XLA:CPU, float32, one device),
        every logit the same bits whatever B·T (docs/design.md, "Matmuls on XLA:CPU")."""
        h = rms_norm(hidden, self.final_norm.value, self.config.rms_norm_eps)
        b, t, d = h.shape
        rows = h.reshape(b * t, d)  # [B·T, D]
        if kernels.table_head:
            if not self.config.tie_embeddings:
                raise ValueError(f"{self.config.name}: the table head needs a tied embedding (this model has an "
                                 f"lm_head)")
            logits = table_matmul(rows, self.embed.value)  # [B·T, V]
            return logits.reshape(b, t, -1)  # [B, T, V]
        # a matmul of rows [B·T, D] with the embedding transposed ([V, D] -> [D, V]): at B·T = 1 XLA:CPU fuses
        # the transpose into a matrix-vector loop that reads the embedding row by row, 1.2x faster than the dot
        # an einsum over [V, D] lowers to (docs/design.md, "Attention on XLA:CPU"); the same at B·T > 1
        head = self.embed.value.T if self.config.tie_embeddings else self.lm_head.value  # [D, V]
        logits = jnp.matmul(rows, head, preferred_element_type=jnp.float32)  # [B·T, V]
        return logits.reshape(b, t, -1)  # [B, T, V]

    def _decoder_layer(self, p: dict, x: jax.Array, rope_cs, attend: Callable, index, state):
        """One pre-norm block: x [B, T, D] -> x [B, T, D]."""
        c = self.config
        h = rms_norm(x, p["attn_norm"], c.rms_norm_eps)  # [B, T, D]
        if "wqkv" in p:  # fused serving layout, P tensor-parallel groups (see fuse_layer)
            b, t, _ = h.shape
            groups, group_width = p["wqkv"].shape[1:]
            qkv = dense(h, p["wqkv"], "BTD,DPE->BTPE")  # [B, T, P, E/P]
            if c.qkv_bias:
                qkv = qkv + p["bqkv"]  # + [P, E/P]
            nq = c.num_heads // groups * c.head_dim  # query columns per group
            nk = (group_width - nq) // 2  # key (and value) columns per group
            q = qkv[..., :nq].reshape(b, t, c.num_heads, c.head_dim)  # [B, T, P, nq] -> [B, T, N, H]
            k = qkv[..., nq:nq + nk].reshape(b, t, -1, c.head_dim)  # [B, T, G', H]
            v = qkv[..., nq + nk:].reshape(b, t, -1, c.head_dim)  # [B, T, G', H]
        else:
            q = jnp.einsum("BTD,DNH->BTNH", h, p["wq"])  # [B, T, N, H]
            k = jnp.einsum("BTD,DGH->BTGH", h, p["wk"])  # [B, T, G, H]
            v = jnp.einsum("BTD,DGH->BTGH", h, p["wv"])  # [B, T, G, H]
            if c.qkv_bias:
                q, k, v = q + p["bq"], k + p["bk"], v + p["bv"]
        q, k = rope(q, *rope_cs), rope(k, *rope_cs)
        out, state = attend(index, q, k, v, state)  # out: [B, T, N, H]
        # one [B, T, N·H] x [N·H, D] matmul: the weight is read in place (a row-major reshape); with
        # the contraction over (N, H) as two dims XLA may transpose the whole weight every step instead
        b, t, n, hd = out.shape
        wo = p["wo"] if isinstance(p["wo"], PanelWeight) else p["wo"].reshape(n * hd, -1)  # [N·H, D]
        x = x + dense(out.reshape(b, t, n * hd), wo, "BTE,ED->BTD")  # [B, T, D]
        h = rms_norm(x, p["mlp_norm"], c.rms_norm_eps)
        if "w_gate_up" in p:
            gate_up = dense(h, p["w_gate_up"], "BTD,DPE->BTPE")  # [B, T, P, 2F/P]
            gate, up = (part.reshape(*h.shape[:2], -1) for part in jnp.split(gate_up, 2, axis=-1))  # 2 x [B, T, F]
        else:
            gate = jnp.einsum("BTD,DF->BTF", h, p["w_gate"])  # [B, T, F]
            up = jnp.einsum("BTD,DF->BTF", h, p["w_up"])  # [B, T, F]
        x = x + dense(jax.nn.silu(gate) * up, p["w_down"], "BTF,FD->BTD")  # [B, T, D]
        return x, state

    def _run_layers(self, x: jax.Array, positions: jax.Array, attend: Callable, carry_state, layers=None,
                    collect: tuple[int, ...] = ()):
        """All decoder layers. `attend(layer, q, k, v, state) -> (out, state)`.

        With `layers` (from `serving_split`) the loop is unrolled over separate arrays (fast
        serving path); without, a `lax.scan` over the stacked weights (fast to compile; training).
        Returns (x, state, collected): `collected` holds the hidden state [B, T, D] after each layer
        count in `collect` (1 .. L; L is the returned x), in that order.
        """
        rope_cs = rope_tables(positions, self.config.head_dim, self.config.rope_theta)  # once, not per layer
        if not all(1 <= i <= self.config.num_layers for i in collect):
            raise ValueError(f"feature layers {collect} must be in 1..{self.config.num_layers}")
        if layers is None and is_serving_only(self):  # loaded straight into the serving layout
            layers = serving_layers(self)
        if layers is not None:
            after = {}
            for index, p in enumerate(layers):
                x, carry_state = self._decoder_layer(p, x, rope_cs, attend, index, carry_state)
                if index + 1 in collect:
                    after[index + 1] = x
            return x, carry_state, tuple(after[i] for i in collect)

        def layer(carry, xs):
            p, index = xs
            x, state = self._decoder_layer(p, carry[0], rope_cs, attend, index, carry[1])
            return (x, state), (x if collect else None)

        xs = (self._layer_params(), jnp.arange(self.config.num_layers, dtype=jnp.int32))
        (x, carry_state), each = jax.lax.scan(layer, (x, carry_state), xs)  # each: [L, B, T, D] or None
        return x, carry_state, tuple(each[i - 1] for i in collect)

    # --- entry points -------------------------------------------------------------

    def __call__(self, tokens: jax.Array, layers: tuple[dict, ...] | None = None) -> jax.Array:
        """Cache-free causal forward: tokens [B, T] -> logits [B, T, V]. For tests and training.
        `layers`: serving weights (`serving_layers`) to run unrolled instead of the stacked ones."""
        return self.unembed(self.hidden_states(tokens, layers))

    def hidden_states(self, tokens: jax.Array, layers: tuple[dict, ...] | None = None) -> jax.Array:
        """Cache-free causal forward to the last hidden state [B, T, D] (before the final norm)."""
        return self.layer_features(tokens, (self.config.num_layers,), layers)

    def layer_features(self, tokens: jax.Array, feature_layers: tuple[int, ...],
                       layers: tuple[dict, ...] | None = None) -> jax.Array:
        """Cache-free causal forward: the hidden states after each layer count in `feature_layers` (1 .. L),
        concatenated: [B, T, len(feature_layers)·D]."""
        b, t = tokens.shape
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))  # [B, T]
        causal = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))  # [B, T, T]

        def attend(index, q, k, v, state):
            return attention(q, k, v, causal), state

        _, _, collected = self._run_layers(self.embed_tokens(tokens), positions, attend, (), layers,
                                           collect=feature_layers)
        return jnp.concatenate(collected, axis=-1)  # [B, T, n·D]

    def forward_cached(self, inputs: StepInputs, cache: KVCache, window: int,
                       logits_at: jax.Array | None = None,
                       layers: tuple[dict, ...] | None = None,
                       mask: WindowMask | None = None,
                       kernels: KernelPlan = XLA_PLAN) -> tuple[jax.Array, KVCache]:
        """Write T new tokens per row into the cache and return their logits.

        Writes positions start..start+T-1 of each row's slot (lengths are NOT changed: the
        caller commits), attends over cache positions [0, window) masked by `window_mask`.
        `logits_at` [B, J] optionally selects which of the T positions to unembed; `layers`
        optionally supplies per-layer weights (see `serving_split`); `mask` replaces the
        step's own `WindowMask(inputs.step_mask, inputs.start, window)` (a draft tree's level calls attend to a
        block of earlier nodes too); `kernels` the forms
        attention and the head take (jaxspec.models.kernel_plan).
        Returns logits [B, T or J, V] (fp32) and the updated cache.
        """
        hidden, cache = self.forward_cached_hidden(inputs, cache, window, layers=layers, mask=mask, kernels=kernels)
        if logits_at is not None:
            # hidden: [B, T, D] -> [B, J, D]
            hidden = jnp.take_along_axis(hidden, logits_at[:, :, None], axis=1)
        return self.unembed(hidden, kernels), cache

    def forward_cached_hidden(self, inputs: StepInputs, cache: KVCache, window: int,
                              layers: tuple[dict, ...] | None = None,
                              embeds: jax.Array | None = None,
                              mask: WindowMask | None = None,
                              kernels: KernelPlan = XLA_PLAN) -> tuple[jax.Array, KVCache]:
        """`forward_cached` up to the last hidden state [B, T, D] (before the final norm: the feature a
        feature draft reads). `embeds` [B, T, D] replaces the token embedding as the first layer's input;
        `mask` [B, T, W] the window mask, as in `forward_cached`.
        The layers are unrolled (one in-place cache buffer per layer)."""
        hidden, _, cache = self._forward_cached(inputs, cache, window, layers, embeds, mask, (), kernels)
        return hidden, cache

    def forward_cached_features(self, inputs: StepInputs, cache: KVCache, window: int,
                                feature_layers: tuple[int, ...],
                                layers: tuple[dict, ...] | None = None,
                                kernels: KernelPlan = XLA_PLAN) -> tuple[jax.Array, jax.Array, KVCache]:
        """`forward_cached_hidden` that also returns the hidden states after each layer count in
        `feature_layers` (1 .. L), concatenated: (hidden [B, T, D], features [B, T, n·D], cache)."""
        hidden, collected, cache = self._forward_cached(inputs, cache, window, layers, None, None, feature_layers,
                                                        kernels)
        return hidden, jnp.concatenate(collected, axis=-1), cache

    def _forward_cached(self, inputs: StepInputs, cache: KVCache | PagedKVCache, window: int, layers, embeds, mask,
                        collect: tuple[int, ...],
                        kernels: KernelPlan) -> tuple[jax.Array, tuple[jax.Array, ...], KVCache | PagedKVCache]:
        b, t = inputs.tokens.shape
        paged = isinstance(cache, PagedKVCache)
        if paged:
            if inputs.block_table is None:
                raise ValueError("a paged cache needs StepInputs.block_table")
            if inputs.block_table.shape != (b, -(-window // cache.page_size)):
                raise ValueError(f"block table {inputs.block_table.shape} must be [B, ceil(W/X)] = "
                                 f"{(b, -(-window // cache.page_size))}")
        elif window > cache.max_len:
            raise ValueError(f"attention window {window} exceeds cache max_len {cache.max_len}")
        positions = inputs.start[:, None] + inputs.depth  # [B, T] RoPE positions
        write_pos = inputs.start[:, None] + jnp.arange(t, dtype=jnp.int32)  # [B, T] cache positions
        mask = WindowMask(inputs.step_mask, inputs.start, window) if mask is None else mask
        dense = mask.dense()  # [B, T, W] (the kernels that read the cache in place on GPU take `mask` itself)
        if paged:  # where the new tokens go: [B, T] pages and offsets within them
            rows, columns = page_slots(inputs.block_table, write_pos, cache.page_size)
        else:  # [B, 1] slots, [B, T] positions
            rows, columns = inputs.slot_ids[:, None], write_pos
        if layers is None:  # static per-layer views of the stacked weights (drafts, tests)
            stacked = self._layer_params()
            layers = tuple({name: w[i] for name, w in stacked.items()} for i in range(self.config.num_layers))

        # the attention form of the kernel plan for T new tokens a row (jaxspec.models.kernel_plan): a kernel that
        # reads each row's window in place, or the XLA form over the gathered window
        form = kernels.attention_form(t)

        def attend(index, q, k, v, kv):
            ks, vs = kv
            # write this layer's new k/v, then read the window from the same (in-place) buffer:
            # k [B, T, G, H] into [I, X, G, H] pages (paged) or [S+1, M, G, H] slots
            ck = ks[index].at[rows, columns].set(k.astype(ks[index].dtype), mode="drop")
            cv = vs[index].at[rows, columns].set(v.astype(vs[index].dtype), mode="drop")
            ks = ks[:index] + (ck,) + ks[index + 1:]
            vs = vs[:index] + (cv,) + vs[index + 1:]
            return self._attend_window(q, ck, cv, inputs, mask, dense, form, kernels), (ks, vs)

        x = self.embed_tokens(inputs.tokens) if embeds is None else embeds  # [B, T, D]
        x, (ks, vs), collected = self._run_layers(x, positions, attend, (cache.k, cache.v), layers, collect)
        return x, collected, dataclasses.replace(cache, k=ks, v=vs)

    @staticmethod
    def _attend_window(q: jax.Array, ck: jax.Array, cv: jax.Array, inputs: StepInputs, mask: WindowMask,
                       dense: jax.Array, form: str, kernels: KernelPlan) -> jax.Array:
        """q [B, T, N, H] over positions [0, W) of each row (its pages `inputs.block_table` of ck, cv [I, X, G, H],
        or its slot of ck, cv [S+1, M, G, H]) in the form the plan gives -> [B, T, N, H]."""
        table, window = inputs.block_table, mask.window
        if form == "cpu-cache-kernel":  # read in place by the XLA:CPU kernel
            if table is None:
                return cache_attention(q, ck, cv, inputs.slot_ids, dense)
            return paged_cache_attention(q, ck, cv, table, dense)
        if form == "pallas":  # read in place by the Pallas kernel
            if table is None:  # the pages of the slot (identity block table)
                return slot_attention(q, ck, cv, inputs.slot_ids, mask, interpret=kernels.interpret)
            return paged_attention(q, ck, cv, table, mask, interpret=kernels.interpret)
        if table is None:
            kw, vw = ck[inputs.slot_ids, :window], cv[inputs.slot_ids, :window]  # [B, W, G, H]
        else:
            kw, vw = gather_window(ck, table, window), gather_window(cv, table, window)  # [B, W, G, H]
        return attention(q, kw, vw, dense, kernels.xla_block_diagonal)


# --- conversion from / to Hugging Face layout ------------------------------------------


def _hf_layer_tensors(config: ModelConfig, tensor: Callable[[str], np.ndarray], i: int,
                      dtype: np.dtype = np.dtype(np.float32)) -> dict[str, np.ndarray]:
    """Layer `i` in our unfused layout (`LAYER_WEIGHTS` shapes, host arrays of `dtype`).

    `tensor(hf_name)` gives one HF-layout tensor ([out, in]); each is cast to `dtype` as soon as it is
    read, so a caller that reads tensors lazily holds at most one of them in its source precision.
    """
    c = config
    N, G, H, D = c.num_heads, c.num_kv_heads, c.head_dim, c.hidden_size
    pre = f"model.layers.{i}."
    get = lambda name: np.asarray(tensor(pre + name)).astype(dtype, copy=False)  # noqa: E731
    out = {
        "attn_norm": get("input_layernorm.weight"),  # [D]
        # HF [out, in] -> ours [in, heads, head_dim]
        "wq": get("self_attn.q_proj.weight").T.reshape(D, N, H),  # [N*H, D] -> [D, N, H]
        "wk": get("self_attn.k_proj.weight").T.reshape(D, G, H),  # [G*H, D] -> [D, G, H]
        "wv": get("self_attn.v_proj.weight").T.reshape(D, G, H),  # [G*H, D] -> [D, G, H]
        "wo": get("self_attn.o_proj.weight").T.reshape(N, H, D),  # [D, N*H] -> [N, H, D]
        "mlp_norm": get("post_attention_layernorm.weight"),  # [D]
        "w_gate": get("mlp.gate_proj.weight").T,  # [F, D] -> [D, F]
        "w_up": get("mlp.up_proj.weight").T,  # [F, D] -> [D, F]
        "w_down": get("mlp.down_proj.weight").T,  # [D, F] -> [F, D]
    }
    if c.qkv_bias:
        out["bq"] = get("self_attn.q_proj.bias").reshape(N, H)  # [N*H] -> [N, H]
        out["bk"] = get("self_attn.k_proj.bias").reshape(G, H)  # [G*H] -> [G, H]
        out["bv"] = get("self_attn.v_proj.bias").reshape(G, H)  # [G*H] -> [G, H]
    return out


def from_hf_state_dict(config: ModelConfig, sd: dict[str, np.ndarray]) -> Llama:
    """Build a Llama from a Hugging Face-named state dict (float arrays, [out, in] layout).

    Stacks the whole model in float32 on the host; serving loads stream instead
    (`jaxspec.models.loading.streaming`, which builds a `serving_only_model`).
    """
    model = nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0)))
    dtype = jnp.dtype(config.dtype)
    missing = [k for k in _expected_hf_keys(config) if k not in sd]
    if missing:
        raise KeyError(f"state dict is missing {len(missing)} tensors, e.g. {missing[:3]}")
    layers = [_hf_layer_tensors(config, sd.__getitem__, i) for i in range(config.num_layers)]
    values = {name: np.stack([layer[name] for layer in layers]) for name in layers[0]}  # each [L, ...]
    values["embed"] = np.asarray(sd["model.embed_tokens.weight"], np.float32)  # [V, D]
    values["final_norm"] = np.asarray(sd["model.norm.weight"], np.float32)  # [D]
    if not config.tie_embeddings:
        values["lm_head"] = np.asarray(sd["lm_head.weight"], np.float32).T  # [V, D] -> [D, V]
    for name, value in values.items():
        param = getattr(model, name)
        if tuple(param.value.shape) != value.shape:
            raise ValueError(f"{name}: expected shape {tuple(param.value.shape)}, got {value.shape}")
        param.value = jnp.asarray(value, dtype)
    return model


def serving_only_model(config: ModelConfig, placement: Placement, layers: tuple[dict, ...],
                       others: dict[str, jax.Array | np.ndarray]) -> Llama:
    """A Llama that exists only in its serving layout for `placement` (`is_serving_only`).

    `layers`: per-layer weights from `fuse_layer`, already placed by `placement`; `others`: arrays
    of `config.dtype` for embed [V, D], final_norm [D] and (untied) lm_head [D, V]. The stacked
    weights are zero-size placeholders; the split is registered (`register_serving_split`), so
    `serving_split(model, placement)` returns it, and the model's own embed / final_norm / lm_head
    are the placed arrays (no second copy).
    """
    model = nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0)))
    dtype = jnp.dtype(config.dtype)
    if len(layers) != config.num_layers:
        raise ValueError(f"expected {config.num_layers} layers, got {len(layers)}")
    for name in model.stacked_weight_names():
        getattr(model, name).value = jnp.zeros((0,), dtype)  # [0] placeholder
    names = ("embed", "final_norm") + (() if config.tie_embeddings else ("lm_head",))
    if set(others) != set(names):
        raise ValueError(f"expected weights {sorted(names)}, got {sorted(others)}")
    for name in names:
        param, value = getattr(model, name), others[name]
        if tuple(param.value.shape) != value.shape or value.dtype != dtype:
            raise ValueError(f"{name}: expected {dtype} {tuple(param.value.shape)}, got {value.dtype} {value.shape}")
        param.value = value
    register_serving_split(model, placement, layers)
    params = serving_split(model, placement)[1][0]
    for name in names:  # keep the registered copies, drop the given ones
        getattr(model, name).value = params[name].value
    return model


def to_hf_state_dict(model: Llama) -> dict[str, np.ndarray]:
    """Export parameters in Hugging Face naming and [out, in] layout (float32 numpy)."""
    c = model.config
    N, G, H, D = c.num_heads, c.num_kv_heads, c.head_dim, c.hidden_size
    arr = lambda name: np.asarray(getattr(model, name).value, np.float32)  # noqa: E731
    sd = {"model.embed_tokens.weight": arr("embed"), "model.norm.weight": arr("final_norm")}
    if not c.tie_embeddings:
        sd["lm_head.weight"] = arr("lm_head").T
    stacked = {name: arr(name) for name in LAYER_WEIGHTS + (LAYER_BIASES if c.qkv_bias else ())}
    for i in range(c.num_layers):
        pre = f"model.layers.{i}."
        sd[pre + "input_layernorm.weight"] = stacked["attn_norm"][i]
        sd[pre + "post_attention_layernorm.weight"] = stacked["mlp_norm"][i]
        sd[pre + "self_attn.q_proj.weight"] = stacked["wq"][i].reshape(D, N * H).T
        sd[pre + "self_attn.k_proj.weight"] = stacked["wk"][i].reshape(D, G * H).T
        sd[pre + "self_attn.v_proj.weight"] = stacked["wv"][i].reshape(D, G * H).T
        sd[pre + "self_attn.o_proj.weight"] = stacked["wo"][i].reshape(N * H, D).T
        sd[pre + "mlp.gate_proj.weight"] = stacked["w_gate"][i].T
        sd[pre + "mlp.up_proj.weight"] = stacked["w_up"][i].T
        sd[pre + "mlp.down_proj.weight"] = stacked["w_down"][i].T
        if c.qkv_bias:
            sd[pre + "self_attn.q_proj.bias"] = stacked["bq"][i].reshape(N * H)
            sd[pre + "self_attn.k_proj.bias"] = stacked["bk"][i].reshape(G * H)
            sd[pre + "self_attn.v_proj.bias"] = stacked["bv"][i].reshape(G * H)
    return {k: np.ascontiguousarray(v) for k, v in sd.items()}


def _expected_hf_keys(config: ModelConfig) -> list[str]:
    keys = ["model.embed_tokens.weight", "model.norm.weight"]
    if not config.tie_embeddings:
        keys.append("lm_head.weight")
    for i in range(config.num_layers):
        pre = f"model.layers.{i}."
        keys += [pre + n for n in ("input_layernorm.weight", "post_attention_layernorm.weight",
                                   "self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                   "self_attn.v_proj.weight", "self_attn.o_proj.weight",
                                   "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")]
        if config.qkv_bias:
            keys += [pre + f"self_attn.{p}_proj.bias" for p in "qkv"]
    return keys


def random_model(config: ModelConfig, seed: int = 0) -> Llama:
    """Randomly initialised model (tiny test presets, GPU benchmarks without checkpoints)."""
    return Llama(config, rngs=nnx.Rngs(seed))
