"""The decoder and its cache contract on tiny models; shapes of the real presets."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxspec.models.config import PRESETS, TINY, TINY_QWEN
from jaxspec.models.kv_cache import cache_bytes, init_cache
from jaxspec.models.llama import Llama, StepInputs, chain_inputs, from_hf_state_dict, random_model, to_hf_state_dict


@pytest.mark.parametrize("config", [TINY, TINY_QWEN], ids=lambda c: c.name)
def test_t_tokens_at_once_equal_t_single_calls(config):
    """Writing T tokens in one call == T one-token calls == the cache-free forward."""
    model = random_model(config, seed=0)
    tokens = jax.random.randint(jax.random.key(1), (2, 12), 0, config.vocab_size)  # [2, 12]
    full = model(tokens)  # [2, 12, V]
    slots = jnp.array([0, 2])
    cache = init_cache(config, num_slots=3, max_len=32)
    chunked, cache_a = model.forward_cached(chain_inputs(tokens, slots, jnp.zeros(2, jnp.int32)), cache, 32)
    singles, cache_b = [], init_cache(config, num_slots=3, max_len=32)
    for t in range(12):
        logits, cache_b = model.forward_cached(chain_inputs(tokens[:, t:t + 1], slots, jnp.full(2, t)), cache_b, 16)
        singles.append(logits)
    scale = float(jnp.abs(full).max())
    np.testing.assert_allclose(chunked, full, atol=1e-5 * scale)
    np.testing.assert_allclose(jnp.concatenate(singles, axis=1), full, atol=1e-5 * scale)
    for layer_a, layer_b in zip(cache_a.k, cache_b.k):
        np.testing.assert_allclose(layer_a[slots, :12], layer_b[slots, :12], atol=1e-5)


def test_ragged_rows_and_stale_positions_are_masked():
    """Rows at different lengths in one call; garbage past a row's length is never attended."""
    model = random_model(TINY, seed=0)
    a = [int(x) for x in np.random.default_rng(0).integers(0, 64, 9)]
    b = [int(x) for x in np.random.default_rng(1).integers(0, 64, 4)]
    cache = init_cache(TINY, num_slots=2, max_len=32)
    # prefill row a with 8 tokens and row b with 3 (plus garbage written after b's length)
    cache = model.forward_cached(chain_inputs(jnp.array([a[:8]]), jnp.array([0]), jnp.array([0])), cache, 32)[1]
    cache = model.forward_cached(chain_inputs(jnp.array([b[:3] + [7, 7, 7, 7, 7]]), jnp.array([1]), jnp.array([0])),
                                 cache, 32)[1]
    # one ragged call: row a at position 8, row b at position 3 (overwrites the garbage)
    logits, _ = model.forward_cached(chain_inputs(jnp.array([[a[8]], [b[3]]]), jnp.array([0, 1]),
                                                  jnp.array([8, 3])), cache, 32)
    np.testing.assert_allclose(logits[0, 0], model(jnp.array([a]))[0, -1], atol=1e-4)
    np.testing.assert_allclose(logits[1, 0], model(jnp.array([b]))[0, -1], atol=1e-4)


def test_tree_mask_matches_separate_chains():
    """Two branches scored in one call with a tree mask equal each branch scored as a chain."""
    model = random_model(TINY, seed=0)
    prefix = jnp.array([[3, 9, 4, 12]])
    cache = init_cache(TINY, num_slots=1, max_len=32)
    _, cache = model.forward_cached(chain_inputs(prefix, jnp.array([0]), jnp.array([0])), cache, 32)
    # tree: root r=20, children 21 (branch A) and 22 (branch B), both at depth 1
    tokens = jnp.array([[20, 21, 22]])
    depth = jnp.array([[0, 1, 1]])
    mask = jnp.array([[[1, 0, 0], [1, 1, 0], [1, 0, 1]]], bool)
    tree_logits, _ = model.forward_cached(StepInputs(tokens, jnp.array([0]), jnp.array([4]), depth, mask), cache, 32)
    for node, child in ((1, 21), (2, 22)):
        chain = model(jnp.array([[3, 9, 4, 12, 20, child]]))[0, -1]
        np.testing.assert_allclose(tree_logits[0, node], chain, atol=1e-4)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_real_presets_have_consistent_shapes(name):
    """jax.eval_shape builds every preset (incl. 7B-shaped) without allocating weights."""
    config = PRESETS[name]
    model = nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0)))
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model)))
    assert n_params == config.num_params
    tokens = jax.ShapeDtypeStruct((2, 5), jnp.int32)
    graphdef, state = nnx.split(model)
    out = jax.eval_shape(lambda s, t: nnx.merge(graphdef, s)(t), state, tokens)
    assert out.shape == (2, 5, config.vocab_size)
    assert cache_bytes(config, 1, 1) > 0


def test_smollm2_preset_size():
    assert abs(PRESETS["smollm2-135m"].num_params - 134.5e6) < 1e6


@pytest.mark.parametrize("config", [TINY, TINY_QWEN], ids=lambda c: c.name)
def test_hf_state_dict_round_trip(config):
    model = random_model(config, seed=4)
    again = from_hf_state_dict(config, to_hf_state_dict(model))
    tokens = jnp.arange(10)[None, :] % config.vocab_size
    np.testing.assert_array_equal(again(tokens), model(tokens))


def test_missing_tensor_is_a_clear_error():
    sd = to_hf_state_dict(random_model(TINY, seed=0))
    del sd["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(KeyError, match="missing"):
        from_hf_state_dict(TINY, sd)


def test_logits_and_cache_are_finite():
    model = random_model(TINY, seed=0)
    cache = init_cache(TINY, num_slots=1, max_len=64)
    tokens = jnp.arange(40)[None, :] % TINY.vocab_size
    logits, cache = model.forward_cached(chain_inputs(tokens, jnp.array([0]), jnp.array([0])), cache, 64)
    assert bool(jnp.isfinite(logits).all()) and all(bool(jnp.isfinite(k).all()) for k in cache.k)
