"""`jaxspec distill`: train a hardware-efficient draft for a target (arXiv 2402.01528).

Recipe (see docs/drafts.md):
  1. prompts: first user turns of ShareGPT (+ a few HumanEval stubs), chat-templated;
     held-out conversations (crc32(id) % 10 == 0) are never trained on.
  2. the target writes greedy continuations and its top-K next-token log-probs at every
     position; cached on disk in shards (jaxspec.distill_data), resumable.
  3. the draft (DraftLlama: shared frozen target embedding, pruned output vocabulary, layers
     from a YAML architecture, optionally initialised from target layers) is trained on
     KL(target || draft) over the target's top-K, with optax AdamW (warm-up + cosine decay,
     global-norm clipping), orbax checkpoints every N steps (a rerun resumes from the last).
  4. the draft is saved as `draft.json` + `weights.npz` (fp16, own weights only).

Public API: add_arguments, run, DraftArch, build_draft, Trainer, save_draft, load_draft,
load_shipped_draft, measure_engine.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxspec.resources import draft_arch_file, draft_archs, shipped_draft_dir
from models.config import ModelConfig
from models.draft import DraftLlama, load_trainable_state, trainable_state
from models.llama import Llama

ARTIFACTS = Path("artifacts")  # relative to the working directory: model cache, shards, checkpoints
DEFAULT_ARCH = "wide2"
FORMAT = "jaxspec-draft"
REBUILD_COMMAND = "jaxspec distill  (or: PYTHONPATH=. python -m jaxspec.distill)"


# --- architecture -----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DraftArch:
    """A draft architecture (jaxspec/configs/drafts/*.yaml). Width = hidden_size; the embedding
    width is the target's (projections are added when they differ)."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_keep: int | None = None  # None: the full vocabulary
    init_layers: tuple[int, ...] | None = None  # target layers to copy (needs the target's shapes)

    @classmethod
    def load(cls, spec: str | Path) -> DraftArch:
        """A YAML path, or a name under jaxspec/configs/drafts/."""
        import yaml

        path = Path(spec)
        if not path.is_file():
            path = draft_arch_file(str(spec))  # FileNotFoundError naming the known architectures
        raw = yaml.safe_load(path.read_text()) or {}
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> DraftArch:
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = set(raw) - fields
        if unknown:
            raise ValueError(f"unknown draft architecture keys: {sorted(unknown)}")
        raw = dict(raw)
        if raw.get("init_layers") is not None:
            raw["init_layers"] = tuple(int(i) for i in raw["init_layers"])
        return cls(**raw)

    def model_config(self, target: ModelConfig) -> ModelConfig:
        return target.replace(name=f"{target.name}-draft-{self.name}", num_layers=self.num_layers,
                              hidden_size=self.hidden_size, num_heads=self.num_heads,
                              num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                              intermediate_size=self.intermediate_size, tie_embeddings=True,
                              qkv_bias=target.qkv_bias)

    def own_params(self, embed_dim: int) -> int:
        """Trainable parameters (the shared embedding and kept-row head not counted)."""
        d, f = self.hidden_size, self.intermediate_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        per_layer = d * q * 2 + 2 * d * kv + 3 * d * f + 2 * d
        proj = 2 * embed_dim * d if d != embed_dim else 0
        return self.num_layers * per_layer + d + proj


def build_draft(target: Llama, arch: DraftArch, keep_ids=None, seed: int = 0) -> DraftLlama:
    """A draft sharing `target`'s embedding; initialised from target layers if arch says so."""
    config = arch.model_config(target.config)
    draft = DraftLlama(config, embed=target.embed.value, keep_ids=keep_ids, rngs=nnx.Rngs(seed))
    if arch.init_layers:
        tc = target.config
        same = (arch.hidden_size, arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.intermediate_size) == (
            tc.hidden_size, tc.num_heads, tc.num_kv_heads, tc.head_dim, tc.intermediate_size)
        if not same or len(arch.init_layers) != arch.num_layers:
            raise ValueError("init_layers needs the target's layer shapes and one index per draft layer")
        idx = np.asarray(arch.init_layers)
        for name in draft.stacked_weight_names():
            getattr(draft, name).value = getattr(target, name).value[idx]
        draft.final_norm.value = jnp.copy(target.final_norm.value)  # a copy: training donates its params
    return draft


# --- training ---------------------------------------------------------------------------


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
    KL; the feature draft passes its own, jaxspec/feature_distill.py). `aux` is the top-1 agreement, a
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


# --- saving / loading a trained draft ---------------------------------------------------


def save_draft(out_dir: str | Path, draft: DraftLlama, arch: DraftArch, target_config: ModelConfig,
               meta: dict | None = None, dtype=np.float16) -> Path:
    """draft.json (architecture, kept ids count, recipe, metrics) + weights.npz (own weights)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    weights = {k: v.astype(dtype) for k, v in trainable_state(draft).items()}
    weights["keep_ids"] = np.asarray(draft.keep_ids.value, np.int32)
    np.savez(out / "weights.npz", **weights)
    info = {"format": FORMAT, "version": 1, "arch": dataclasses.asdict(arch),
            "target": {"name": target_config.name, "vocab_size": target_config.vocab_size,
                       "hidden_size": target_config.hidden_size},
            "num_kept": draft.num_kept, "own_params": arch.own_params(draft.embed_dim), **(meta or {})}
    (out / "draft.json").write_text(json.dumps(info, indent=2, default=str) + "\n")
    return out


def load_draft(path: str | Path, target: Llama) -> DraftLlama:
    """A draft saved by `save_draft`, sharing `target`'s embedding."""
    path = Path(path)
    info = json.loads((path / "draft.json").read_text())
    if info.get("format") != FORMAT:
        raise ValueError(f"{path}: not a jaxspec draft")
    t = info["target"]
    if (t["vocab_size"], t["hidden_size"]) != (target.config.vocab_size, target.config.hidden_size):
        raise ValueError(f"{path}: draft was trained for {t['name']} (vocab {t['vocab_size']}, width "
                         f"{t['hidden_size']}), not {target.config.name}")
    arch = DraftArch.from_dict(info["arch"])
    with np.load(path / "weights.npz") as z:
        weights = {k: z[k] for k in z.files}
    keep = weights.pop("keep_ids")
    draft = DraftLlama(arch.model_config(target.config), embed=target.embed.value, keep_ids=keep,
                       rngs=nnx.Rngs(0))
    return load_trainable_state(draft, {k: v.astype(np.float32) for k, v in weights.items()})


def shipped_draft_path(target_config: ModelConfig) -> Path:
    return shipped_draft_dir(target_config.name)


def load_shipped_draft(target_config: ModelConfig, target: Llama | None = None) -> DraftLlama:
    """The default draft (`--draft default`) for `target_config`; `target` supplies the shared
    embedding (loaded with load_model(None) when omitted and the target is the default)."""
    path = shipped_draft_path(target_config)
    if not (path / "draft.json").is_file():
        raise FileNotFoundError(f"no shipped draft for {target_config.name!r} at {path}; build it with: "
                                f"{REBUILD_COMMAND}")
    if target is None:
        from models.llama import from_hf_state_dict
        from models.loading.registry import load_model

        loaded = load_model(target_config.name)
        target = from_hf_state_dict(loaded.config, loaded.state_dict)
    if target.config.vocab_size != target_config.vocab_size:
        raise ValueError("target does not match target_config")
    return load_draft(path, target)


# --- evaluation through the real engine -------------------------------------------------


@dataclasses.dataclass
class EngineMeasure:
    """Definitions (row-steps = one row in one engine step):
    alpha       per-token acceptance = P(draft token accepted | all before it accepted), the
                geometric-model MLE Σ accepted / (Σ accepted + #row-steps with a rejection);
                this is the α of E(k) = (1 - α^(k+1)) / (1 - α) (docs/design.md, "The goodput policy"). Equals
                accept_rate at k = 1.
    accept_rate Σ accepted / Σ proposed (fraction of proposed draft tokens kept; falls with k).
    tokens_per_step  Σ emitted / #row-steps.
    depth_acceptance  per depth j = 1..k, P(proposal j accepted | proposals < j accepted), over the
                row-steps that verified all k proposals (`full_steps[a]`: how many of them accepted a).
    tok_s       emitted decode tokens / decode wall time (prefill excluded).
    cpu_tok_s   emitted decode tokens / this process's CPU time over the same span (all threads):
                on a shared machine the fairer throughput when other jobs steal cores."""

    k: int
    batch: int
    temperature: float
    accepted: int = 0
    proposed: int = 0
    rejections: int = 0
    emitted: int = 0
    row_steps: int = 0
    seconds: float = 0.0
    cpu_seconds: float = 0.0
    outputs: list = dataclasses.field(default_factory=list)
    full_steps: list = dataclasses.field(default_factory=list)  # [k+1] counts of accepted a = 0..k

    @property
    def depth_acceptance(self) -> list[float]:
        counts = np.asarray(self.full_steps or [0] * (self.k + 1), np.float64)
        reached = counts[::-1].cumsum()[::-1]  # reached[j] = row-steps that accepted at least j
        return [float(reached[j] / reached[j - 1]) if reached[j - 1] else float("nan")
                for j in range(1, self.k + 1)]

    @property
    def accept_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else float("nan")

    @property
    def alpha(self) -> float:
        tried = self.accepted + self.rejections
        return self.accepted / tried if tried else float("nan")

    @property
    def tok_s(self) -> float:
        return self.emitted / self.seconds if self.seconds else float("nan")

    @property
    def cpu_tok_s(self) -> float:
        return self.emitted / self.cpu_seconds if self.cpu_seconds else float("nan")

    def merge(self, other: EngineMeasure) -> EngineMeasure:
        for f in ("accepted", "proposed", "rejections", "emitted", "row_steps", "seconds", "cpu_seconds"):
            setattr(self, f, getattr(self, f) + getattr(other, f))
        self.outputs += other.outputs
        mine, theirs = self.full_steps or [0] * (self.k + 1), other.full_steps or [0] * (other.k + 1)
        self.full_steps = [a + b for a, b in zip(mine, theirs)]
        return self

    @property
    def tokens_per_step(self) -> float:
        return self.emitted / self.row_steps if self.row_steps else float("nan")


def measure_engine(engine, prompts: list[list[int]], k: int, batch: int, temperature: float = 0.0,
                   max_tokens: int = 64, eos_ids: tuple[int, ...] = (), seed: int = 0) -> EngineMeasure:
    """Generate for `prompts` in groups of `batch` with a fixed k; collect acceptance and speed."""
    from jaxspec.types import SamplingParams

    m = EngineMeasure(k=k, batch=batch, temperature=temperature, full_steps=[0] * (k + 1))
    for g in range(0, len(prompts), batch):
        group = prompts[g:g + batch]
        slots = list(range(len(group)))
        outs = {}
        for s, p in zip(slots, group):
            sp = SamplingParams(temperature=temperature, max_tokens=max_tokens)
            outs[s] = [engine.prefill(s, p, sp, seed=seed + g + s)]
        live = [s for s in slots if outs[s][-1] not in eos_ids]
        t0, c0 = time.perf_counter(), time.process_time()
        while live:
            res = engine.step(live, k)
            for row, s in enumerate(live):
                toks = res.row_tokens(row)
                m.accepted += int(res.accepted[row])
                m.proposed += int(res.proposed[row])
                m.rejections += int(res.accepted[row] < res.proposed[row])
                m.row_steps += 1
                if k and res.proposed[row] == k:
                    m.full_steps[int(res.accepted[row])] += 1
                for t in toks:  # nothing past max_tokens or an EOS
                    if len(outs[s]) >= max_tokens or outs[s][-1] in eos_ids:
                        break
                    outs[s].append(t)
                    m.emitted += 1
            live = [s for s in live if len(outs[s]) < max_tokens and outs[s][-1] not in eos_ids]
        m.seconds += time.perf_counter() - t0
        m.cpu_seconds += time.process_time() - c0
        for s in slots:
            engine.free(s)
            m.outputs.append(outs[s])
    return m


def draft_step_latency(draft: DraftLlama, batch: int, window: int = 256, reps: int = 20) -> float:
    """Seconds per single-token cached draft forward at batch `batch` (compiled, warm)."""
    from models.kv_cache import init_cache
    from models.llama import chain_inputs

    graphdef, params = nnx.split(draft)
    cache = init_cache(draft.config, batch, window)

    @jax.jit
    def fwd(params, cache, tok, start):
        m = nnx.merge(graphdef, params)
        logits, cache = m.forward_cached(chain_inputs(tok, jnp.arange(tok.shape[0], dtype=jnp.int32), start),
                                         cache, window)
        return logits, cache

    tok = jnp.zeros((batch, 1), jnp.int32)
    start = jnp.full((batch,), window // 2, jnp.int32)
    jax.block_until_ready(fwd(params, cache, tok, start))
    t0 = time.perf_counter()
    for _ in range(reps):
        out = fwd(params, cache, tok, start)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / reps


# --- CLI ------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kind", choices=("token", "feature"), default="token",
                        help="token: a small LM draft (--arch); feature: an EAGLE-style draft reading the target's "
                             "features (jaxspec/feature_distill.py, written to jaxspec/drafts/<target>/feature)")
    parser.add_argument("--model", default=None, help="target model spec (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--arch", default=DEFAULT_ARCH,
                        help=f"draft architecture: a YAML path or one of {', '.join(draft_archs())}")
    parser.add_argument("--out", default=None,
                        help="output directory (default: the shipped draft, jaxspec/drafts/<target name> inside the "
                             "installed package; in an editable install that is the repository's jaxspec/drafts/)")
    parser.add_argument("--work", default=None,
                        help="work dir for shards/checkpoints (default: artifacts/distill/<arch> here)")
    parser.add_argument("--data", default=None, help="shard directory to reuse (default: <work>/../data)")
    parser.add_argument("--prompts", type=int, default=640, help="training prompts (ShareGPT + HumanEval)")
    parser.add_argument("--code-prompts", type=int, default=32, help="of which HumanEval stubs")
    parser.add_argument("--all-turns", action="store_true",
                        help="a prompt from every user turn of a ShareGPT conversation, after the turns before it "
                             "(default: first turns only)")
    parser.add_argument("--sharegpt-mb", type=int, default=32,
                        help="MB of the 125 MB ShareGPT file read for training prompts (more: more prompts)")
    parser.add_argument("--save-prompts", type=Path, default=None, metavar="FILE.npz",
                        help="write the training prompts (token ids) to FILE.npz and exit, for a machine without "
                             "the data packages (an accelerator): --prompts-file reads them there")
    parser.add_argument("--prompts-file", type=Path, default=None, metavar="FILE.npz",
                        help="the training prompts from a --save-prompts file instead of ShareGPT and HumanEval")
    parser.add_argument("--rows", type=int, default=16, help="target generation batch")
    parser.add_argument("--prompt-len", type=int, default=112)
    parser.add_argument("--gen-len", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=32, help="target log-probs kept per position")
    parser.add_argument("--data-minutes", type=float, default=10.0, help="budget for target generation")
    parser.add_argument("--tf-minutes", type=float, default=3.0,
                        help="budget for teacher-forced target labels on ShareGPT answers (0: none)")
    parser.add_argument("--tf-sequences", type=int, default=600)
    parser.add_argument("--vocab-keep", type=int, default=None, help="override the arch's pruned vocabulary")
    parser.add_argument("--steps", type=int, default=450)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1.5e-3)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--ckpt-every", type=int, default=25)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--feature-layers", type=int, default=1, help="--kind feature: decoder layers of the draft")
    parser.add_argument("--feature-fuse", default=None, metavar="L1,L2,..", type=_layer_list,
                        help="--kind feature: fuse the target's hidden states after these layers (EAGLE-3, e.g. "
                             "2,15,30; the last must be the target's last layer; default: its last layer only)")
    parser.add_argument("--ttt-passes", type=int, default=3,
                        help="--kind feature: training-time-test passes (the proposal depths trained)")
    parser.add_argument("--reg-weight", type=float, default=1.0,
                        help="--kind feature: weight of the feature regression next to the KL")
    parser.add_argument("--no-progress", action="store_true")


def _layer_list(text: str) -> tuple[int, ...]:
    """'2,15,30' -> (2, 15, 30) for --feature-fuse (an argparse type: a bad list is a usage error)."""
    try:
        layers = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer numbers, got {text!r}") from None
    if list(layers) != sorted(set(layers)) or layers[0] < 1:
        raise argparse.ArgumentTypeError(f"layers must be distinct, ascending and >= 1, got {text!r}")
    return layers


def training_prompts(tokenizer, args: argparse.Namespace) -> list[list[int]]:
    """The training prompts of `jaxspec distill` (both kinds), shuffled by --seed: --prompts of them, at most
    --prompt-len tokens each, from --prompts-file, else train-split ShareGPT user turns (--all-turns, --sharegpt-mb)
    and --code-prompts HumanEval stubs. Fewer than asked when the sources run out (printed)."""
    from jaxspec import distill_data as dd

    if args.prompts_file is not None:
        try:
            prompts = dd.load_prompt_ids(args.prompts_file, tokenizer.vocab_size)
        except (OSError, KeyError, ValueError) as exc:
            raise SystemExit(f"--prompts-file {args.prompts_file}: {exc}") from None
        longest = max(map(len, prompts), default=0)
        if longest > args.prompt_len:
            raise SystemExit(f"{args.prompts_file} holds a prompt of {longest} tokens > --prompt-len {args.prompt_len}")
        prompts = prompts[:args.prompts]
    else:
        n_code = min(args.code_prompts, args.prompts)
        prompts = dd.chat_prompts(tokenizer, "train", args.prompts - n_code, args.prompt_len,
                                  all_turns=args.all_turns, max_bytes=args.sharegpt_mb << 20)
        prompts += dd.code_prompts(tokenizer, n_code, args.prompt_len)
    if len(prompts) < args.prompts:
        more = [] if args.prompts_file is not None else [
            *(["raise --sharegpt-mb (at most 125)"] if args.sharegpt_mb < 125 else []), "raise --prompt-len",
            *(["use --all-turns"] if not args.all_turns else [])]
        print(f"{len(prompts)} training prompts of the {args.prompts} asked for: the sources ran out"
              + (f" ({', '.join(more)})" if more else ""))
    rng = np.random.default_rng(args.seed)
    return [prompts[i] for i in rng.permutation(len(prompts))]


def _load_target(spec):
    from models.llama import from_hf_state_dict
    from models.loading.registry import load_model

    loaded = load_model(spec, cache_dir=ARTIFACTS / "model_cache")
    return from_hf_state_dict(loaded.config, loaded.state_dict), loaded


def prompt_flags(args: argparse.Namespace) -> str:
    """The recipe's flags that choose the training prompts (for the command recorded with a draft)."""
    flags = f" --prompt-len {args.prompt_len} --rows {args.rows}"
    if args.prompts_file is not None:
        return flags + f" --prompts-file {args.prompts_file}"
    return flags + (" --all-turns" if args.all_turns else "") + (
        f" --sharegpt-mb {args.sharegpt_mb}" if args.sharegpt_mb != 32 else "")


def save_training_prompts(args: argparse.Namespace) -> int:
    """--save-prompts: the training prompts as token ids in a file, then exit (nothing generated or trained)."""
    from jaxspec import distill_data as dd
    from models.loading.registry import load_model

    tokenizer = load_model(args.model, cache_dir=ARTIFACTS / "model_cache").tokenizer
    prompts = training_prompts(tokenizer, args)
    dd.save_prompt_ids(args.save_prompts, prompts, tokenizer.vocab_size)
    print(f"wrote {len(prompts)} prompts ({sum(map(len, prompts))} tokens) to {args.save_prompts}")
    return 0


def run(args: argparse.Namespace) -> int:
    from jaxspec import distill_data as dd

    if args.save_prompts is not None:
        return save_training_prompts(args)
    if args.kind == "feature":
        from jaxspec import feature_distill

        return feature_distill.run(args)

    t_start = time.time()
    arch = DraftArch.load(args.arch)
    if args.vocab_keep is not None:
        arch = dataclasses.replace(arch, vocab_keep=args.vocab_keep)
    target, loaded = _load_target(args.model)
    tok, tconf = loaded.tokenizer, loaded.config
    work = Path(args.work or ARTIFACTS / "distill" / arch.name)
    data_dir = Path(args.data or work.parent / f"data-{tconf.name}")
    out = Path(args.out or shipped_draft_dir(tconf.name))
    progress = not args.no_progress

    prompts = training_prompts(tok, args)
    shards = dd.build_shards(target, prompts, data_dir, tconf.eos_token_ids, rows=args.rows,
                             prompt_len=args.prompt_len, gen_len=args.gen_len, top_k=args.top_k,
                             time_budget_s=args.data_minutes * 60, progress=progress)
    heldout = dd.load_shards(shards[-1:]) if len(shards) > 1 else None
    train_shards = shards if heldout is None else shards[:-1]
    if args.tf_sequences > 0:  # with --tf-minutes 0 only shards already on disk are used
        seqs = dd.chat_transcripts(tok, args.tf_sequences, args.prompt_len + args.gen_len)
        train_shards = train_shards + dd.build_teacher_forced_shards(
            target, seqs, data_dir, rows=8, seq_len=args.prompt_len + args.gen_len, top_k=args.top_k,
            time_budget_s=args.tf_minutes * 60, progress=progress)
    train = dd.load_shards(train_shards)
    t_data = time.time() - t_start
    keep = None
    if arch.vocab_keep:
        keep = dd.choose_vocab(train, tconf.vocab_size, arch.vocab_keep, always=tconf.eos_token_ids)
        m = train["mask"]
        cover = np.isin(train["top_ids"][..., 0][m], keep).mean()
        print(f"kept vocabulary: {keep.size} ids, covers {cover:.3f} of the target's top-1 on training data")
    draft = build_draft(target, arch, keep, seed=args.seed)
    tc = TrainConfig(steps=args.steps, batch=args.batch, lr=args.lr, warmup=args.warmup, seed=args.seed,
                     ckpt_every=args.ckpt_every)
    trainer = Trainer(draft, train, tc, ckpt_dir=work / "ckpt")
    resumed = trainer.restore_latest()
    if resumed is not None:
        print(f"resumed from step {resumed}")
    before = trainer.eval_loss(heldout) if heldout is not None else None
    work.mkdir(parents=True, exist_ok=True)
    with open(work / "train_log.jsonl", "a") as log:
        trainer.fit(progress=progress, log=log)
    after = trainer.eval_loss(heldout) if heldout is not None else None
    meta = {"recipe": {"command": f"jaxspec distill --arch {args.arch} --steps {args.steps} --batch {args.batch} "
                                  f"--lr {args.lr} --prompts {args.prompts} --gen-len {args.gen_len} "
                                  f"--top-k {args.top_k} --data-minutes {args.data_minutes} "
                                  f"--tf-minutes {args.tf_minutes}" + prompt_flags(args),
                       "train_sequences": int(len(train["tokens"])),
                       "onpolicy_shards": len(shards) - (heldout is not None),
                       "tf_shards": len(train_shards) - len(shards) + (heldout is not None),
                       "train_tokens": int(train["mask"].sum()),
                       "steps": args.steps, "batch": args.batch, "lr": args.lr, "seed": args.seed,
                       "data_seconds": round(t_data), "total_seconds": round(time.time() - t_start)},
            "heldout_kl_top1_before": before, "heldout_kl_top1_after": after,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    save_draft(out, trainer.model(), arch, tconf, meta)
    print(json.dumps({"out": str(out), **meta}, indent=2))
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="jaxspec distill", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
