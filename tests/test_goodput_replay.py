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


class _Ordered:
    """A policy at fixed k that records the order of its choose and observe calls."""

    def __init__(self, k: int, calls: list):
        self.k, self.calls = k, calls

    def choose(self, view):
        from jaxspec.policy.base import Decision
        self.calls.append("choose")
        return Decision(k=self.k)

    def observe(self, view, decision, result, elapsed_s):
        self.calls.append("observe")

    def forget(self, request_id):
        self.calls.append("forget")


@pytest.mark.parametrize("lag", [0, 1])
def test_lag_one_observes_each_step_after_the_next_is_chosen(lag):
    """The overlapped loop chooses step t + 1 before it observes step t; lag = 0 is the synchronous loop. Every
    step is observed either way, the last before the request is forgotten."""
    text = [7, 8, 9, 10, 11, 12]
    requests = [Recorded(tuple(text + [3, 7]), tuple(text[1:] + [5]), max_tokens=6, steps=())]
    calls: list[str] = []
    price = lambda k, w: 0.01  # noqa: E731
    out = run_policy(requests, lambda: _Ordered(1, calls), price, cell=1, windows=(64,), lag=lag)
    assert calls.count("choose") == calls.count("observe") == out["steps"] > 2
    assert calls[-2:] == ["observe", "forget"]
    expected = ["choose", "observe"] * out["steps"] if lag == 0 else (
        ["choose"] + ["choose", "observe"] * (out["steps"] - 1) + ["observe"])
    assert calls[:-1] == expected


def test_prediction_ratios_leave_out_bonus_tokens_and_keep_the_cold_start_apart():
    from types import SimpleNamespace

    from benchmarks.goodput_replay import prediction_ratios

    def rec(k, batch, predicted, tokens, seconds=0.02):
        return SimpleNamespace(k=k, batch=batch, predicted_tokens=predicted, tokens=tokens,
                               predicted_seconds=None if predicted is None else 0.02, seconds=seconds)

    records = [rec(2, 1, 2.0, 3), rec(2, 1, 1.5, 1, seconds=0.03),  # predicted 1.0 + 0.5 speculative, realised 2 + 0
               rec(5, 2, 12.0, 4),  # cold start: k + 1 a row
               rec(0, 1, 1.0, 1), rec(3, 1, None, 2)]  # unpredicted: left out
    out = prediction_ratios(records)
    assert out["2"] == {"steps": 2, "ratio": 2 / 1.5, "seconds_ratio": 1.25, "cold_steps": 0, "cold_ratio": None}
    assert out["5"] == {"steps": 0, "ratio": None, "seconds_ratio": 1.0, "cold_steps": 1, "cold_ratio": 2 / 10}
    assert out["0"] == {"steps": 1, "ratio": None, "seconds_ratio": 1.0, "cold_steps": 0, "cold_ratio": None}
    assert set(out) == {"0", "2", "5"}


def test_recordings_round_trip(tmp_path):
    from benchmarks.goodput_replay import load_recordings, save_recordings
    from jaxspec.policy.cost_model import CostEntry, CostProfile, ProfileKey

    key = ProfileKey(device_kind="cpu", model="tiny", draft="ngram", batch_buckets=(1,), k_menu=K_MENU,
                     window_buckets=(64,))
    profile = CostProfile(key=key, entries=tuple(CostEntry(1, k, 64, linear_cost()(1, k, 64)) for k in K_MENU))
    recorded = {"chat": [Recorded((1, 2, 3), (4, 5), 8, ((1, 0), (2, 1)))]}
    path = tmp_path / "rec.json"
    save_recordings(path, recorded, {0: 0.02, 1: 0.021}, profile, (64,), {"date": "today"})
    back, costs, prof, windows, meta = load_recordings(path, ["chat"])
    assert back == recorded and costs == {0: 0.02, 1: 0.021} and windows == (64,) and meta == {"date": "today"}
    assert prof.to_json() == profile.to_json()
    with pytest.raises(SystemExit, match="no recording of"):
        load_recordings(path, ["sql"])


def test_outcome_before_counts_first_acceptances_after_a_copied_run():
    from benchmarks.goodput_replay import outcome_before

    text = list(range(10, 30))
    # the output copies the prompt's text (every step accepts all it proposes), then leaves it
    requests = [Recorded(tuple(text + [3, 10]), tuple(text[1:15] + [5, 6, 7, 8]), max_tokens=18, steps=())]
    out = outcome_before(requests)
    assert out["lag1"]["after_full"]["steps"] > 0
    assert out["lag1"]["after_full"]["rate"] > out["lag1"]["after_rejection"]["rate"]


def _mixed_requests():
    """Requests that copy a run from the prompt, then leave it for tokens nothing proposes, then copy again."""
    text = list(range(10, 40))
    prompt = tuple(text + [3, 10])
    output = tuple(text[1:12] + [5, 6, 7, 8, 9] + text[20:30])
    return [Recorded(prompt, output, max_tokens=len(output), steps=())] * 2


def test_clairvoyant_bounds_every_fixed_k_and_the_run_state_rule():
    from benchmarks.goodput_replay import RunStatePolicy, clairvoyant

    requests = _mixed_requests()
    cost = synthetic_cost_model(linear_cost(), (1,), K_MENU, (64,))
    price = lambda k, w: cost.base_time(1, k, w)  # noqa: E731
    bound = clairvoyant(requests, price, (64,))
    causal = [run_policy(requests, lambda k=k: FixedPolicy(k), price, cell=2, windows=(64,)) for k in K_MENU]
    causal += [run_policy(requests, lambda a=a, b=b: RunStatePolicy(a, b), price, cell=2, windows=(64,))
               for a in K_MENU for b in K_MENU]
    assert {r["tokens"] for r in causal} == {bound["tokens"]}
    assert all(bound["tokens_per_s"] >= r["tokens_per_s"] - 1e-9 for r in causal)
    assert bound["tokens_per_s"] > max(r["tokens_per_s"] for r in causal[:len(K_MENU)])  # strictly, on a mix


def test_run_state_rule_goes_deep_after_a_full_acceptance_only():
    from benchmarks.goodput_replay import RunStatePolicy

    calls: list[int] = []

    class Recording(RunStatePolicy):
        def choose(self, view):
            decision = super().choose(view)
            calls.append(decision.k)
            return decision

    price = lambda k, w: 0.01  # noqa: E731
    run_policy(_mixed_requests()[:1], lambda: Recording(5, 1), price, cell=1, windows=(64,), lag=0)
    assert calls[0] == 1 and 5 in calls  # starts shallow; the first full copy of one token sends it deep
    rule = RunStatePolicy(5, 1)
    assert rule.choose(_view("r", cap=5)).k == 1
    rule.observe(_view("r", cap=5), None, _result(proposed=1, counts=2), 0.01)  # accepted all (1 of 1)
    assert rule.choose(_view("r", cap=5)).k == 5
    rule.observe(_view("r", cap=5), None, _result(proposed=5, counts=3), 0.01)  # a rejection
    assert rule.choose(_view("r", cap=5)).k == 1
    rule.observe(_view("r", cap=5), None, _result(proposed=0, counts=1), 0.01)  # nothing proposed: no evidence
    assert rule.choose(_view("r", cap=5)).k == 1


def _view(rid, cap):
    from jaxspec.policy.base import BatchView

    return BatchView(request_ids=(rid,), context_lens=(10,), row_max_k=(cap,), k_menu=K_MENU, batch_bucket=1)


def _result(proposed, counts):
    from jaxspec.types import StepResult

    return StepResult(tokens=np.zeros((1, 6), np.int32), counts=np.array([counts]), proposed=np.array([proposed]))
