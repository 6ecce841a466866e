"""The dtype policy (docs/design.md, "Dtypes"): --dtype resolution, bfloat16 weights and caches,
float32 logits and verification, speculative == plain within a dtype, dtype-specific cost profiles."""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxspec.dtypes import DTYPES, resolve_dtype
from jaxspec.engine import compile_counter, step_bodies
from jaxspec.engine.args import EngineArgs
from jaxspec.engine.build import build_model, truncated_copy
from jaxspec.engine.engine import Engine
from jaxspec.engine.fake import FakeEngine
from jaxspec.engine.profiler import profile_key
from jaxspec.menu import Menu
from jaxspec.models.config import TINY
from jaxspec.models.kv_cache import init_cache
from jaxspec.models.llama import chain_inputs
from jaxspec.policy.cost_model import CostEntry, CostProfile, load_matching_profile
from jaxspec.speculation.proposers.draft_model import DraftModelProposer
from jaxspec.speculation.proposers.prompt_lookup import PromptLookupProposer
from jaxspec.speculation.verify import verify
from jaxspec.types import Proposals, RowParams, SamplingParams
from tests.conftest import decode, random_prompts
from tests.test_cli import jaxspec

MENU = Menu(num_slots=4, max_len=128, batch_buckets=(1, 4), k_menu=(0, 2, 4), window_buckets=(128,),
            prefill_buckets=(32,))
N_NEW = 12


# --- resolution ------------------------------------------------------------------------------

@pytest.mark.parametrize("backend,auto", [("cpu", "float32"), ("gpu", "bfloat16"), ("cuda", "bfloat16"),
                                          ("rocm", "bfloat16"), ("tpu", "bfloat16")])
def test_resolve_dtype(backend, auto):
    assert resolve_dtype("auto", backend) == auto
    for name in ("float32", "bfloat16"):  # an explicit dtype is taken as given on every backend
        assert resolve_dtype(name, backend) == name
    with pytest.raises(ValueError, match="unknown dtype 'float16'"):
        resolve_dtype("float16", backend)


def test_auto_refuses_to_guess_an_unknown_backend():
    with pytest.raises(ValueError, match="--dtype float32 or --dtype bfloat16"):
        resolve_dtype("auto", "metal")


def test_dtype_flag_and_engine_args():
    parser = argparse.ArgumentParser()
    EngineArgs.add_arguments(parser)
    assert EngineArgs.from_namespace(parser.parse_args([])).dtype == "auto"
    assert EngineArgs.from_namespace(parser.parse_args(["--dtype", "bfloat16"])).dtype == "bfloat16"
    with pytest.raises(ValueError, match="unknown dtype 'fp16'"):
        EngineArgs(dtype="fp16")
    assert set(DTYPES) == {"auto", "float32", "bfloat16"}


@pytest.mark.parametrize("argv", [("generate", "hi", "--model", "tiny", "--tokenizer", "ascii", "--dtype", "fp16"),
                                  ("profile", "--model", "tiny", "--dtype", "fp16")])
def test_unknown_dtype_is_one_line_and_exit_2(argv):
    result = jaxspec(*argv)
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "unknown dtype 'fp16'" in lines[0], result.stderr


def test_assemble_engine_threads_the_dtype():
    from jaxspec.serving.runtime import assemble_engine

    args = dict(model="tiny", tokenizer="ascii")
    bf16, _, _ = assemble_engine(EngineArgs(**args, dtype="bfloat16"), MENU)
    auto, _, _ = assemble_engine(EngineArgs(**args), MENU)
    assert bf16.dtype == "bfloat16" and bf16.state.cache.k[0].dtype == jnp.bfloat16
    assert auto.dtype == resolve_dtype("auto", jax.default_backend()) == "float32"  # the tests run on CPU


# --- a bfloat16 model ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def bf16_model():
    return build_model("tiny", dtype="bfloat16").model


def _float_leaves(tree) -> list[jax.Array]:
    return [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)]


def test_weights_and_cache_are_bfloat16(bf16_model):
    assert bf16_model.config.dtype == "bfloat16"
    params = _float_leaves(nnx.state(bf16_model, nnx.Param))
    assert params and all(p.dtype == jnp.bfloat16 for p in params)
    draft = truncated_copy(bf16_model, 1)  # a draft takes the target's dtype
    engine = Engine(bf16_model, DraftModelProposer(draft), MENU)
    served = _float_leaves(engine.placed_weights())  # the per-layer serving arrays
    assert served and all(p.dtype == jnp.bfloat16 for p in served)
    caches = [engine.state.cache, engine.state.proposer]
    buffers = _float_leaves(caches)
    assert len(buffers) >= 2 * (TINY.num_layers + 1) and all(b.dtype == jnp.bfloat16 for b in buffers)


def test_cached_forward_returns_float32_logits(bf16_model):
    cache = init_cache(bf16_model.config, num_slots=2, max_len=32)
    tokens = jnp.asarray([[3, 4, 5, 6]], jnp.int32)
    inputs = chain_inputs(tokens, jnp.asarray([0], jnp.int32), jnp.asarray([0], jnp.int32))
    logits, cache = bf16_model.forward_cached(inputs, cache, window=32)
    assert logits.dtype == jnp.float32 and logits.shape == (1, 4, TINY.vocab_size)
    assert cache.k[0].dtype == jnp.bfloat16 and bool(jnp.all(jnp.isfinite(logits)))
    assert bf16_model(tokens).dtype == jnp.float32  # the cache-free forward too


def _repetitive_prompts(plain: Engine) -> list[list[int]]:
    """Prompts that contain their own greedy continuation, so prompt lookup is accepted."""
    prompts = random_prompts((5, 17, 9, 26), TINY.vocab_size, seed=7)
    continuations, _ = decode(plain, prompts, 0, 8)
    plain.reset()
    return [p + c + p[-3:] for p, c in zip(prompts, continuations)]


def test_bfloat16_speculative_greedy_equals_plain_bfloat16(bf16_model):
    compile_counter.install()
    plain = Engine(bf16_model, None, MENU)
    spec = Engine(bf16_model, PromptLookupProposer(), MENU)
    plain.warmup(progress=False)
    spec.warmup(progress=False)
    compiles = compile_counter.count()
    prompts = _repetitive_prompts(plain)
    expected, _ = decode(plain, prompts, 0, N_NEW)
    for k in (2, 4):
        for batch in (1, 4):
            spec.reset()
            outputs, accepted = decode(spec, prompts[:batch], k, N_NEW)
            assert outputs == expected[:batch], f"k={k} batch={batch}"
            assert accepted > 0, f"prompt lookup was never accepted at k={k} batch={batch}"
    assert compile_counter.count() == compiles, "a step compiled after warm-up"


# --- verification stays float32 --------------------------------------------------------------

def test_verify_refuses_non_float32_inputs():
    b, k, v = 1, 2, 8
    params = RowParams(temperature=jnp.ones((b,)), top_p=jnp.ones((b,)), top_k=jnp.zeros((b,), jnp.int32),
                       keys=jax.random.split(jax.random.key(0), b))
    proposals = Proposals(token_ids=jnp.zeros((b, k), jnp.int32), lens=jnp.full((b,), k, jnp.int32), draft_probs=None)
    logits = jnp.zeros((b, k + 1, v), jnp.float32)
    verify(logits, proposals, params)  # float32: fine
    with pytest.raises(TypeError, match="float32 target logits"):
        verify(logits.astype(jnp.bfloat16), proposals, params)
    q = jnp.full((b, k, v), 1.0 / v, jnp.bfloat16)
    with pytest.raises(TypeError, match="float32 draft probabilities"):
        verify(logits, Proposals(proposals.token_ids, proposals.lens, draft_probs=q), params)


def test_bfloat16_engine_verifies_float32_p_and_q(bf16_model, monkeypatch):
    """Rejection sampling is exact for the p and q it is given; under bf16 weights both are still
    float32 (recorded while the menu traces), so its arithmetic does not depend on the dtype."""
    seen = []

    def recording_verify(target_logits, proposals, params):
        seen.append((target_logits.dtype, None if proposals.draft_probs is None else proposals.draft_probs.dtype))
        return verify(target_logits, proposals, params)

    monkeypatch.setattr(step_bodies, "verify", recording_verify)
    engine = Engine(bf16_model, DraftModelProposer(truncated_copy(bf16_model, 1)), MENU)
    engine.warmup(progress=False)
    with_q = [q for _, q in seen if q is not None]
    assert with_q and all(p == jnp.float32 for p, _ in seen) and all(q == jnp.float32 for q in with_q)
    prompt = random_prompts((9,), TINY.vocab_size, seed=2)
    outputs, _ = decode(engine, prompt, 2, 6, params=[SamplingParams(temperature=1.0, seed=3)])
    assert len(outputs[0]) == 6 and all(0 <= t < TINY.vocab_size for t in outputs[0])


# --- cost profiles are per dtype -------------------------------------------------------------

def test_profile_key_carries_the_dtype(tmp_path, bf16_model):
    f32_key = profile_key(FakeEngine(MENU, dtype="float32"), kind="cpu")
    bf16_key = profile_key(FakeEngine(MENU, dtype="bfloat16"), kind="cpu")
    assert f32_key != bf16_key and f32_key.filename() != bf16_key.filename()
    assert "bfloat16" in bf16_key.filename()
    assert profile_key(Engine(bf16_model, None, MENU), kind="cpu").dtype == "bfloat16"
    CostProfile(bf16_key, (CostEntry(1, 0, 128, 0.01),)).save(tmp_path / bf16_key.filename())
    assert load_matching_profile(bf16_key, tmp_path) is not None
    assert load_matching_profile(f32_key, tmp_path) is None  # a bf16 profile never prices a float32 engine
    # a profile saved before keys had a dtype was measured in float32
    data = CostProfile(f32_key, (CostEntry(1, 0, 128, 0.01),)).to_json()
    del data["key"]["dtype"]
    assert CostProfile.from_json(json.loads(json.dumps(data))).key == f32_key
    assert np.isclose(CostProfile.from_json(data).entries[0].seconds, 0.01)
