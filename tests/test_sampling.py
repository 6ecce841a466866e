"""Warping (jaxspec/speculation/sampling.py): the order of top-k and top-p, tiny top_p, batch independence,
and the sampling values the device is given."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.engine.engine import Engine
from jaxspec.menu import Menu
from jaxspec.models.config import TINY
from jaxspec.speculation import sampling
from jaxspec.speculation.proposers.prompt_lookup import PromptLookupProposer
from jaxspec.speculation.verify import verify
from jaxspec.types import MAX_TEMPERATURE, Proposals, RowParams, SamplingParams
from tests.conftest import decode, random_prompts, reference_greedy

# a permuted distribution, so nothing relies on the input being sorted: sorted, it is .4 .3 .2 .1
PROBS = np.array([0.2, 0.4, 0.1, 0.3])


def _rows(n: int, temperature: float, top_p: float, top_k: int, seed: int = 0) -> RowParams:
    return RowParams(temperature=jnp.full((n,), temperature, jnp.float32), top_p=jnp.full((n,), top_p, jnp.float32),
                     top_k=jnp.full((n,), top_k, jnp.int32),
                     keys=sampling.row_keys(jnp.full((n,), seed, jnp.int32), jnp.arange(n, dtype=jnp.int32)))


# (top_k, top_p, expected): worked by hand from PROBS.
#   top_k=2: {.4, .3} renormalised to {4/7, 3/7}; top_p=.5: the mass before 3/7 is 4/7 >= .5, so only .4.
#     (top-p first would keep {.4, .3}: the mass before .3 is .4 < .5; then top-k=2 leaves both.)
#   top_k=3: {.4, .3, .2} -> {4/9, 3/9, 2/9}; top_p=.75: the mass before 2/9 is 7/9 >= .75, so {4/7, 3/7}.
#     (top-p first would keep all three: the mass before .2 is .7 < .75.)
ORDER_CASES = [
    (2, 0.5, [0.0, 1.0, 0.0, 0.0]),
    (3, 0.75, [0.0, 4 / 7, 0.0, 3 / 7]),
    (3, 1.0, [2 / 9, 4 / 9, 0.0, 3 / 9]),  # top-k alone
    (0, 0.65, [0.0, 4 / 7, 0.0, 3 / 7]),  # top-p alone: the mass before .2 is .7 >= .65
]


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
@pytest.mark.parametrize("top_k,top_p,expected", ORDER_CASES)
def test_top_k_then_renormalise_then_top_p(temperature, top_k, top_p, expected):
    logits = jnp.asarray(np.log(PROBS) * temperature, jnp.float32)[None]  # [1, V]; warped by temperature to PROBS
    probs = jax.jit(sampling.warp)(logits, _rows(1, temperature, top_p, top_k))
    np.testing.assert_allclose(np.asarray(probs)[0], expected, atol=1e-6)


@pytest.mark.parametrize("top_p", [1e-46, 1e-40, 1e-30])
def test_tiny_top_p_samples_the_top_token(top_p):
    """1e-46 is 0 in float32; 1e-40 is a float32 subnormal, which XLA's CPU backend flushes to 0;
    1e-30 is a normal float32. Each must keep only the top token, never the whole vocabulary."""
    n, v, k = 4096, 16, 3
    logits = jax.random.normal(jax.random.key(0), (v,)) * 0.5  # flat: the whole vocabulary is likely
    top = int(jnp.argmax(logits))
    rows = _rows(n, 1.0, top_p, 0, seed=1)
    assert SamplingParams(temperature=1.0, top_p=top_p).validate() is None  # accepted, and:
    tokens, probs = jax.jit(sampling.draw)(jnp.broadcast_to(logits, (n, v)), rows, rows.keys)
    np.testing.assert_array_equal(np.asarray(probs)[0], np.eye(v)[top])
    assert np.all(np.asarray(tokens) == top)
    # rejection sampling with the same rows: draft and point-mass proposals of random tokens
    target = jnp.broadcast_to(logits, (n, k + 1, v))
    drafts = jax.random.randint(jax.random.key(2), (n, k), 0, v, jnp.int32)
    q = sampling.warp(jax.random.normal(jax.random.key(3), (n, k, v)), _rows(n, 1.0, 1.0, 0))  # [N, K, V]
    for draft_probs in (q, None):
        out, counts = jax.jit(verify)(target, Proposals(drafts, jnp.full((n,), k, jnp.int32), draft_probs), rows)
        out, counts = np.asarray(out), np.asarray(counts)
        emitted = np.arange(k + 1)[None, :] < counts[:, None]  # [N, K+1]
        assert np.all(out[emitted] == top)


def test_a_row_s_distribution_does_not_depend_on_its_batch():
    """A row with top_p = 1 and top_k = 0 is warped exactly as alone when another row of its batch
    truncates (which sends every row through the truncation). Its tail tokens have mass ~1e-13,
    below float32's resolution of the cumulative mass near 1."""
    v = 8
    logits = jnp.array([0.0] + [-30.0] * (v - 1))  # [V]
    alone = sampling.warp(logits[None], _rows(1, 1.0, 1.0, 0))
    batch = RowParams(temperature=jnp.ones((2,)), top_p=jnp.array([1.0, 0.5]), top_k=jnp.array([0, 3], jnp.int32),
                      keys=None)
    together = sampling.warp(jnp.stack([logits, logits]), batch)
    assert float(alone[0, 1]) > 0
    np.testing.assert_allclose(np.asarray(together[0]), np.asarray(alone[0]), rtol=1e-6, atol=0)


def test_validation_checks_what_the_device_holds():
    """top_k travels to the device as int32: a larger value must be a clear ValueError, not an
    OverflowError from the host-to-device cast. top_p has no such gap: any value in (0, 1] is
    valid on the device, the ones float32 rounds to 0 included (they keep the top token)."""
    SamplingParams(top_k=2**31 - 1).validate()
    with pytest.raises(ValueError, match=r"top_k must be < 2\^31, got 2147483648"):
        SamplingParams(top_k=2**31).validate()
    assert np.float32(1e-46) == 0.0
    SamplingParams(temperature=1.0, top_p=1e-46).validate()
    for bad in (0.0, -0.1, 1.0 + 1e-9, float("nan")):
        with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
            SamplingParams(top_p=bad).validate()


def test_tiny_top_p_through_the_engine_is_greedy(tiny_model):
    """End to end (prefill's first token, plain and speculative steps): top_p = 1e-46 at
    temperature 1 decodes exactly as greedy."""
    config = Menu(num_slots=1, max_len=64, batch_buckets=(1,), k_menu=(0, 2), window_buckets=(64,),
                          prefill_buckets=(32,))
    engine = Engine(tiny_model, PromptLookupProposer(), config)
    engine.warmup(progress=False)
    prompt = random_prompts((12,), TINY.vocab_size, seed=7)[0]
    expected = reference_greedy(tiny_model, prompt, 16)
    params = SamplingParams(temperature=1.0, top_p=1e-46, seed=3)
    for k in (0, 2):
        assert decode(engine, [prompt], k, 16, params=[params])[0][0] == expected
        engine.free(0)


@pytest.mark.parametrize("temperature", [10.0, 1e4, 1e38, 3e38])
def test_the_cut_survives_a_huge_temperature(temperature):
    """Scaled by a huge temperature the logits become equal in float32 (or 0): the top-k and top-p cut
    must still keep only the top tokens of the unscaled logits, so top_k = 1 stays greedy."""
    logits = jnp.asarray(np.log(PROBS), jnp.float32)[None]  # [1, V]; sorted: .4 .3 .2 .1
    probs = np.asarray(jax.jit(sampling.warp)(logits, _rows(1, temperature, 1.0, 1)))[0]
    np.testing.assert_array_equal(probs, [0.0, 1.0, 0.0, 0.0])
    probs = np.asarray(jax.jit(sampling.warp)(logits, _rows(1, temperature, 1.0, 2)))[0]
    np.testing.assert_allclose(probs, [0.0, 0.5, 0.0, 0.5], atol=0.02)  # near-flat over the two kept
    # top_p = 0.3: nearly flat probabilities (0.25 each) keep two tokens, the top two of the logits
    probs = np.asarray(jax.jit(sampling.warp)(logits, _rows(1, temperature, 0.3, 0)))[0]
    np.testing.assert_allclose(probs, [0.0, 0.5, 0.0, 0.5], atol=0.02)


def test_temperature_is_bounded():
    SamplingParams(temperature=MAX_TEMPERATURE).validate()
    for bad in (MAX_TEMPERATURE * 1.01, 1e38, 1.7e308, float("inf")):
        with pytest.raises(ValueError, match="temperature must be"):
            SamplingParams(temperature=bad).validate()
