"""Goodput over chains and token trees (jaxspec/policy/goodput.py, "Token trees"; TreeYieldTracker)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from jaxspec.menu import TreeEnvelope, step_shape
from jaxspec.policy.acceptance import AcceptanceConfig, TreeYieldTracker, expected_tokens
from jaxspec.policy.goodput import GoodputPerRequestPolicy, GoodputPolicy
from jaxspec.types import StepResult
from tests.policy.sim import WINDOWS, Clock, cost_model, linear_cost, view

TREE = TreeEnvelope(8, 4)  # runs at k = 8 in place of the chain


def tree_view(n: int, **kwargs):
    return dataclasses.replace(view(n, **kwargs), trees=(TREE,))


def test_the_tree_estimate_starts_at_the_chain_and_moves_to_what_trees_reach_per_depth():
    config = AcceptanceConfig(prior_strength=4.0, request_decay=1.0, global_decay=1.0)
    trees = TreeYieldTracker(config)
    chain = np.full(4, 0.5)  # the chain's α_d at depths 1..4
    assert trees.expected("a", 8, chain) == pytest.approx(1 + 0.5 + 0.25 + 0.125 + 0.0625)  # no data: the chain's
    for _ in range(4):
        trees.observe("a", 8, 3, depth=4)  # reached depths 1..3, stopped at 4
    # global per depth: g = ([4, 4, 4, 0] + 4·0.5) / ([4, 4, 4, 4] + 4) = [.75, .75, .75, .25]
    np.testing.assert_allclose(trees.rates("b", 8, chain), [0.75, 0.75, 0.75, 0.25])
    # the request's own: c = ([4, 4, 4, 0] + 4·g) / (4 + 4) = [.875, .875, .875, .125]
    np.testing.assert_allclose(trees.rates("a", 8, chain), [0.875, 0.875, 0.875, 0.125])
    assert trees.expected("a", 8, chain) == pytest.approx(1 + 0.875 + 0.875**2 + 0.875**3 + 0.875**3 * 0.125)
    assert trees.expected("b", 8, chain) == pytest.approx(1 + 0.75 + 0.75**2 + 0.75**3 + 0.75**3 * 0.25)
    trees.forget("a")  # a forgotten request starts at the global rates
    assert trees.expected("a", 8, chain) == pytest.approx(trees.expected("b", 8, chain))
    for bad in (-1, 5):
        with pytest.raises(ValueError):
            trees.observe("a", 8, bad, depth=4)


def test_a_sibling_that_catches_what_the_preferred_child_misses_raises_that_depth_only():
    """Depth 1 always continues (a sibling catches the target's token), depth 2 as the chain: only c_1 moves."""
    trees = TreeYieldTracker(AcceptanceConfig(prior_strength=1.0, request_decay=1.0, global_decay=1.0))
    rng = np.random.default_rng(0)
    for _ in range(2000):
        trees.observe("a", 4, 1 + int(rng.random() < 0.5), depth=2)
    np.testing.assert_allclose(trees.rates("a", 4, np.array([0.5, 0.5])), [1.0, 0.5], atol=0.03)


def test_row_expectations_are_built_from_the_row_rates_the_tree_prior_uses():
    policy = _policy(2, linear_cost())
    policy.acceptance.observe(1, 3, 4)
    v = tree_view(2, ids=(0, 1))
    rates = policy.row_rates(v, 8)
    np.testing.assert_allclose(rates, [[policy.acceptance.alpha(0)] * 8, [policy.acceptance.alpha(1)] * 8])
    np.testing.assert_allclose(policy.row_expectations(v, 8),
                               expected_tokens(rates[:, :1], np.arange(9)[None, :]), rtol=1e-12)


def _policy(tree_accepted: float, fn) -> GoodputPolicy:
    """A goodput policy whose chain rate is α = 0.5 (trusted) and whose trees have accepted `tree_accepted`."""
    policy = GoodputPolicy(cost_model(fn))
    for _ in range(200):  # enough chain evidence to leave the cold start: 1 success in 2 trials a verify
        policy.acceptance.observe(0, 1, 10)
    for _ in range(200):
        policy.trees.observe(0, 8, tree_accepted, TREE.depth)
    return policy


def test_goodput_takes_the_tree_when_its_measured_yield_beats_every_chain_at_the_cost():
    fn = linear_cost()  # 10 ms a step + 1.5 ms per proposal
    # α = 0.5: the best chain is k = 2 (1.75 tokens in 13 ms); at k = 8 a chain yields ~2 tokens in 22 ms,
    # a tree that accepts 3 nodes a step yields 4
    assert _policy(3, fn).choose(view(1)).k == 2  # without trees in the menu k = 8 is a chain
    decision = _policy(3, fn).choose(tree_view(1))
    assert decision.k == 8
    assert decision.predicted_goodput[8] == pytest.approx(4.0 / fn(1, 8, 256), rel=0.05)
    # a tree that accepts less than the chains predict loses to them
    assert _policy(0, fn).choose(tree_view(1)).k == 2


def test_a_row_capped_below_the_envelope_is_priced_as_the_chain_of_its_cap():
    policy = _policy(4, linear_cost())
    v = tree_view(2, caps=(8, 3))
    shape = policy.shape(v, 8)
    e = policy.row_expectations(v, 8)
    tokens = policy.row_tokens(v, e, shape)
    assert tokens[0] == pytest.approx(policy.trees.expected(0, 8, policy.row_rates(v, TREE.depth)[0]))
    assert tokens[0] > 4.9  # the tree accepted its whole depth every step
    assert tokens[1] == pytest.approx(e[1, 3])


def test_tree_steps_update_the_tree_estimate_not_the_chain_rate():
    policy = _policy(2, linear_cost())
    prior = np.full(TREE.depth, 0.5)
    alpha, before = policy.acceptance.alpha(0), policy.trees.expected(0, 8, prior)
    v = tree_view(2, ids=(0, 1), caps=(8, 2))
    decision = policy.decision(policy.allocate(v, policy.row_expectations(v, 8), policy.shape(v, 8)), [])
    result = StepResult(tokens=np.zeros((2, 9), np.int32), counts=np.array([5, 1]), proposed=np.array([8, 2]))
    policy.observe(v, decision, result, 0.01)
    assert policy.acceptance.alpha(0) == alpha and policy.acceptance.observations(1) == 0  # no chain evidence
    assert policy.trees.expected(0, 8, prior) > before  # 4 accepted (the whole depth) at the full envelope
    assert policy.trees.expected(1, 8, prior) == policy.trees.expected("unseen", 8, prior)  # the capped row: none


def test_closed_loop_goodput_finds_a_tree_that_pays_and_drops_one_that_does_not():
    """Simulated: chains accept at α = 0.4; the tree accepts 3 nodes a step (or none). Goodput starts cold,
    tries the tree, and ends running it most steps with more tokens per second than the best chain alone;
    a tree that accepts nothing is dropped after its trial steps."""
    fn = linear_cost()
    rng = np.random.default_rng(0)

    def drive(policy, trees, tree_accepted=3):
        clock, tokens, ks = Clock(), 0, []
        for _ in range(400):
            v = dataclasses.replace(view(1), trees=trees)
            d = policy.choose(v)
            shape = step_shape(v.context_lens, d.row_k, d.k, v.k_menu, WINDOWS)
            if trees and shape.k == 8:
                accepted = tree_accepted
            else:
                accepted = 0
                while accepted < shape.caps[0] and rng.random() < 0.4:
                    accepted += 1
            result = StepResult(tokens=np.zeros((1, shape.k + 1), np.int32), counts=np.array([accepted + 1]),
                                proposed=np.array([shape.caps[0]]))
            start = clock()
            clock.now += fn(v.batch_bucket, shape.k, shape.window)
            policy.observe(v, d, result, clock() - start)
            tokens += accepted + 1
            ks.append(shape.k)
        return tokens / clock.now, ks

    chains_only, _ = drive(GoodputPolicy(cost_model(fn)), ())
    with_tree, ks = drive(GoodputPolicy(cost_model(fn)), (TREE,))
    assert np.mean(np.array(ks[-200:]) == 8) > 0.8
    assert with_tree > 1.3 * chains_only
    with_bad_tree, ks = drive(GoodputPolicy(cost_model(fn)), (TREE,), tree_accepted=0)
    assert np.mean(np.array(ks[-200:]) == 8) < 0.05
    assert with_bad_tree > 0.9 * chains_only


def test_goodput_per_request_refuses_trees():
    with pytest.raises(ValueError, match="token trees"):
        GoodputPerRequestPolicy(cost_model()).choose(tree_view(1))
