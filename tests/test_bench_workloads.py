"""Benchmark workloads: every workload loads from the offline data, seeded and capped."""

import pytest

from jaxspec.bench.workloads import WORKLOADS, load_workload, parse_names


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


def test_edit_prompts_hold_the_whole_text_they_edit():
    """The editing workload (prompt lookup's): a whole HumanEval function to rename or a whole abstract with
    a word to replace, never cut; the answer would repeat most of the prompt."""
    w = load_workload("edit", None, 4, seed=0, max_prompt_tokens=2000, vocab_size=259)
    assert len(w) == 4 and parse_names("edit") == ("edit",)
    renames = [t for t in w.texts if t.rstrip().endswith("changing nothing else.") and "Rename the function" in t]
    replaces = [t for t in w.texts if "replaced by" in t]
    assert renames and replaces and len(renames) + len(replaces) == 4
    for text in renames:  # the function being renamed is in the prompt, definition and body
        name = text.split("`")[1]
        assert f"def {name}(" in text and "return" in text


def test_parse_names():
    assert parse_names("all") == WORKLOADS
    with pytest.raises(ValueError, match="unknown workload"):
        parse_names("chat,poetry")


def test_agentic_sessions_keep_related_requests_together():
    from jaxspec.bench.workloads import AGENT_SESSION, load_workload

    w = load_workload("agentic", None, 2 * AGENT_SESSION, max_prompt_tokens=512, vocab_size=512)
    again = load_workload("agentic", None, 2 * AGENT_SESSION, max_prompt_tokens=512, vocab_size=512)
    assert w.prompts == again.prompts  # seeded: every policy gets the same requests
    for s in range(2):
        texts = w.texts[s * AGENT_SESSION:(s + 1) * AGENT_SESSION]
        contexts = {t[:60] for t in texts}  # one schema or function (cut to fit, so compared by its start)
        assert len(contexts) == 1 and len(set(texts)) == AGENT_SESSION
        assert len(set(w.sessions[s * AGENT_SESSION:(s + 1) * AGENT_SESSION])) == 1  # one session id each
    assert w.sessions[0] != w.sessions[AGENT_SESSION] and w.head(3).sessions == w.sessions[:3]
    assert load_workload("chat", None, 2, vocab_size=512).sessions == ()  # requests stand alone
