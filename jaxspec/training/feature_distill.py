"""`jaxspec distill --kind feature`: train the feature draft (jaxspec/models/feature_draft.py) of a target.

Recipe (docs/drafts.md, "The feature draft"):
  1. data: the token draft's prompts and held-out split (jaxspec.training.distill_data), with the target's features
     stored next to its top-K log-probs: on-policy greedy continuations, then teacher-forced ShareGPT answers.
  2. model: one decoder layer at the target's width, initialised from the target's last layer; the target's
     embedding, final norm and (pruned) LM head are shared and frozen.
  3. loss over U training-time-test passes (`FeatureDraft.ttt_features`: pass j is the depth-j proposal):
     KL(target || draft) over the target's top-K + `reg_weight` x smooth L1 between the normalised predicted
     and real features, mean over passes.
  4. optax AdamW, orbax checkpoints, resumable, tqdm (jaxspec.training.trainer.Trainer); a held-out top-1 agreement
     per depth (the greedy acceptance of depth j given depths < j accepted).
  5. output: jaxspec/drafts/<target>/feature/ (draft.json + weights.npz, fp16 own weights).

Public API: feature_loss, run. The architecture and the draft files: jaxspec.engine.draft_artifacts.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.engine.draft_artifacts import (
    FEATURE_REBUILD_COMMAND,
    FeatureArch,
    build_feature_draft,
    save_feature_draft,
    shipped_feature_draft_dir,
)
from jaxspec.models.feature_draft import FeatureDraft
from jaxspec.models.llama import rms_norm
from jaxspec.training import distill_data as dd
from jaxspec.training.prompts import prompt_flags, training_prompts
from jaxspec.training.trainer import ARTIFACTS, TrainConfig, Trainer, load_target


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


# --- the recipe -----------------------------------------------------------------------------


def heldout_agreement(trainer, data: dict[str, np.ndarray], max_rows: int = 64) -> tuple[float, list[float]]:
    """(loss, top-1 agreement per depth) on held-out rows."""
    loss, agree = trainer.eval_loss(data, max_rows=max_rows)
    return loss, [round(a, 4) for a in agree]


def run(args: argparse.Namespace) -> int:
    """The recipe above with the flags of `jaxspec distill` (jaxspec.training.cli)."""
    t_start = time.time()
    arch = FeatureArch(num_layers=args.feature_layers, vocab_keep=args.vocab_keep or FeatureArch.vocab_keep,
                       passes=args.ttt_passes, reg_weight=args.reg_weight, feature_layers=args.feature_fuse)
    target, loaded = load_target(args.model)
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
    meta = {"recipe": {"command": f"{FEATURE_REBUILD_COMMAND} --steps {args.steps} --batch {args.batch} --lr {args.lr} "
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
