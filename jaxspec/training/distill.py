"""`jaxspec distill`: train a hardware-efficient draft for a target (arXiv 2402.01528).

Recipe (see docs/drafts.md):
  1. prompts: first user turns of ShareGPT (+ a few HumanEval stubs), chat-templated;
     held-out conversations (crc32(id) % 10 == 0) are never trained on.
  2. the target writes greedy continuations and its top-K next-token log-probs at every
     position; cached on disk in shards (jaxspec.training.distill_data), resumable.
  3. the draft (DraftLlama: shared frozen target embedding, pruned output vocabulary, layers
     from a YAML architecture, optionally initialised from target layers) is trained on
     KL(target || draft) over the target's top-K, with optax AdamW (warm-up + cosine decay,
     global-norm clipping), orbax checkpoints every N steps (a rerun resumes from the last).
  4. the draft is saved as `draft.json` + `weights.npz` (fp16, own weights only).

Public API: run (the token recipe), measure_engine, draft_step_latency. The architecture and the draft files:
jaxspec.engine.draft_artifacts; the trainer: jaxspec.training.trainer; the command: jaxspec.training.cli.
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

from jaxspec.engine.draft_artifacts import DraftArch, build_draft, save_draft
from jaxspec.models.draft import DraftLlama
from jaxspec.resources import shipped_draft_dir
from jaxspec.training import distill_data as dd
from jaxspec.training.prompts import prompt_flags, training_prompts
from jaxspec.training.trainer import ARTIFACTS, TrainConfig, Trainer, load_target

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
    from jaxspec.models.kv_cache import init_cache
    from jaxspec.models.llama import chain_inputs

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


# --- the recipe -------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    """The token draft's recipe above with the flags of `jaxspec distill` (jaxspec.training.cli)."""
    t_start = time.time()
    arch = DraftArch.load(args.arch)
    if args.vocab_keep is not None:
        arch = dataclasses.replace(arch, vocab_keep=args.vocab_keep)
    target, loaded = load_target(args.model)
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


