"""Teacher-forced top-1 agreement of feature drafts with the target, prompt vs continuation positions.

    PYTHONPATH=. python benchmarks/feature_draft_agreement.py --drafts jaxspec/drafts/smollm2-135m/feature \
        --out docs/results/feature_draft/agreement.json

On held-out ShareGPT chat prompts (crc32(id) % 10 == 0, never trained on) the target writes --max-tokens greedy
tokens (`distill_data.TargetGenerator`, which also returns its features); each draft then runs its
training-time-test passes over prompt + continuation (`FeatureDraft.ttt_features`, the training forward). At
depth j, position p is the draft's j-th proposal of a draft anchored at p - j + 1; it agrees when its argmax
equals the target's. Reported per depth, separately for

  * continuation positions (the anchor at or after the prompt's last token): what serving at temperature 0
    sees, so depth 1 there predicts the engine's first-proposal acceptance;
  * prompt positions (human text the target did not write).

One forward per draft: a minute on this CPU, against ~10 for the engine study (benchmarks/feature_draft_study.py).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from jaxspec.bench.common import heldout_chat_setup
from jaxspec.engine.draft_artifacts import load_feature_draft
from jaxspec.training import distill_data as dd


def draft_features(features: np.ndarray, layers: tuple[int, ...], draft_layers: tuple[int, ...]) -> np.ndarray:
    """The columns of `draft_layers` out of features [B, T, n·D] stored at `layers` -> [B, T, n'·D]."""
    per_layer = features.reshape(*features.shape[:-1], len(layers), -1)  # [B, T, n, D]
    picked = per_layer[..., [layers.index(i) for i in draft_layers], :]  # [B, T, n', D]
    return picked.reshape(*features.shape[:-1], -1)


def agreement(draft, data: dict[str, np.ndarray], prompt_lens: np.ndarray, passes: int,
              layers: tuple[int, ...]) -> dict[str, list[float]]:
    """Per-depth top-1 agreement on continuation and prompt positions (see the module doc); data["features"] holds
    the target's hidden states after `layers`."""
    tokens = jnp.asarray(data["tokens"])  # [B, T]
    features = draft_features(data["features"], layers, draft.feature_layers)  # [B, T, n'·D]
    predicted = draft.ttt_features(tokens, jnp.asarray(features).astype(jnp.float32), passes)  # [U, B, T, D]
    target_top1 = data["top_ids"][..., 0]  # [B, T]
    b, t = target_top1.shape
    position = np.arange(t)[None, :]  # [1, T]
    out = {"continuation": [], "prompt": []}
    for j in range(passes):
        agree = np.asarray(jnp.argmax(draft.unembed(predicted[j]), axis=-1)) == target_top1  # [B, T]
        anchor = position - j  # [1, T] the anchor of the depth-(j+1) proposal at p
        valid = data["mask"] & (anchor >= 0)  # [B, T]
        continuation = anchor >= (prompt_lens[:, None] - 1)  # [B, T]
        out["continuation"].append(round(float(agree[valid & continuation].mean()), 4))
        out["prompt"].append(round(float(agree[valid & ~continuation].mean()), 4))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafts", nargs="+", default=["jaxspec/drafts/smollm2-135m/feature"],
                    help="feature draft directories (draft.json + weights.npz)")
    ap.add_argument("--prompts", type=int, default=16, help="held-out chat prompts")
    ap.add_argument("--max-tokens", type=int, default=64, help="greedy continuation per prompt")
    ap.add_argument("--passes", type=int, default=3, help="depths measured")
    ap.add_argument("--out", default="artifacts/feature_draft_agreement.json")
    args = ap.parse_args(argv)
    target, loaded, prompts, load_before = heldout_chat_setup(args.prompts)
    eos = loaded.config.eos_token_ids
    drafts = {path: load_feature_draft(path, target) for path in args.drafts}
    layers = tuple(sorted({i for d in drafts.values() for i in d.feature_layers}))  # every layer any draft reads
    generator = dd.TargetGenerator(target, rows=len(prompts), prompt_len=112, gen_len=args.max_tokens, top_k=1,
                                   feature_layers=layers)
    data = generator.generate(prompts, eos)
    prompt_lens = np.array([len(p) for p in prompts])
    results = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "model": loaded.config.name,
               "prompts": len(prompts), "max_tokens": args.max_tokens,
               "command": "PYTHONPATH=. python benchmarks/feature_draft_agreement.py " + " ".join(argv or []),
               "drafts": {}}
    for path, draft in drafts.items():
        r = agreement(draft, data, prompt_lens, args.passes, layers)
        results["drafts"][path] = r
        print(path, json.dumps(r), flush=True)
    results["load_before_after"] = [round(x, 2) for x in load_before + os.getloadavg()]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    print("\n| draft | continuation, depths 1.. | prompt, depths 1.. |\n|---|---|---|")
    for path, r in results["drafts"].items():
        print(f"| {path} | {' '.join(f'{a:.3f}' for a in r['continuation'])} | "
              f"{' '.join(f'{a:.3f}' for a in r['prompt'])} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
