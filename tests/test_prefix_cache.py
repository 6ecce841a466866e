"""The paged KV cache on the real engine: prefix caching and preemption change no output.

Greedy outputs equal with the prefix cache on and off (and the cache-free reference) for every proposer, on one
device and on a mesh; seeded sampling too; a deliberately small pool preempts requests, and every request still
completes with the output it has with a large pool.
"""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx

from jaxspec.engine.engine import Engine
from jaxspec.menu import Menu, TreeEnvelope
from jaxspec.mesh import MeshSpec
from jaxspec.models.config import TINY
from jaxspec.models.feature_draft import FeatureDraft, feature_draft_config
from jaxspec.policy.fixed import FixedPolicy, NoSpeculation
from jaxspec.scheduling.requests import FinishReason, Request
from jaxspec.scheduling.scheduler import Scheduler
from jaxspec.speculation.proposers.draft_model import DraftModelProposer
from jaxspec.speculation.proposers.feature_draft import FeatureDraftProposer
from jaxspec.speculation.proposers.prompt_lookup import PromptLookupProposer
from jaxspec.types import SamplingParams
from tests.conftest import random_prompts, reference_greedy

PAGE = 8
MENU = Menu(num_slots=4, max_len=128, batch_buckets=(4,), k_menu=(0, 3), window_buckets=(128,), prefill_buckets=(32,),
            page_size=PAGE)  # one shape per kind: a lean menu keeps the engines' warm-up short
SYSTEM = random_prompts([37], TINY.vocab_size, seed=11)[0]  # shared by every request: 4 full pages
N_NEW = 12


def _requests(params: SamplingParams | None = None, n: int = 6) -> list[Request]:
    tails = random_prompts([3 + 5 * i for i in range(n)], TINY.vocab_size, seed=12)
    params = params or SamplingParams(max_tokens=N_NEW, ignore_eos=True)
    return [Request(f"r{i}", SYSTEM + tail, params) for i, tail in enumerate(tails)]


def _proposer(name: str, target):
    if name == "none":
        return None
    if name in ("ngram", "ngram-tree"):
        return PromptLookupProposer()
    if name in ("draft", "draft-tree"):
        return DraftModelProposer(target)
    draft = FeatureDraft(feature_draft_config(TINY), embed=target.embed.value, feature_layers=(TINY.num_layers,),
                         rngs=nnx.Rngs(3))
    return FeatureDraftProposer(draft)


def _run(engine: Engine, requests: list[Request], k: int) -> list:
    """The first request alone (its prefill writes the shared pages), then the others together."""
    sched = Scheduler(engine, NoSpeculation() if k == 0 else FixedPolicy(k))
    return sched.generate_all(requests[:1]) + sched.generate_all(requests[1:])


@pytest.mark.parametrize("name", ["none", "ngram", "draft", "feature", "ngram-tree", "draft-tree"])
def test_greedy_outputs_equal_with_and_without_the_prefix_cache(tiny_model, name):
    menu = MENU.with_tree(TreeEnvelope(3, 2)) if name.endswith("-tree") else MENU
    k = 0 if name == "none" else 3
    outputs = {}
    for prefix_cache in (False, True):
        engine = Engine(tiny_model, _proposer(name, tiny_model), menu, prefix_cache=prefix_cache)
        engine.warmup(progress=False)
        results = _run(engine, _requests(), k)
        assert all(r.finish_reason == FinishReason.LENGTH for r in results)
        outputs[prefix_cache] = [r.token_ids for r in results]
        cached = [r.cached_prompt_tokens for r in results]
        if prefix_cache and name != "feature":  # every request after the first shares the system prompt's pages
            assert cached[0] == 0 and all(c == len(SYSTEM) // PAGE * PAGE for c in cached[1:]), cached
        else:  # off, or a feature draft (it needs the target's features of every prompt position)
            assert cached == [0] * len(results)
        assert engine.page_stats().in_use == 0  # every page is back
    assert outputs[True] == outputs[False]
    for request, tokens in zip(_requests()[:2], outputs[True]):
        assert list(tokens) == reference_greedy(tiny_model, list(request.prompt_token_ids), N_NEW)


def test_seeded_sampling_equal_with_and_without_the_prefix_cache(tiny_model):
    params = SamplingParams(max_tokens=N_NEW, temperature=1.0, seed=5, ignore_eos=True)
    outputs = {}
    for prefix_cache in (False, True):
        engine = Engine(tiny_model, PromptLookupProposer(), MENU, prefix_cache=prefix_cache)
        engine.warmup(progress=False)
        outputs[prefix_cache] = [r.token_ids for r in _run(engine, _requests(params), 3)]
    assert outputs[True] == outputs[False]
    assert len(set(outputs[True])) > 1  # sampled: different tails give different outputs


@pytest.mark.parametrize("mesh", [(2, 1), (2, 2)])
def test_prefix_cache_on_a_mesh(tiny_model, mesh):
    """Pages split over `data` (and kv heads over `model`): the same greedy outputs as one device without it."""
    engine = Engine(tiny_model, DraftModelProposer(tiny_model), MENU, mesh=MeshSpec(*mesh))
    engine.warmup(progress=False)
    results = _run(engine, _requests(n=4), 3)
    assert [r.cached_prompt_tokens > 0 for r in results] == [False, True, True, True]
    for request, result in zip(_requests(n=4), results):
        assert list(result.token_ids) == reference_greedy(tiny_model, list(request.prompt_token_ids), N_NEW)


@pytest.mark.parametrize("name,params", [
    ("ngram", SamplingParams(max_tokens=40, ignore_eos=True)),
    ("none", SamplingParams(max_tokens=40, temperature=1.0, seed=3, ignore_eos=True)),
])
def test_preemption_under_a_small_pool_changes_no_output(tiny_model, name, params):
    """A pool of 24 usable pages for 4 requests that each grow to 10-13 pages: requests are preempted and
    recomputed, and each completes with the output it has with a large pool (greedy with speculation; seeded
    sampling with plain decoding, whose draws are keyed by the request's token number)."""
    requests = [Request(f"r{i}", p, params) for i, p in enumerate(random_prompts([40, 45, 50, 60], TINY.vocab_size,
                                                                                  seed=13))]
    k = 0 if name == "none" else 3
    outputs, preemptions = {}, {}
    for pages in (None, 25):
        engine = Engine(tiny_model, _proposer(name, tiny_model), MENU.replace(num_pages=pages))
        engine.warmup(progress=False)
        sched = Scheduler(engine, NoSpeculation() if k == 0 else FixedPolicy(k))
        handles = [sched.submit(r) for r in requests]
        while not all(h.done() for h in handles):
            sched.step_once()
        results = [h.result() for h in handles]
        assert all(r.finish_reason == FinishReason.LENGTH and len(r.token_ids) == 40 for r in results)
        for handle, result in zip(handles, results):  # the stream: no token repeated or lost by a preemption
            assert tuple(t for event in handle for t in event.token_ids) == result.token_ids
        outputs[pages], preemptions[pages] = [r.token_ids for r in results], sched.preemptions
        assert engine.page_stats().in_use == 0
    assert preemptions[None] == 0 and preemptions[25] > 0
    assert outputs[25] == outputs[None]


def test_a_request_the_pool_cannot_hold_fails_alone(tiny_model):
    engine = Engine(tiny_model, None, MENU.replace(num_pages=5))  # 4 usable pages: 32 positions
    engine.warmup(progress=False)
    results = Scheduler(engine).generate_all([
        Request("small", [1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True)),
        Request("huge", list(np.arange(40) % 50 + 1), SamplingParams(max_tokens=4, ignore_eos=True)),
        Request("grows", [4, 5, 6], SamplingParams(max_tokens=60, ignore_eos=True))])
    assert results[0].finish_reason == FinishReason.LENGTH
    assert results[1].finish_reason == FinishReason.ERROR and "does not fit the KV page pool" in results[1].error
    assert results[2].finish_reason == FinishReason.ERROR and "page pool cannot hold" in results[2].error
    assert engine.page_stats().in_use == 0
