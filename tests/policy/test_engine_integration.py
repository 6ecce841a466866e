"""The goodput policies driving a tiny engine: greedy output unchanged, nothing compiles after warm-up."""

from __future__ import annotations

import time

import numpy as np

from jaxspec.engine import compile_counter, profiler
from jaxspec.engine.engine import Engine
from jaxspec.menu import Menu
from jaxspec.models.config import TINY
from jaxspec.policy.acceptance import AcceptanceTracker
from jaxspec.policy.base import BatchView
from jaxspec.policy.cost_model import CostModel
from jaxspec.policy.goodput import GoodputPerRequestPolicy, GoodputPolicy
from jaxspec.speculation.proposers.prompt_lookup import PromptLookupProposer
from jaxspec.types import SamplingParams
from tests.conftest import random_prompts
from tests.policy.sim import linear_cost, synthetic_cost_model

MENU = Menu(num_slots=2, max_len=128, batch_buckets=(2,), k_menu=(0, 2, 4), window_buckets=(128,),
                    prefill_buckets=(32,))
N_NEW = 60


def _decode(engine: Engine, prompts, choose):
    """Greedy-decode every prompt in one batch; `choose(view) -> (k, row_k, after(result, seconds))`.
    As in the scheduler, a row that has its N_NEW tokens leaves the batch (else it would run out of cache
    while a slower row catches up)."""
    outs = [[engine.prefill(s, p, SamplingParams())] for s, p in enumerate(prompts)]
    steps = 0
    while live := [s for s, o in enumerate(outs) if len(o) < N_NEW]:
        view = BatchView(request_ids=tuple(live), context_lens=tuple(engine.length(s) for s in live),
                         row_max_k=tuple(min(MENU.max_k, engine.room(s)) for s in live),
                         k_menu=MENU.k_menu, batch_bucket=2)
        k, row_k, after = choose(view)
        t0 = time.perf_counter()
        result = engine.step(live, k, None if row_k is None else list(row_k))
        after(view, result, time.perf_counter() - t0)
        for row, slot in enumerate(live):
            outs[slot] += result.row_tokens(row)
        steps += 1
    return [o[:N_NEW] for o in outs], steps


def _policy_driver(policy, decisions, priced=None):
    """Drive `policy`; with `priced` (a CostModel) each step is observed at that model's own price of
    the shape that ran, so its online correction stays at zero and the choices do not depend on this
    machine's timings."""
    def choose(view):
        d = policy.choose(view)
        decisions.append(d)

        def after(v, r, seconds):
            if priced is not None:
                shape = priced.shape(v.context_lens, d.row_k, d.k, v.k_menu)
                seconds = priced.step_time(v.batch_bucket, shape.k, shape.window, shape.real_tokens)
            policy.observe(v, d, r, seconds)
        return d.k, d.row_k, after
    return choose


def test_goodput_policies_keep_greedy_output_and_compile_nothing(tiny_model):
    compile_counter.install()
    engine = Engine(tiny_model, PromptLookupProposer(), MENU)
    engine.warmup(progress=False)
    compiled = compile_counter.count()

    plain = lambda view: (0, None, lambda *a: None)  # noqa: E731
    seeds = random_prompts((9, 14), TINY.vocab_size, seed=3)
    continuations, _ = _decode(engine, seeds, plain)
    # prompts that contain their own continuation, so prompt lookup has something to propose
    prompts = [s + c[:12] + s[-3:] for s, c in zip(seeds, continuations)]
    reference, _ = _decode(engine, prompts, plain)

    profile = profiler.profile_engine(engine, repeats=2, progress=False)
    # synthetic prices, observed at their own price (this CPU is not the synthetic device), make the
    # choices deterministic and speculative, so the equality check sees k > 0 and per-row k
    synthetic = synthetic_cost_model(linear_cost(), MENU.batch_buckets, MENU.k_menu, MENU.window_buckets,
                                     real_token_s=0.5e-3)
    runs = {
        "goodput/profiled": GoodputPolicy(CostModel.from_profile(profile), AcceptanceTracker()),
        "goodput/synthetic": GoodputPolicy(synthetic, AcceptanceTracker()),
        "per-request/synthetic": GoodputPerRequestPolicy(synthetic, AcceptanceTracker()),
    }
    for name, policy in runs.items():
        decisions = []
        priced = synthetic if name.endswith("synthetic") else None
        outputs, steps = _decode(engine, prompts, _policy_driver(policy, decisions, priced))
        assert outputs == reference, name
        assert len(policy.log) == steps and all(d.k in MENU.k_menu for d in decisions)
        if name.endswith("synthetic"):
            assert any(d.k > 0 for d in decisions), name
            assert steps < N_NEW - 1, f"{name}: speculation should have saved steps"
    assert compile_counter.count() == compiled, "a step compiled after warm-up"
    assert all(np.isfinite(e.seconds) for e in profile.entries)
