"""Benchmark workloads: every workload loads from the offline data, seeded and capped."""

import pytest

from benchmarks.workloads import WORKLOADS, load_workload, parse_names


@pytest.mark.parametrize("name", WORKLOADS)
def test_workload_loads_seeded_and_capped(name):
    a = load_workload(name, None, 3, seed=1, max_prompt_tokens=200, max_tokens=12, vocab_size=64)
    b = load_workload(name, None, 3, seed=1, max_prompt_tokens=200, max_tokens=12, vocab_size=64)
    assert len(a) == 3 and a.prompts == b.prompts and a.max_tokens == 12
    assert all(4 <= len(p) <= 200 and all(2 <= t < 64 for t in p) for p in a.prompts)
    assert all(t.strip() for t in a.texts)


def test_seed_changes_selection():
    a = load_workload("chat", None, 4, seed=0, max_prompt_tokens=300, vocab_size=64)
    b = load_workload("chat", None, 4, seed=5, max_prompt_tokens=300, vocab_size=64)
    assert a.prompts != b.prompts


def test_context_is_cut_to_fit_and_keeps_the_instruction():
    w = load_workload("qa", None, 2, max_prompt_tokens=150, vocab_size=64)
    assert all(len(p) == 150 for p in w.prompts)  # long papers are cut exactly to the cap
    assert all(t.rstrip().endswith("?") for t in w.texts)
    sql = load_workload("sql", None, 2, max_prompt_tokens=260, vocab_size=64)
    assert all("CREATE TABLE" in t and "PostgreSQL" in t for t in sql.texts)


def test_parse_names():
    assert parse_names("all") == WORKLOADS
    with pytest.raises(ValueError, match="unknown workload"):
        parse_names("chat,poetry")
