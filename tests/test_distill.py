"""Draft distillation: training lowers the loss, checkpoints resume exactly, a pruned-vocabulary
draft keeps rejection sampling exact, and the shipped draft is lossless at temperature 0."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxspec.engine.draft_artifacts import DraftArch, build_draft, load_draft, save_draft
from jaxspec.models.config import TINY
from jaxspec.models.draft import DraftLlama
from jaxspec.models.llama import random_model
from jaxspec.speculation import sampling
from jaxspec.speculation.verify import verify
from jaxspec.training.distill_data import TargetGenerator, choose_vocab
from jaxspec.training.trainer import TrainConfig, Trainer
from jaxspec.types import Proposals, RowParams

TINY_ARCH = DraftArch(name="t", num_layers=1, hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8,
                      intermediate_size=64, vocab_keep=48, init_layers=None)
NARROW_ARCH = DraftArch(name="n", num_layers=2, hidden_size=16, num_heads=2, num_kv_heads=1, head_dim=8,
                        intermediate_size=32, vocab_keep=None)


@pytest.fixture(scope="module")
def tiny_setup():
    target = random_model(TINY, seed=3)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, TINY.vocab_size, size=rng.integers(4, 12)).tolist() for _ in range(16)]
    gen = TargetGenerator(target, rows=16, prompt_len=12, gen_len=12, top_k=8)
    data = gen.generate(prompts, eos_ids=())
    return target, data


def test_generated_data_is_consistent(tiny_setup):
    target, data = tiny_setup
    # the target's top-1 at every non-final masked position of the continuation is the next token
    logits = target(jnp.asarray(data["tokens"]))
    top1 = np.asarray(jnp.argmax(logits, -1))
    m = data["mask"]
    agree = (top1 == data["top_ids"][..., 0])[m].mean()
    assert agree > 0.97  # fp32 cached vs cache-free forward: ties aside, identical
    np.testing.assert_allclose(np.exp(data["top_lp"][m].astype(np.float32)).sum(-1) <= 1.001, True)


def test_few_steps_lower_the_loss(tiny_setup):
    target, data = tiny_setup
    keep = choose_vocab(data, TINY.vocab_size, TINY_ARCH.vocab_keep)
    draft = build_draft(target, TINY_ARCH, keep, seed=1)
    trainer = Trainer(draft, data, TrainConfig(steps=30, batch=8, lr=1e-2, warmup=3, ckpt_every=1000))
    before, _ = trainer.eval_loss(data)
    trainer.fit(progress=False)
    after, _ = trainer.eval_loss(data)
    assert after < 0.8 * before, (before, after)


def test_checkpoint_resume_next_step_identical(tiny_setup, tmp_path):
    target, data = tiny_setup
    tc = TrainConfig(steps=10, batch=4, lr=3e-3, warmup=2, ckpt_every=3)

    a = Trainer(build_draft(target, NARROW_ARCH, seed=2), data, tc, ckpt_dir=tmp_path / "ck")
    for _ in range(3):
        a.train_step()
    a.save()
    loss_a, _, _ = a.train_step()
    params_a = jax.tree.map(np.asarray, a.params)

    b = Trainer(build_draft(target, NARROW_ARCH, seed=99), data, tc, ckpt_dir=tmp_path / "ck")
    assert b.restore_latest() == 3
    loss_b, _, _ = b.train_step()
    params_b = jax.tree.map(np.asarray, b.params)
    assert loss_a == loss_b
    for x, y in zip(jax.tree.leaves(params_a), jax.tree.leaves(params_b)):
        np.testing.assert_array_equal(x, y)


def test_projected_draft_cached_forward_matches_and_save_load(tiny_setup, tmp_path):
    target, data = tiny_setup
    from jaxspec.models.kv_cache import init_cache
    from jaxspec.models.llama import chain_inputs

    keep = np.arange(0, TINY.vocab_size, 3)
    draft = build_draft(target, NARROW_ARCH, keep, seed=4)  # width 16 != embedding 32: projections
    assert draft.projected and draft.pruned
    tokens = jnp.asarray(data["tokens"][:2, :10])
    full = draft(tokens)  # [2, 10, V]
    assert bool(jnp.all(jnp.isneginf(full[..., np.setdiff1d(np.arange(TINY.vocab_size), keep)])))
    cache = init_cache(draft.config, 2, 16)
    cached, _ = draft.forward_cached(chain_inputs(tokens, jnp.arange(2), jnp.zeros(2, jnp.int32)), cache, 16)
    np.testing.assert_allclose(np.asarray(cached[..., keep]), np.asarray(full[..., keep]), rtol=1e-4, atol=1e-4)
    save_draft(tmp_path / "d", draft, NARROW_ARCH, target.config, dtype=np.float32)
    again = load_draft(tmp_path / "d", target)
    np.testing.assert_allclose(np.asarray(again(tokens)[..., keep]), np.asarray(full[..., keep]), rtol=1e-5)


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_pruned_vocab_draft_keeps_rejection_sampling_exact(temperature, top_p):
    """First emitted token after [pending, d1, d2] with a pruned-vocab draft (q = 0 outside the
    kept tokens) must follow the target's warped p.

    Threshold: N = 200k samples; each empirical frequency has std sqrt(p(1-p)/N) <= 1.2e-3, so
    |freq - p| < 5 std + 1e-4 for all 16 tokens fails by chance with prob < 16 * 6e-7 ≈ 1e-5,
    while a sampler that ignores the residual (emits q's proposal on rejection) or warps p and q
    differently is off by far more (checked below: TV(p, q) > 0.15).
    """
    v, n = 16, 200_000
    cfg = TINY.replace(vocab_size=v)
    target = random_model(cfg, seed=7)
    keep = np.array([0, 2, 3, 5, 8, 9, 12, 15])
    dcfg = cfg.replace(num_layers=1, hidden_size=32)
    draft = DraftLlama(dcfg, embed=target.embed.value * 3.0, keep_ids=keep, rngs=nnx.Rngs(5))
    ctx = jnp.asarray([[4, 7, 1, 9]])
    p_logits = target(ctx)[0, -1]  # [V] after the pending token
    q_logits = draft(ctx)[0, -1]  # [V], -inf outside keep
    rows = RowParams(temperature=jnp.full((n,), temperature, jnp.float32), top_p=jnp.full((n,), top_p, jnp.float32),
                     top_k=jnp.zeros((n,), jnp.int32), keys=sampling.row_keys(jnp.arange(n, dtype=jnp.int32),
                                                                                jnp.zeros((n,), jnp.int32)))
    q = sampling.warp(jnp.broadcast_to(q_logits, (n, v)), rows)  # [N, V]
    p = sampling.warp(jnp.broadcast_to(p_logits, (n, v)), rows)
    np.testing.assert_allclose(np.asarray(q[0]).sum(), 1.0, rtol=1e-5)
    assert float(np.asarray(q[0])[np.setdiff1d(np.arange(v), keep)].sum()) == 0.0
    d1 = sampling.sample(q, sampling.subkeys(rows.keys, 0))  # [N]
    assert np.isin(np.asarray(d1), keep).all()
    # second proposal / target scores beyond the first position do not affect the first token;
    # give them arbitrary valid values so the K = 2 path is exercised
    d2 = sampling.sample(q, sampling.subkeys(rows.keys, 1))
    target_logits = jnp.broadcast_to(p_logits, (n, 3, v))
    proposals = Proposals(token_ids=jnp.stack([d1, d2], 1), lens=jnp.full((n,), 2, jnp.int32),
                          draft_probs=jnp.stack([q, q], 1))
    tokens, counts = verify(target_logits, proposals, rows)
    first = np.asarray(tokens[:, 0])
    freq = np.bincount(first, minlength=v) / n
    p0 = np.asarray(p[0], np.float64)
    tol = 5 * np.sqrt(p0 * (1 - p0) / n) + 1e-4
    assert np.all(np.abs(freq - p0) < tol), np.abs(freq - p0) / np.maximum(tol, 1e-12)
    assert 0.5 * np.abs(p0 - np.asarray(q[0])).sum() > 0.15  # the draft alone is clearly wrong


@pytest.mark.slow
def test_shipped_draft_greedy_equals_plain_decoding():
    from jaxspec.engine.draft_artifacts import load_shipped_draft, shipped_draft_path
    from jaxspec.engine.engine import Engine
    from jaxspec.menu import Menu
    from jaxspec.models.llama import from_hf_state_dict
    from jaxspec.models.loading.registry import load_model
    from jaxspec.speculation.proposers.draft_model import DraftModelProposer
    from jaxspec.types import SamplingParams

    loaded = load_model(None)
    if not (shipped_draft_path(loaded.config) / "draft.json").is_file():
        pytest.skip("no shipped draft")
    target = from_hf_state_dict(loaded.config, loaded.state_dict)
    draft = load_shipped_draft(loaded.config, target)
    assert draft.config.vocab_size == target.config.vocab_size
    cfg = Menu(num_slots=1, max_len=128, batch_buckets=(1,), k_menu=(0, 4), window_buckets=(128,),
                       prefill_buckets=(64,))
    engine = Engine(target, DraftModelProposer(draft), cfg)
    engine.warmup(progress=False)
    tok = loaded.tokenizer
    for question in ("What is the capital of France?", "Write a haiku about the sea."):
        prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": question}]),
                            add_special_tokens=False)
        outs = {}
        for k in (0, 4):
            out = [engine.prefill(0, prompt, SamplingParams())]
            while len(out) < 40:
                out += engine.step([0], k).row_tokens(0)
            engine.free(0)
            outs[k] = out[:40]
        assert outs[4] == outs[0]
