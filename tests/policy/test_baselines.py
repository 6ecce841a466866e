"""Baselines (table, heuristic) and the `--policy` registry."""

from __future__ import annotations

import numpy as np
import pytest

from jaxspec.policy.base import BatchView, Decision
from jaxspec.policy.fixed import FixedPolicy, NoSpeculation
from jaxspec.policy.goodput import GoodputPerRequestPolicy, GoodputPolicy
from jaxspec.policy.heuristic import HeuristicConfig, HeuristicPolicy
from jaxspec.policy.registry import PolicyDefaults, load_defaults, make_policy
from jaxspec.policy.spec import PolicySpec
from jaxspec.policy.table import TablePolicy, parse_table
from jaxspec.types import StepResult
from tests.policy.sim import cost_model, view


def _result(accepted, proposed):
    accepted = np.asarray(accepted)
    return StepResult(tokens=np.zeros((len(accepted), 9), np.int32), counts=accepted + 1,
                      proposed=np.asarray(proposed))


# --- table -----------------------------------------------------------------------------------------

def test_table_is_a_step_function_of_the_live_batch():
    p = TablePolicy({1: 4, 4: 2, 8: 1, 16: 0})
    assert [p.k_for(n) for n in (1, 3, 4, 7, 8, 15, 16, 64)] == [4, 4, 2, 2, 1, 1, 0, 0]
    assert p.choose(view(1)).k == 4
    assert p.choose(view(5)).k == 2
    assert p.choose(view(16)).k == 0
    assert p.name == "table:1=4,4=2,8=1,16=0"


def test_table_clamps_to_menu_and_caps():
    p = TablePolicy({1: 7})
    assert p.choose(view(1, k_menu=(0, 2, 4, 8))).k == 4  # largest menu value <= 7
    capped = p.choose(view(2, caps=(8, 1)))  # like fixed:K: each row's own cap binds, not the batch's
    assert capped.k == max(k for k in view(2).k_menu if k <= 7) and capped.row_k == (capped.k, 1)


def test_table_parsing_and_validation():
    assert parse_table("1=4,4=2,8=1") == {1: 4, 4: 2, 8: 1}
    for bad in ("1=4,x=2", "1:4", "1=4,1=2", ""):
        with pytest.raises(ValueError):
            parse_table(bad)
    with pytest.raises(ValueError, match="start at batch size 1"):
        TablePolicy({4: 2})
    with pytest.raises(ValueError):
        TablePolicy({1: -1})


def test_table_logs_observed_steps():
    p = TablePolicy({1: 2})
    v = view(1)
    d = p.choose(v)
    p.observe(v, d, _result([2], [2]), 0.01)
    assert p.log.to_dicts()[0]["tokens"] == 3 and p.log.to_dicts()[0]["predicted_goodput"] is None


# --- heuristic -----------------------------------------------------------------------------------

def test_heuristic_plus_two_minus_one_per_request():
    p = HeuristicPolicy(HeuristicConfig(initial_k=4, increase=2, decrease=1, min_k=1))
    v = view(2, ids=("a", "b"))
    d = p.choose(v)
    assert d == Decision(k=4)
    p.observe(v, d, _result([4, 1], [4, 4]), 0.01)  # a: all accepted -> 6;  b: not -> 3
    assert p.request_k("a") == 6 and p.request_k("b") == 3
    d = p.choose(v)
    assert d.k == 6 and d.row_k == (6, 3)  # the step's k is the max; rows keep their own
    p.observe(v, d, _result([6, 3], [6, 3]), 0.01)  # both all accepted
    assert p.request_k("a") == 8 and p.request_k("b") == 5
    p.observe(v, p.choose(v), _result([8, 5], [8, 5]), 0.01)
    assert p.request_k("a") == 8  # capped at the menu's largest k
    for _ in range(10):
        p.observe(v, p.choose(v), _result([0, 0], [8, 7]), 0.01)
    assert p.request_k("a") == 1 and p.request_k("b") == 1  # floored at min_k
    p.forget("a")
    assert p.request_k("a") == 4 and len(p.log) == 13


def test_heuristic_step_k_is_a_menu_value_and_rows_respect_caps():
    p = HeuristicPolicy(HeuristicConfig(initial_k=3))
    d = p.choose(view(2, caps=(8, 1), k_menu=(0, 2, 4, 8)))
    assert d.k == 4 and d.row_k == (3, 1)
    d = p.choose(view(1, caps=(0,)))
    assert d.k == 0
    # a long row's cache room is its cap (row_max_k): it verifies less, the other row keeps its k
    # (the engine runs the step at each row's own cap, so one long row takes large k from nobody)
    p = HeuristicPolicy(HeuristicConfig(initial_k=4))
    long_and_short = BatchView(request_ids=("long", "short"), context_lens=(125, 10), row_max_k=(2, 8),
                               k_menu=(0, 1, 2, 4, 8), batch_bucket=2)
    d = p.choose(long_and_short)
    assert d.k == 4 and d.row_k == (2, 4)


def test_heuristic_zero_allowed_rows_are_unchanged():
    p = HeuristicPolicy()
    v = view(2, ids=("a", "b"), caps=(8, 0))
    d = p.choose(v)
    assert d.row_k == (4, 0)
    p.observe(v, d, _result([0, 0], [4, 0]), 0.01)
    assert p.request_k("a") == 3 and p.request_k("b") == 4


# --- registry ---------------------------------------------------------------------------------------

def test_registry_builds_every_spec():
    cm = cost_model()
    assert isinstance(make_policy("none"), NoSpeculation)
    fixed = make_policy("fixed:3")
    assert isinstance(fixed, FixedPolicy) and fixed.k == 3
    table = make_policy("table")
    assert isinstance(table, TablePolicy) and table.table == dict(load_defaults().table)
    assert make_policy("table:1=4,4=2,8=1").table == {1: 4, 4: 2, 8: 1}
    assert isinstance(make_policy("heuristic"), HeuristicPolicy)
    assert type(make_policy("goodput", cost_model=cm)) is GoodputPolicy
    assert type(make_policy("goodput-per-request", cost_model=cm)) is GoodputPerRequestPolicy
    default = load_defaults().goodput.positional
    assert make_policy("goodput", cost_model=cm).config.positional is default
    assert make_policy("goodput:positional", cost_model=cm).config.positional is True
    assert make_policy("goodput-per-request:single", cost_model=cm).config.positional is False
    # deps a policy does not use are fine (the scheduler passes the same ones to every spec)
    assert isinstance(make_policy("fixed:2", cost_model=cm), FixedPolicy)


def test_registry_errors_are_clear():
    for bad in ("bogus", "fixed", "fixed:x", "fixed:-1", "goodput:3", "none:1", "table:1", ""):
        with pytest.raises(ValueError):
            make_policy(bad)
    with pytest.raises(ValueError, match="unknown policy 'bogus'"):
        make_policy("bogus")
    with pytest.raises(ValueError, match="needs cost_model"):
        make_policy("goodput")
    with pytest.raises(TypeError, match="unknown dependencies"):
        make_policy("none", clock=None)


def test_policy_spec_says_what_a_policy_needs():
    menu = (0, 1, 2, 4)
    cases = {  # text: (needs_cost_model, needs_proposer, k values compiled)
        "none": (False, False, (0,)), "fixed:2": (False, True, (2,)), "table": (False, True, menu),
        "table:1=4,4=2": (False, True, menu), "heuristic": (False, True, menu), "goodput": (True, True, menu),
        "goodput-per-request": (True, True, menu), "goodput:positional": (True, True, menu),
        "goodput-per-request:single": (True, True, menu),
    }
    for text, (cost, proposer, ks) in cases.items():
        spec = PolicySpec.parse(f" {text} ")
        assert (spec.needs_cost_model, spec.needs_proposer, spec.k_values(menu)) == (cost, proposer, ks), text
        assert str(spec) == text and PolicySpec.parse(str(spec)) == spec
    assert PolicySpec.parse("fixed:4").k == 4 and PolicySpec.parse("table:4=2,1=3").table == ((1, 3), (4, 2))
    assert PolicySpec.default_for("ngram") == PolicySpec.parse("goodput")
    assert PolicySpec.default_for("none") == PolicySpec.parse("none")
    with pytest.raises(ValueError, match=r"fixed:3 is not in the menu's k values \(0, 1, 2, 4\)"):
        PolicySpec.parse("fixed:3").k_values(menu)
    assert PolicySpec.parse("goodput:positional").positional is True
    assert PolicySpec.parse("goodput:single").positional is False and PolicySpec.parse("goodput").positional is None
    for bad, message in (("fixed", "fixed:K"), ("fixed:-1", "fixed:K"),
                         ("goodput:3", "goodput:positional or goodput:single"), ("table:1", "BATCH=K"),
                         ("bogus", "unknown policy 'bogus'"), ("", "unknown policy")):
        with pytest.raises(ValueError, match=message):
            PolicySpec.parse(bad)


def test_defaults_file(tmp_path):
    d = load_defaults()
    assert isinstance(d, PolicyDefaults) and d.table[0] == (1, 4)
    missing = tmp_path / "p.yaml"
    missing.write_text("table: {1: 2}\n")
    with pytest.raises(ValueError, match="expected sections"):
        load_defaults(missing)
    with pytest.raises(FileNotFoundError):
        load_defaults(tmp_path / "nope.yaml")
    text = (load_defaults.__globals__["DEFAULT_CONFIG"]).read_text().replace("min_k: 1", "min_k: 1\n  typo: 3")
    typo = tmp_path / "typo.yaml"
    typo.write_text(text)
    with pytest.raises(ValueError, match="typo"):
        load_defaults(typo)
    # custom defaults flow into the policies
    custom = tmp_path / "custom.yaml"
    custom.write_text(load_defaults.__globals__["DEFAULT_CONFIG"].read_text().replace("initial_k: 4", "initial_k: 2"))
    assert make_policy("heuristic", defaults=load_defaults(custom)).request_k("x") == 2
