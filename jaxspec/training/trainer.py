"""Training a draft for a target: the optimizer, the KL objective of the token draft and the `Trainer` (optax AdamW,
orbax checkpoints, resumable, tqdm) that both drafts' recipes use (jaxspec.training.distill, .feature_distill)."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxspec.models.draft import DraftLlama

ARTIFACTS = Path("artifacts")  # relative to the working directory: model cache, shards, checkpoints


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 360
    batch: int = 8  # sequences per step
    lr: float = 1e-3
    warmup: int = 20
    end_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    clip: float = 1.0
    seed: int = 0
    ckpt_every: int = 25


def make_optimizer(tc: TrainConfig) -> optax.GradientTransformation:
    schedule = optax.warmup_cosine_decay_schedule(0.0, tc.lr, max(tc.warmup, 1), max(tc.steps, tc.warmup + 1),
                                                  end_value=tc.lr * tc.end_lr_ratio)
    return optax.chain(optax.clip_by_global_norm(tc.clip), optax.adamw(schedule, weight_decay=tc.weight_decay))


def kl_loss(draft: DraftLlama, tokens, mask, top_ids, top_lp, full_to_kept):
    """Mean over masked positions of KL(target || draft) restricted to the target's top-K.

    tokens, mask: [B, T]; top_ids: [B, T, K] target top-K ids; top_lp: [B, T, K] their log-probs;
    full_to_kept: [V] index into the draft's kept vocabulary or -1. Target mass on tokens the draft
    cannot propose is left out (it cannot be matched). Returns (loss, top-1 agreement).
    """
    h = draft.hidden_states(tokens)  # [B, T, D]
    logq = jax.nn.log_softmax(draft.kept_logits(h), axis=-1)  # [B, S, Vk]
    kid = full_to_kept[top_ids]  # [B, T, K]
    lp = top_lp.astype(jnp.float32)
    valid = (kid >= 0) & jnp.isfinite(lp) & mask[..., None]  # [B, T, K]
    lq = jnp.take_along_axis(logq, jnp.maximum(kid, 0), axis=-1)  # [B, T, K]
    lp_safe = jnp.where(valid, lp, 0.0)
    kl = jnp.sum(jnp.where(valid, jnp.exp(lp_safe) * (lp_safe - lq), 0.0), axis=-1)  # [B, T]
    n = jnp.maximum(jnp.sum(mask), 1)
    agree = (jnp.argmax(logq, axis=-1) == kid[..., 0]) & mask  # [B, T]
    return jnp.sum(kl) / n, jnp.sum(agree) / n


class Trainer:
    """Holds the draft's trainable state, the optimizer and the checkpoint manager.

    `loss(draft, *batch, full_to_kept) -> (loss, aux)` over the data `fields` (default: the token draft's
    KL; the feature draft passes its own, jaxspec/training/feature_distill.py). `aux` is the top-1 agreement, a
    scalar or one per depth."""

    def __init__(self, draft: DraftLlama, data: dict[str, np.ndarray], tc: TrainConfig,
                 ckpt_dir: str | Path | None = None, loss=kl_loss,
                 fields: tuple[str, ...] = ("tokens", "mask", "top_ids", "top_lp")):
        self.tc = tc
        self.data = data
        self.loss, self.fields = loss, fields
        self.graphdef, self.params, self.rest = nnx.split(draft, nnx.Param, ...)
        self.tx = make_optimizer(tc)
        self.opt_state = self.tx.init(self.params)
        self.step = 0
        v = draft.config.vocab_size
        f2k = np.full((v,), -1, np.int32)
        keep = np.asarray(draft.keep_ids.value)
        f2k[keep] = np.arange(keep.size, dtype=np.int32)
        self.full_to_kept = jnp.asarray(f2k)
        self.mgr = None
        if ckpt_dir is not None:
            import orbax.checkpoint as ocp

            self.mgr = ocp.CheckpointManager(
                Path(ckpt_dir).absolute(),
                options=ocp.CheckpointManagerOptions(max_to_keep=2, keep_period=100, save_interval_steps=1))
        graphdef, rest, tx, objective = self.graphdef, self.rest, self.tx, self.loss

        def train_step(params, opt_state, batch, full_to_kept):
            def loss_fn(p):
                model = nnx.merge(graphdef, p, rest)
                return objective(model, *batch, full_to_kept)

            (loss, agree), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss, agree

        self._train_step = jax.jit(train_step, donate_argnums=(0, 1))

    def batch_indices(self, step: int) -> np.ndarray:
        """Rows of the step: epoch-wise permutations seeded by (seed, epoch): resumable."""
        n, b = len(self.data["tokens"]), self.tc.batch
        out = []
        for j in range(step * b, step * b + b):
            epoch, i = divmod(j, n)
            out.append(np.random.default_rng((self.tc.seed, epoch)).permutation(n)[i])
        return np.asarray(out)

    def batch(self, step: int):
        idx = self.batch_indices(step)
        return tuple(self.data[name][idx] for name in self.fields)

    def train_step(self) -> tuple[float, float, int]:
        batch = self.batch(self.step)
        self.params, self.opt_state, loss, agree = self._train_step(self.params, self.opt_state, batch,
                                                                    self.full_to_kept)
        self.step += 1
        return float(loss), float(np.mean(agree)), int(batch[1].sum())

    def eval_loss(self, data: dict[str, np.ndarray], max_rows: int = 32, rows_per_call: int = 8):
        """(loss, top-1 agreement) on the first `max_rows` rows of `data`, in calls of `rows_per_call` rows;
        the agreement is a list (one per depth) when the loss reports one per depth."""
        model = self.model()
        fn = jax.jit(lambda m, *b: self.loss(m, *b, self.full_to_kept))
        n = min(max_rows, len(data["tokens"]))
        parts = [fn(model, *(data[name][i:i + rows_per_call] for name in self.fields))
                 for i in range(0, n, rows_per_call)]
        weights = np.asarray([data["mask"][i:i + rows_per_call].sum() for i in range(0, n, rows_per_call)], float)
        weights = weights / max(weights.sum(), 1.0)
        loss = float(sum(w * float(p[0]) for w, p in zip(weights, parts)))
        agree = sum(w * np.asarray(p[1], np.float64) for w, p in zip(weights, parts))
        return loss, (agree.tolist() if np.ndim(agree) else float(agree))

    def model(self) -> DraftLlama:
        return nnx.merge(self.graphdef, self.params, self.rest)

    # --- checkpoints ---------------------------------------------------------------

    def save(self, force: bool = False) -> None:
        if self.mgr is None:
            return
        import orbax.checkpoint as ocp

        self.mgr.save(self.step, args=ocp.args.StandardSave({"params": self.params, "opt_state": self.opt_state}),
                      force=force)
        self.mgr.wait_until_finished()

    def restore_latest(self, step: int | None = None) -> int | None:
        """Resume from the newest checkpoint (or the given step), if any. Returns its step."""
        if self.mgr is None or self.mgr.latest_step() is None:
            return None
        import orbax.checkpoint as ocp

        step = self.mgr.latest_step() if step is None else step
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, {"params": self.params, "opt_state": self.opt_state})
        restored = self.mgr.restore(step, args=ocp.args.StandardRestore(abstract))
        self.params, self.opt_state, self.step = restored["params"], restored["opt_state"], step
        return step

    def fit(self, progress: bool = True, log=None) -> list[dict]:
        from tqdm import tqdm

        history = []
        bar = tqdm(total=self.tc.steps, initial=self.step, desc="distill", unit="step", disable=not progress)
        while self.step < self.tc.steps:
            t0 = time.time()
            loss, agree, ntok = self.train_step()
            dt = time.time() - t0
            rec = {"step": self.step, "loss": loss, "top1": agree, "tok_s": ntok / dt, "time": time.time()}
            history.append(rec)
            if log is not None:
                log.write(json.dumps(rec) + "\n")
                log.flush()
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.3f}", top1=f"{agree:.3f}", tok_s=f"{ntok / dt:.0f}")
            if self.step % self.tc.ckpt_every == 0 or self.step == self.tc.steps:
                self.save()
        bar.close()
        return history


def load_target(spec):
    """(the target as a Llama, its LoadedModel), cached under artifacts/model_cache."""
    from jaxspec.models.llama import from_hf_state_dict
    from jaxspec.models.loading.registry import load_model

    loaded = load_model(spec, cache_dir=ARTIFACTS / "model_cache")
    return from_hf_state_dict(loaded.config, loaded.state_dict), loaded


