"""`jaxspec distill --kind feature`: train the feature draft (models/feature_draft.py) of a target.

Recipe (docs/drafts.md, "The feature draft"):
  1. data: the token draft's prompts and held-out split (jaxspec.distill_data), with the target's features
     stored next to its top-K log-probs: on-policy greedy continuations, then teacher-forced ShareGPT answers.
  2. model: one decoder layer at the target's width, initialised from the target's last layer; the target's
     embedding, final norm and (pruned) LM head are shared and frozen.
  3. loss over U training-time-test passes (`FeatureDraft.ttt_features`: pass j is the depth-j proposal):
     KL(target || draft) over the target's top-K + `reg_weight` x smooth L1 between the normalised predicted
     and real features, mean over passes.
  4. optax AdamW, orbax checkpoints, resumable, tqdm (jaxspec.distill.Trainer); a held-out top-1 agreement
     per depth (the greedy acceptance of depth j given depths < j accepted).
  5. output: jaxspec/drafts/<target>/feature/ (draft.json + weights.npz, fp16 own weights).

Public API: FeatureArch, build_feature_draft, feature_loss, save_feature_draft, load_feature_draft,
load_shipped_feature_draft, run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxspec.resources import shipped_draft_dir
from models.config import ModelConfig
from models.draft import load_trainable_state, trainable_state
from models.feature_draft import FeatureDraft, feature_draft_config
from models.llama import Llama, rms_norm

FORMAT = "jaxspec-feature-draft"
SUBDIR = "feature"  # jaxspec/drafts/<target>/feature/
REBUILD_COMMAND = "jaxspec distill --kind feature"


@dataclasses.dataclass(frozen=True)
class FeatureArch:
    """The feature draft's shape and loss: `num_layers` decoder layers at the target's width, reading the
    target's hidden states after `feature_layers` (None: its last layer only, EAGLE-1; e.g. (2, 15, 30): EAGLE-3's
    low/mid/high fusion, the last entry the target's last layer)."""

    num_layers: int = 1
    vocab_keep: int | None = 8192  # None: the full vocabulary
    passes: int = 3  # training-time-test depth U
    reg_weight: float = 1.0  # weight of the feature regression next to the KL
    feature_layers: tuple[int, ...] | None = None

    @classmethod
    def from_dict(cls, raw: dict) -> FeatureArch:
        fields = {f.name: raw[f.name] for f in dataclasses.fields(cls) if f.name in raw}
        if fields.get("feature_layers") is not None:
            fields["feature_layers"] = tuple(fields["feature_layers"])
        return cls(**fields)

    def layers_for(self, target: ModelConfig) -> tuple[int, ...]:
        """The target layer counts read, checked against the target (the last must be its last layer)."""
        layers = self.feature_layers or (target.num_layers,)
        if layers[-1] != target.num_layers or not all(1 <= i <= target.num_layers for i in layers):
            raise ValueError(f"feature layers {layers} must lie in 1..{target.num_layers} and end with "
                             f"{target.num_layers}, the target's last layer (what the draft predicts)")
        return tuple(layers)


def _target_head(target: Llama) -> jax.Array | None:
    """The target's output head as [V, D] rows when it is not its tied embedding (else None)."""
    return None if target.config.tie_embeddings else target.lm_head.value.T


def build_feature_draft(target: Llama, arch: FeatureArch, keep_ids=None, seed: int = 0) -> FeatureDraft:
    """A feature draft sharing the target's embedding and head; layers initialised from its last layers."""
    draft = FeatureDraft(feature_draft_config(target.config, arch.num_layers), embed=target.embed.value,
                         feature_layers=arch.layers_for(target.config), head=_target_head(target),
                         keep_ids=keep_ids, rngs=nnx.Rngs(seed))
    idx = np.arange(target.config.num_layers - arch.num_layers, target.config.num_layers)
    for name in draft.stacked_weight_names():
        getattr(draft, name).value = getattr(target, name).value[idx]
    draft.final_norm.value = jnp.copy(target.final_norm.value)  # a copy: training donates its params
    return draft


def feature_loss(draft: FeatureDraft, tokens, mask, top_ids, top_lp, features, full_to_kept, *, passes: int,
                 reg_weight: float):
    """Mean over the U passes of KL(target || draft) over the target's top-K + reg_weight x smooth L1 of the
    normalised features, each over the positions a depth-j proposal exists for (p >= j-1, masked).

    tokens, mask: [B, T]; top_ids, top_lp: [B, T, K]; features: [B, T, n·D] the target's at the draft's feature
    layers (the last D: its last layer, what the draft predicts); full_to_kept: [V].
    Returns (loss, top-1 agreement per depth [U])."""
    eps = draft.config.rms_norm_eps
    predicted = draft.ttt_features(tokens, features.astype(jnp.float32), passes)  # [U, B, T, D]
    real = features[..., -draft.config.hidden_size:].astype(jnp.float32)  # [B, T, D] the last layer's
    kid = full_to_kept[top_ids]  # [B, T, K]
    lp = top_lp.astype(jnp.float32)
    unit = jnp.ones((real.shape[-1],), jnp.float32)
    real_n = rms_norm(real, unit, eps)  # [B, T, D]
    t = tokens.shape[1]
    losses, agreements = [], []
    for j in range(passes):
        at = mask & (jnp.arange(t)[None, :] >= j)  # [B, T] depth j+1 has an anchor s = p - j >= 0
        valid = (kid >= 0) & jnp.isfinite(lp) & at[..., None]  # [B, T, K]
        logq = jax.nn.log_softmax(draft.kept_logits(predicted[j]), axis=-1)  # [B, T, Vk]
        lq = jnp.take_along_axis(logq, jnp.maximum(kid, 0), axis=-1)  # [B, T, K]
        lp_safe = jnp.where(valid, lp, 0.0)
        kl = jnp.sum(jnp.where(valid, jnp.exp(lp_safe) * (lp_safe - lq), 0.0), axis=-1)  # [B, T]
        diff = rms_norm(predicted[j], unit, eps) - real_n  # [B, T, D]
        smooth_l1 = jnp.mean(jnp.where(jnp.abs(diff) < 1.0, 0.5 * diff * diff, jnp.abs(diff) - 0.5), axis=-1)
        n = jnp.maximum(jnp.sum(at), 1)
        losses.append((jnp.sum(kl) + reg_weight * jnp.sum(jnp.where(at, smooth_l1, 0.0))) / n)
        agreements.append(jnp.sum((jnp.argmax(logq, axis=-1) == kid[..., 0]) & at) / n)
    return sum(losses) / passes, jnp.stack(agreements)


# --- saving / loading -----------------------------------------------------------------------


def save_feature_draft(out_dir: str | Path, draft: FeatureDraft, arch: FeatureArch, target_config: ModelConfig,
                       meta: dict | None = None, dtype=np.float16) -> Path:
    """draft.json (architecture, recipe, metrics) + weights.npz (own weights, kept ids)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    weights = {k: v.astype(dtype) for k, v in trainable_state(draft).items()}
    weights["keep_ids"] = np.asarray(draft.keep_ids.value, np.int32)
    np.savez(out / "weights.npz", **weights)
    own = int(sum(v.size for k, v in weights.items() if k != "keep_ids"))
    info = {"format": FORMAT, "version": 1, "arch": dataclasses.asdict(arch),
            "target": {"name": target_config.name, "vocab_size": target_config.vocab_size,
                       "hidden_size": target_config.hidden_size, "num_layers": target_config.num_layers},
            "num_kept": draft.num_kept, "own_params": own, **(meta or {})}
    (out / "draft.json").write_text(json.dumps(info, indent=2, default=str) + "\n")
    return out


def load_feature_draft(path: str | Path, target: Llama) -> FeatureDraft:
    """A feature draft saved by `save_feature_draft`, sharing `target`'s embedding and head."""
    path = Path(path)
    info_file = path / "draft.json"
    if not info_file.is_file():
        raise FileNotFoundError(f"no feature draft at {path} (draft.json missing); build it with: {REBUILD_COMMAND}")
    info = json.loads(info_file.read_text())
    if info.get("format") != FORMAT:
        raise ValueError(f"{path}: not a jaxspec feature draft (format {info.get('format')!r})")
    t = info["target"]
    if (t["vocab_size"], t["hidden_size"]) != (target.config.vocab_size, target.config.hidden_size):
        raise ValueError(f"{path}: feature draft was trained for {t['name']} (vocab {t['vocab_size']}, width "
                         f"{t['hidden_size']}), not {target.config.name}")
    arch = FeatureArch.from_dict(info["arch"])
    with np.load(path / "weights.npz") as z:
        weights = {k: z[k] for k in z.files}
    keep = weights.pop("keep_ids")
    draft = FeatureDraft(feature_draft_config(target.config, arch.num_layers), embed=target.embed.value,
                         feature_layers=arch.layers_for(target.config), head=_target_head(target), keep_ids=keep,
                         rngs=nnx.Rngs(0))
    return load_trainable_state(draft, {k: v.astype(np.float32) for k, v in weights.items()})


def shipped_feature_draft_dir(target_name: str) -> Path:
    return shipped_draft_dir(target_name) / SUBDIR


def load_shipped_feature_draft(target: Llama) -> FeatureDraft:
    """The shipped feature draft (`--proposer draft --draft feature`) of `target`."""
    return load_feature_draft(shipped_feature_draft_dir(target.config.name), target)


# --- the recipe -----------------------------------------------------------------------------


def heldout_agreement(trainer, data: dict[str, np.ndarray], max_rows: int = 64) -> tuple[float, list[float]]:
    """(loss, top-1 agreement per depth) on held-out rows."""
    loss, agree = trainer.eval_loss(data, max_rows=max_rows)
    return loss, [round(a, 4) for a in agree]


def run(args: argparse.Namespace) -> int:
    """The recipe above with the flags of `jaxspec distill` (jaxspec.distill.add_arguments)."""
    from jaxspec import distill_data as dd
    from jaxspec.distill import ARTIFACTS, TrainConfig, Trainer, _load_target, prompt_flags, training_prompts

    t_start = time.time()
    arch = FeatureArch(num_layers=args.feature_layers, vocab_keep=args.vocab_keep or FeatureArch.vocab_keep,
                       passes=args.ttt_passes, reg_weight=args.reg_weight, feature_layers=args.feature_fuse)
    target, loaded = _load_target(args.model)
    feature_layers = arch.layers_for(target.config)
    tok, tconf = loaded.tokenizer, loaded.config
    work = Path(args.work or ARTIFACTS / "distill" / f"feature{arch.num_layers}")
    fused = "" if arch.feature_layers is None else "-layers" + "-".join(map(str, feature_layers))
    data_dir = Path(args.data or work.parent / f"data-features-{tconf.name}{fused}")
    out = Path(args.out or shipped_feature_draft_dir(tconf.name))
    progress = not args.no_progress

    prompts = training_prompts(tok, args)
    shards = dd.build_shards(target, prompts, data_dir, tconf.eos_token_ids, rows=args.rows,
                             prompt_len=args.prompt_len, gen_len=args.gen_len, top_k=args.top_k,
                             time_budget_s=args.data_minutes * 60, progress=progress,
                             feature_layers=feature_layers)
    if len(shards) < 2:
        raise SystemExit(f"need at least 2 on-policy shards (one is held out); got {len(shards)}: raise --data-minutes")
    heldout, train_shards = dd.load_shards(shards[-1:]), shards[:-1]
    if args.tf_sequences > 0:
        seqs = dd.chat_transcripts(tok, args.tf_sequences, args.prompt_len + args.gen_len)
        train_shards = train_shards + dd.build_teacher_forced_shards(
            target, seqs, data_dir, rows=8, seq_len=args.prompt_len + args.gen_len, top_k=args.top_k,
            time_budget_s=args.tf_minutes * 60, progress=progress, feature_layers=feature_layers)
    train = dd.load_shards(train_shards)
    width = len(feature_layers) * tconf.hidden_size
    for name, data in (("training", train), ("held-out", heldout)):
        if data["features"].shape[-1] != width:
            raise SystemExit(f"{name} shards in {data_dir} hold features {data['features'].shape[-1]} wide, not "
                             f"{width} (layers {feature_layers}): they were built for other feature layers; "
                             f"use another --data directory")
    t_data = time.time() - t_start
    keep = None
    if arch.vocab_keep:
        keep = dd.choose_vocab(train, tconf.vocab_size, arch.vocab_keep, always=tconf.eos_token_ids)
        cover = np.isin(train["top_ids"][..., 0][train["mask"]], keep).mean()
        print(f"kept vocabulary: {keep.size} ids, covers {cover:.3f} of the target's top-1 on training data")
    draft = build_feature_draft(target, arch, keep, seed=args.seed)
    tc = TrainConfig(steps=args.steps, batch=args.batch, lr=args.lr, warmup=args.warmup, seed=args.seed,
                     ckpt_every=args.ckpt_every)
    loss = lambda m, *b: feature_loss(m, *b, passes=arch.passes, reg_weight=arch.reg_weight)  # noqa: E731
    trainer = Trainer(draft, train, tc, ckpt_dir=work / "ckpt", loss=loss,
                      fields=("tokens", "mask", "top_ids", "top_lp", "features"))
    resumed = trainer.restore_latest()
    if resumed is not None:
        print(f"resumed from step {resumed}")
    before = heldout_agreement(trainer, heldout)
    work.mkdir(parents=True, exist_ok=True)
    with open(work / "train_log.jsonl", "a") as log:
        trainer.fit(progress=progress, log=log)
    after = heldout_agreement(trainer, heldout)
    meta = {"recipe": {"command": f"{REBUILD_COMMAND} --steps {args.steps} --batch {args.batch} --lr {args.lr} "
                                  f"--prompts {args.prompts} --gen-len {args.gen_len} --top-k {args.top_k} "
                                  f"--data-minutes {args.data_minutes} --tf-minutes {args.tf_minutes} "
                                  f"--tf-sequences {args.tf_sequences} --ttt-passes {arch.passes} "
                                  f"--reg-weight {arch.reg_weight} --feature-layers {arch.num_layers}"
                                  + (f" --feature-fuse {','.join(map(str, feature_layers))}" if arch.feature_layers
                                     else "") + prompt_flags(args),
                       "train_sequences": int(len(train["tokens"])), "onpolicy_shards": len(shards) - 1,
                       "tf_shards": len(train_shards) - len(shards) + 1, "train_tokens": int(train["mask"].sum()),
                       "data_seconds": round(t_data), "total_seconds": round(time.time() - t_start)},
            "heldout_loss_top1_per_depth_before": before, "heldout_loss_top1_per_depth_after": after,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    save_feature_draft(out, trainer.model(), arch, tconf, meta)
    print(json.dumps({"out": str(out), **meta}, indent=2))
    return 0
