"""The fused-feature draft (EAGLE-3's low/mid/high fusion;
jaxspec/models/feature_draft.py, `feature_layers` with n > 1).

Target: the features collected in the serving pass equal the cache-free forward's, and the last block is the last
hidden state. Draft: an untrained fused draft is the single-layer draft (its `reduce` starts as the identity on
the last layer); its training passes equal the serving chain at every depth. Engine: greedy output equals plain
decoding for every k and batch mix, and lazy catch-up builds the draft cache bitwise. Data: re-derived features
equal the generator's; a saved fused draft loads back with its layers; layers that do not end with the target's
last are refused.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxspec.engine.draft_artifacts import FeatureArch, build_feature_draft, load_feature_draft, save_feature_draft
from jaxspec.engine.engine import Engine
from jaxspec.menu import Menu
from jaxspec.models.config import TINY
from jaxspec.models.feature_draft import FeatureDraft, feature_draft_config
from jaxspec.models.kv_cache import init_cache
from jaxspec.models.llama import chain_inputs
from jaxspec.speculation.proposers.feature_draft import FeatureDraftProposer
from jaxspec.training.distill_data import TargetGenerator, choose_vocab, refeature_shards
from jaxspec.training.feature_distill import feature_loss
from jaxspec.training.trainer import TrainConfig, Trainer
from jaxspec.types import SamplingParams
from tests.conftest import assert_draft_caches_equal, decode, random_prompts, reference_greedy

LAYERS = (1, TINY.num_layers)  # "low" and last of the 2-layer tiny target
ARCH = FeatureArch(num_layers=1, vocab_keep=48, passes=3, feature_layers=LAYERS)
FIELDS = ("tokens", "mask", "top_ids", "top_lp", "features")
MENU = Menu(num_slots=8, max_len=128, batch_buckets=(1, 8), k_menu=(0, 1, 3), window_buckets=(128,),
            prefill_buckets=(16, 32))
D = TINY.hidden_size


def _tokens(b: int, t: int, seed: int = 1) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).integers(2, TINY.vocab_size, (b, t)), jnp.int32)


def test_serving_pass_collects_the_forward_features(tiny_model):
    tokens = _tokens(2, 10)
    features = tiny_model.layer_features(tokens, LAYERS)  # [B, T, 2D]
    assert features.shape == (2, 10, 2 * D)
    np.testing.assert_array_equal(np.asarray(features[..., D:]), np.asarray(tiny_model.hidden_states(tokens)))
    assert not np.allclose(np.asarray(features[..., :D]), np.asarray(features[..., D:]))  # two different layers
    cache = init_cache(TINY, 2, 16)
    hidden, served, _ = tiny_model.forward_cached_features(chain_inputs(tokens, jnp.arange(2), jnp.zeros(2, jnp.int32)),
                                                           cache, 16, LAYERS)
    np.testing.assert_allclose(np.asarray(served), np.asarray(features), atol=2e-5)
    np.testing.assert_array_equal(np.asarray(served[..., D:]), np.asarray(hidden))
    with pytest.raises(ValueError, match="must be in 1..2"):
        tiny_model.layer_features(tokens, (0, 2))


def _drafts(tiny_model):
    single = FeatureDraft(feature_draft_config(TINY), embed=tiny_model.embed.value, feature_layers=(TINY.num_layers,),
                          rngs=nnx.Rngs(3))
    fused = FeatureDraft(feature_draft_config(TINY), embed=tiny_model.embed.value, feature_layers=LAYERS,
                         rngs=nnx.Rngs(3))
    return single, fused


def test_untrained_fused_draft_is_the_single_layer_draft(tiny_model):
    single, fused = _drafts(tiny_model)
    tokens = _tokens(2, 12)
    features = tiny_model.layer_features(tokens, LAYERS)
    # the last layer's state, normed twice (layer norm, then feature norm), against once: equal up to rounding
    np.testing.assert_allclose(np.asarray(fused.ttt_features(tokens, features, 2)),
                               np.asarray(single.ttt_features(tokens, features[..., D:], 2)), atol=1e-4)


def test_fused_training_passes_equal_the_serving_draft_at_every_depth(tiny_model):
    _, fused = _drafts(tiny_model)
    fused.reduce.value = jnp.asarray(np.random.default_rng(0).normal(size=(2 * D, D)) / np.sqrt(2 * D), jnp.float32)
    b, t, s = 2, 12, 6
    tokens = _tokens(b, t)
    real = tiny_model.layer_features(tokens, LAYERS)  # [B, T, 2D]
    passes = fused.ttt_features(tokens, real, 3)  # [3, B, T, D]
    previous = jnp.pad(real, ((0, 0), (1, 0), (0, 0)))[:, :-1]  # [B, T, 2D] feature of p - 1
    rows, zeros = jnp.arange(b), jnp.zeros((b,), jnp.int32)
    cache = init_cache(fused.config, b, 32)
    _, cache = fused.forward_features(chain_inputs(tokens[:, :s], rows, zeros), previous[:, :s], cache, 32)
    feature = previous[:, s:s + 1]  # the target's (2D), then the draft's own predictions (D)
    for depth in range(1, 4):
        p = s + depth - 1
        feature, cache = fused.forward_features(chain_inputs(tokens[:, p:p + 1], rows, jnp.full((b,), p)), feature,
                                                cache, 32)
        np.testing.assert_allclose(np.asarray(feature[:, 0]), np.asarray(passes[depth - 1][:, p]), atol=2e-5)


@pytest.fixture(scope="module")
def fused_data(tiny_model):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, TINY.vocab_size, size=rng.integers(4, 12)).tolist() for _ in range(16)]
    return TargetGenerator(tiny_model, rows=16, prompt_len=12, gen_len=20, top_k=8,
                           feature_layers=LAYERS).generate(prompts, eos_ids=())


@pytest.fixture(scope="module")
def trained(tiny_model, fused_data):
    """A tiny fused draft trained briefly on the tiny target's own continuations."""
    keep = choose_vocab(fused_data, TINY.vocab_size, ARCH.vocab_keep)
    trainer = Trainer(build_feature_draft(tiny_model, ARCH, keep, seed=1), fused_data,
                      TrainConfig(steps=60, batch=8, lr=1e-2, warmup=5, ckpt_every=1000),
                      loss=lambda m, *b: feature_loss(m, *b, passes=ARCH.passes, reg_weight=ARCH.reg_weight),
                      fields=FIELDS)
    trainer.fit(progress=False)
    return trainer.model()


@pytest.fixture(scope="module")
def engine(tiny_model, trained):
    engine = Engine(tiny_model, FeatureDraftProposer(trained), MENU)
    engine.warmup(progress=False)
    return engine


def test_fused_greedy_equals_plain_decoding_for_every_k_and_batch(engine, tiny_model):
    assert engine.proposer.feature_layers == LAYERS
    assert engine.state.proposer.features.shape[-1] == 2 * D
    prompts = random_prompts((5, 40, 11, 23, 7, 33, 2, 18), TINY.vocab_size, seed=1)
    expected = [reference_greedy(tiny_model, p, 16) for p in prompts]
    rates = {}
    for k in MENU.k_menu:
        for group in ([0], list(range(8))):
            engine.reset()
            outputs, rates[k, len(group)] = decode(engine, [prompts[i] for i in group], k, 16)
            assert outputs == [expected[i] for i in group], (k, group)
    assert max(rates.values()) > 0.5, rates  # the trained draft is often accepted: not a vacuous check


def test_fused_lazy_catch_up_builds_the_draft_cache_bitwise(engine):
    prompts = random_prompts((9, 14), TINY.vocab_size, seed=2)
    caches = []
    for eager in (False, True):
        engine.reset()
        for s in (0, 1):
            engine.prefill(s, prompts[s], SamplingParams())
        engine.catch_up([0, 1])
        for _ in range(7):
            engine.step([0, 1], 0)
            if eager:
                engine.catch_up([0, 1])
        if not eager:
            engine.catch_up([0, 1])
        caches.append(jax.tree.map(np.asarray, engine.state.proposer.cache))
        lengths = engine.lengths[:2]
    assert_draft_caches_equal(*caches, lengths)


def test_refeatured_shards_equal_the_generators_features(tiny_model, fused_data, tmp_path):
    single = {name: value for name, value in fused_data.items() if name != "features"}
    single["features"] = fused_data["features"][..., D:]
    np.savez(tmp_path / "shard_00000.npz", **single)
    (path,) = refeature_shards([tmp_path / "shard_00000.npz"], tiny_model, LAYERS, tmp_path / "fused", progress=False)
    with np.load(path) as z:
        np.testing.assert_allclose(z["features"].astype(np.float32), fused_data["features"].astype(np.float32),
                                   atol=2e-3)
        np.testing.assert_array_equal(z["top_ids"], fused_data["top_ids"])


def test_saved_fused_draft_loads_with_its_layers(tiny_model, trained, tmp_path):
    save_feature_draft(tmp_path / "fused", trained, ARCH, TINY, dtype=np.float32)
    loaded = load_feature_draft(tmp_path / "fused", tiny_model)
    assert loaded.feature_layers == LAYERS
    tokens = _tokens(1, 6)
    features = tiny_model.layer_features(tokens, LAYERS)
    np.testing.assert_array_equal(np.asarray(loaded.ttt_features(tokens, features, 2)),
                                  np.asarray(trained.ttt_features(tokens, features, 2)))


def test_layers_must_end_with_the_targets_last():
    with pytest.raises(ValueError, match="end with 2"):
        FeatureArch(feature_layers=(1,)).layers_for(TINY)
    assert FeatureArch().layers_for(TINY) == (TINY.num_layers,)


def test_feature_fuse_flag_refuses_a_bad_list(capsys):
    import argparse

    from jaxspec.training.cli import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args(["--feature-fuse", "2,15,30"]).feature_fuse == (2, 15, 30)
    for bad in ("2,x", "15,2", "0,30"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--feature-fuse", bad])
        assert "--feature-fuse" in capsys.readouterr().err
