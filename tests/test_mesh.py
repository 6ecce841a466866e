"""The engine on a device mesh (docs/design.md, "Sharding"), on 8 forced host devices (tests/conftest.py).

Every mesh gives token for token the single-device output — greedy and seeded sampling, for proposers
none, prompt lookup, draft and feature draft, over a mixed batch (rows of different lengths, caps and sampling, a slot
freed and refilled) — and compiles nothing after warm-up. Forced host devices share the same two cores:
these tests are about correctness only, never speed.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxspec.engine import compile_counter
from jaxspec.engine.draft_artifacts import FeatureArch, build_feature_draft
from jaxspec.engine.engine import Engine
from jaxspec.menu import Menu, TreeEnvelope
from jaxspec.mesh import MeshSpec
from jaxspec.models.config import TINY, TINY_DRAFT
from jaxspec.models.llama import random_model
from jaxspec.models.sharding import ShardingError
from jaxspec.speculation.proposers.draft_model import DraftModelProposer
from jaxspec.speculation.proposers.feature_draft import FeatureDraftProposer
from jaxspec.speculation.proposers.prompt_lookup import PromptLookupProposer
from jaxspec.types import SamplingParams

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices (tests/conftest.py forces 8 on CPU)")

MENU = Menu(num_slots=4, max_len=128, batch_buckets=(4,), k_menu=(0, 2), window_buckets=(128,),
            prefill_buckets=(32,))  # few shapes: 12 engines compile it
MESHES = [(1, 2), (2, 2), (1, 4), (8, 1)]
GREEDY, SEEDED = SamplingParams(), SamplingParams(temperature=0.9, top_p=0.9, seed=11)
K_SCHEDULE = (2, 0, 2, 2, 0, 2, 2, 2)


@pytest.fixture(scope="module")
def models():
    target = random_model(TINY, seed=3)
    draft = random_model(TINY_DRAFT.replace(vocab_size=TINY.vocab_size), seed=4)
    feature_draft = build_feature_draft(target, FeatureArch(vocab_keep=None))  # reads the target's features
    return target, draft, feature_draft


def _proposer(name: str, draft, feature_draft):
    return {"none": lambda: None, "ngram": lambda: PromptLookupProposer(1, 3),
            "draft": lambda: DraftModelProposer(draft), "feature": lambda: FeatureDraftProposer(feature_draft)}[name]()


def _run(models, proposer: str, mesh: tuple[int, int]) -> tuple[list[list[int]], int]:
    """proposer 'ngram-tree': prompt lookup with the k = 2 step a tree of 2 siblings (compaction moves the
    second one's K/V when it is accepted)."""
    target, draft, feature_draft = models
    menu = MENU.with_tree(TreeEnvelope(2, 1)) if proposer == "ngram-tree" else MENU
    engine = Engine(target, _proposer(proposer.removesuffix("-tree"), draft, feature_draft), menu, mesh=MeshSpec(*mesh))
    return _drive(engine, speculate=proposer != "none")


def _drive(engine: Engine, speculate: bool) -> tuple[list[list[int]], int]:
    """Drive one engine through a fixed mixed schedule; returns every row's tokens and the compiles
    after warm-up."""
    compile_counter.install()
    engine.warmup(progress=False)
    before = compile_counter.count()
    rng = np.random.default_rng(0)
    motif = [int(t) for t in rng.integers(2, engine.vocab_size, 6)]
    prompts = {0: motif * 4, 1: [int(t) for t in rng.integers(2, engine.vocab_size, 37)], 2: motif[:3] * 3}
    params = {0: GREEDY, 1: SEEDED, 2: GREEDY}
    out = {slot: [engine.prefill(slot, prompt, params[slot])] for slot, prompt in prompts.items()}
    for i, k in enumerate(K_SCHEDULE):
        k = k if speculate else 0
        slots = [0, 1, 2] if i % 3 else [0, 2]  # a smaller batch every third step
        caps = [k, 1, k][: len(slots)] if len(slots) == 3 else [k, k]
        result = engine.step(slots, k, caps)
        for row, slot in enumerate(slots):
            out[slot] += result.row_tokens(row)
        if i == 4:  # continuous batching: slot 2 finishes, a new request takes it
            engine.free(2)
            out[3] = out.pop(2)
            out[2] = [engine.prefill(2, motif[::-1] * 2, SEEDED)]
    return [out[s] for s in sorted(out)], compile_counter.count() - before


@pytest.fixture(scope="module")
def single_device(models):
    return {name: _run(models, name, (1, 1))[0] for name in ("none", "ngram", "draft", "ngram-tree", "feature")}


@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: f"data{m[0]}-model{m[1]}")
@pytest.mark.parametrize("proposer", ["none", "ngram", "draft"])
def test_mesh_output_equals_single_device(models, single_device, proposer, mesh):
    tokens, compiles = _run(models, proposer, mesh)
    assert tokens == single_device[proposer]
    assert compiles == 0


@pytest.mark.parametrize("mesh", [(2, 2), (1, 4)], ids=lambda m: f"data{m[0]}-model{m[1]}")
def test_feature_draft_on_a_mesh_equals_single_device(models, single_device, mesh):
    """The feature draft's stored features and draft cache (replicated over `model`, slots over `data`)."""
    tokens, compiles = _run(models, "feature", mesh)
    assert tokens == single_device["feature"]
    assert compiles == 0


@pytest.mark.parametrize("mesh", [(2, 2), (1, 4)], ids=lambda m: f"data{m[0]}-model{m[1]}")
def test_tree_steps_on_a_mesh_equal_single_device(models, single_device, mesh):
    """Token trees (verify and KV compaction) over a cache split by slot and by kv head."""
    tokens, compiles = _run(models, "ngram-tree", mesh)
    assert tokens == single_device["ngram-tree"]
    assert compiles == 0
    plain = single_device["none"][0]
    assert len(tokens[0]) > len(plain) and tokens[0][:len(plain)] == plain  # a greedy row: plain decoding, faster


def test_weights_and_cache_carry_the_designed_shardings(models):
    """data=2, model=2 on the tiny model (N=4 query heads, G=2 kv heads, F=64, V=64): column-parallel
    QKV and gate/up, row-parallel output and down projections, vocabulary-split embedding, the target's KV
    pages over data and kv heads over model; the draft is replicated, its cache's slots over data."""
    target, draft, _ = models
    engine = Engine(target, DraftModelProposer(draft), MENU, mesh=MeshSpec(2, 2))
    embed_and_head, layers = engine.placed_weights()
    c = TINY
    per_device = {name: value.sharding.shard_shape(value.shape) for name, value in layers[0].items()}
    assert per_device["wqkv"] == (c.hidden_size, 1, (c.num_heads + 2 * c.num_kv_heads) * c.head_dim // 2)
    assert per_device["w_gate_up"] == (c.hidden_size, 1, c.intermediate_size)  # 2F / P per group, one group
    assert per_device["wo"] == (c.num_heads // 2, c.head_dim, c.hidden_size)
    assert per_device["w_down"] == (c.intermediate_size // 2, c.hidden_size)
    assert per_device["attn_norm"] == (c.hidden_size,)
    embed = embed_and_head["embed"]
    assert embed.sharding.shard_shape(embed.shape) == (c.vocab_size // 2, c.hidden_size)
    cache = engine.state.cache.k[0]
    pages = cache.shape[0]
    assert pages % 2 == 0 and pages >= MENU.pool_pages  # the pool (scratch page included), padded to the data axis
    assert cache.sharding.shard_shape(cache.shape) == (pages // 2, MENU.page_size, c.num_kv_heads // 2, c.head_dim)
    draft_cache = engine.state.proposer.k[0]
    slot_rows = draft_cache.shape[0]
    assert slot_rows % 2 == 0 and slot_rows >= MENU.num_slots + 1  # S + scratch, padded to the data axis
    assert draft_cache.sharding.shard_shape(draft_cache.shape)[:2] == (slot_rows // 2, MENU.max_len)
    assert draft_cache.sharding.shard_shape(draft_cache.shape)[2:] == draft_cache.shape[2:]  # heads replicated
    draft_params, draft_layers = engine.proposer.params(engine.proposer_placement)
    for leaf in jax.tree.leaves(draft_layers):  # the draft's layers are replicated
        assert leaf.sharding.is_fully_replicated
    draft_embed = draft_params["embed"].value  # its embedding is split over the vocabulary like the target's
    assert draft_embed.sharding.shard_shape(draft_embed.shape) == (c.vocab_size // 2, TINY_DRAFT.hidden_size)


def test_kv_heads_fewer_than_model_are_repeated(models):
    """model=4 > G=2: each kv head is stored twice, so every device holds one (and says so)."""
    engine = Engine(models[0], None, MENU, mesh=MeshSpec(1, 4))
    cache = engine.state.cache.k[0]
    assert cache.shape[2] == 4 and cache.sharding.shard_shape(cache.shape)[2] == 1
    assert any("kv heads repeated" in note for note in engine.sharding_notes)


def test_a_mesh_that_does_not_divide_is_refused_with_the_valid_sizes(models):
    with pytest.raises(ShardingError, match=r"4 query heads.*valid model sizes: 1, 2, 4"):
        Engine(models[0], None, MENU, mesh=MeshSpec(1, 8))


def test_a_mesh_larger_than_the_devices_is_refused():
    with pytest.raises(ValueError, match=r"needs 16 devices, but 8 cpu device\(s\) are visible"):
        Engine(random_model(TINY, seed=0), None, MENU, mesh=MeshSpec(4, 4))


@pytest.mark.parametrize("text, spec", [("data=2,model=4", MeshSpec(2, 4)), ("model=3", MeshSpec(1, 3)),
                                        (" data=8 ", MeshSpec(8, 1))])
def test_mesh_flag_parses(text, spec):
    assert MeshSpec.parse(text) == spec


@pytest.mark.parametrize("text", ["data=0", "model=x", "tensor=2", "data=1,data=2", "2,4"])
def test_bad_mesh_flag_is_one_clear_error(text):
    with pytest.raises(ValueError, match="mesh"):
        MeshSpec.parse(text)


@pytest.mark.slow
def test_real_smollm2_on_model_3_equals_one_device():
    """The real default model (9 query heads, 3 kv heads) tensor parallel over 3 devices, with the shipped
    draft (the k = 0 steps of the schedule are plain decoding): the same tokens, nothing compiled after
    warm-up. Prompt lookup on a mesh is covered on the tiny model (`test_mesh_output_equals_single_device`)."""
    from jaxspec.engine.build import build_model, build_proposer

    menu = Menu(num_slots=4, max_len=256, batch_buckets=(4,), k_menu=(0, 2), window_buckets=(256,),
                prefill_buckets=(64,))
    outputs = {}
    for mesh in (MeshSpec(), MeshSpec(1, 3)):
        target = build_model(None, mesh=mesh).model
        engine = Engine(target, build_proposer("draft", target, "default", mesh=mesh), menu, mesh=mesh)
        outputs[mesh] = _drive(engine, speculate=True)
        if mesh.model == 3:  # the placed (streamed) weights carry the designed shardings
            embed_and_head, layers = engine.placed_weights()
            draft_params, _ = engine.proposer.params(engine.proposer_placement)
            assert draft_params["embed"].value is embed_and_head["embed"]  # the draft shares the target's
            wqkv, cache = layers[0]["wqkv"], engine.state.cache.k[0]
            assert wqkv.sharding.shard_shape(wqkv.shape) == (576, 1, 5 * 64)  # 3 query + 1 key + 1 value head
            assert cache.sharding.shard_shape(cache.shape)[2] == 1  # one of the 3 kv heads per device
    (single, _), (sharded, compiles) = outputs[MeshSpec()], outputs[MeshSpec(1, 3)]
    assert sharded == single
    assert compiles == 0


def test_tensor_parallel_step_has_one_all_reduce_after_attention_and_one_after_the_mlp(models):
    """The compiled k = 0 step on model=2 (Megatron-style): 2 all-reduces of the [B, T, D] activations per
    layer, plus one for the vocabulary-split embedding lookup; nothing else communicates activations
    (sampling's own gathers of the logits sit in its branch for sampled rows)."""
    from jaxspec.menu import StepKey

    engine = Engine(models[0], None, MENU, mesh=MeshSpec(1, 2))
    engine.warmup([StepKey(4, 0, 128)], progress=False)
    hlo = engine.compiled_text(StepKey(4, 0, 128))
    activations = f"f32[4,1,{TINY.hidden_size}]"
    all_reduces = [line for line in hlo.splitlines() if " all-reduce(" in line and f"= {activations}" in line]
    assert len(all_reduces) == 2 * TINY.num_layers + 1, "\n".join(all_reduces)
