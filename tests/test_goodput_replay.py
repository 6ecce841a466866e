"""The goodput replay (benchmarks/goodput_replay.py): its host prompt lookup is the device proposer's twin, and a
replay emits every recorded token under any policy, priced at the shapes the engine runs."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.goodput_replay import K_MENU, Recorded, lookup_chain, run_policy
from jaxspec.policy.fixed import FixedPolicy
from jaxspec.policy.registry import make_policy
from jaxspec.speculation.proposers.base import StepContext
from jaxspec.speculation.proposers.prompt_lookup import PromptLookupProposer
from tests.policy.sim import linear_cost, synthetic_cost_model


@pytest.mark.parametrize("k", [1, 3, 5])
def test_host_lookup_equals_the_device_proposer(k):
    rng = np.random.default_rng(k)
    b, m = 64, 48
    lens = rng.integers(1, m, size=b)  # [B] valid tokens per row (pending included)
    history = rng.integers(0, 4, size=(b, m)).astype(np.int32)  # [B, M] a small vocabulary: many matches
    ctx = StepContext(slot_ids=jnp.arange(b), start=jnp.asarray(lens - 1), history=jnp.asarray(history), rows=None)
    proposals, _ = PromptLookupProposer().propose(None, None, ctx, k, m)
    tokens, n = np.asarray(proposals.token_ids), np.asarray(proposals.lens)  # [B, k], [B]
    for row in range(b):
        chain = lookup_chain([int(t) for t in history[row, :lens[row]]], k)
        assert (len(chain), chain) == (n[row], [int(t) for t in tokens[row, :n[row]]])


def test_every_policy_replays_the_same_tokens_and_goodput_speculates_on_a_copy():
    text = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18]
    prompt = tuple(text + [3, 7])  # the output copies the text after its first token
    output = tuple(text[1:] + [5, 6])
    requests = [Recorded(prompt, output, max_tokens=len(output), steps=())] * 3
    cost = synthetic_cost_model(linear_cost(), (1,), K_MENU, (64,))
    price = lambda k, w: cost.base_time(1, k, w)  # noqa: E731
    runs = {k: run_policy(requests, lambda k=k: FixedPolicy(k), price, cell=2, windows=(64,)) for k in K_MENU}
    runs["goodput"] = run_policy(requests, lambda: make_policy("goodput", cost_model=cost), price, cell=2,
                                 windows=(64,))
    assert {r["tokens"] for r in runs.values()} == {3 * (len(output) - 1)}  # the prefill gives the first
    assert runs[0]["steps"] == 3 * (len(output) - 1) and runs[5]["steps"] < runs[1]["steps"]
    assert runs[5]["tokens_per_s"] > runs[0]["tokens_per_s"]
    assert runs["goodput"]["tokens_per_s"] > runs[1]["tokens_per_s"]  # it learns to speculate deep on copies
