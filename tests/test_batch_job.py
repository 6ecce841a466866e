"""Offline batch jobs: records, malformed lines, duplicate ids, torn lines, kill -9 and resume.

On the fake engine (tests/batch_job_entry.py: outputs count on from the prompt's last token), so
every record's tokens are known by hand; one end-to-end run on the real tiny engine."""

from __future__ import annotations

import argparse
import collections
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from jaxspec.engine.engine import Engine
from jaxspec.policy.fixed import NoSpeculation
from jaxspec.serving import batch_job
from jaxspec.serving.batch_job import BatchJobError, ResumableOutput, run_batch
from jaxspec.types import SamplingParams
from tests import batch_job_entry
from tests.fake_tokenizer import ASCII_ALPHABET, EOS, ascii_tokenizer

ROOT = Path(__file__).resolve().parents[1]
WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex bold jam".split()

# line number (1-based) -> the error it must produce
MALFORMED = {
    3: "not valid JSON",
    6: "needs exactly one of 'prompt' and 'messages'",
    9: "max_tokens must be > 0",
    12: "expected a JSON object",
    15: "'id' must be a non-empty string or an integer",
    18: "unknown keys ['max_token']",
}
MALFORMED_LINES = {
    3: '{"id": "broken", "prompt": ',
    6: '{"id": "m-none"}',
    9: '{"id": "m-zero", "prompt": "hi", "max_tokens": 0}',
    12: '[1, 2, 3]',
    15: '{"prompt": "no id here"}',
    18: '{"id": "m-typo", "prompt": "hi", "max_token": 5}',
}


def make_input(path: Path, n_good: int = 20) -> None:
    rng = np.random.default_rng(7)
    good = []
    for i in range(n_good):
        prompt = " ".join(rng.choice(WORDS, size=int(rng.integers(1, 8))))
        record = {"id": f"q{i}", "prompt": prompt, "max_tokens": int(rng.integers(6, 15))}
        if i % 5 == 1:
            record.update(temperature=0.8, seed=100 + i)
        if i == 4:
            record = {"id": "chat", "messages": [{"role": "user", "content": prompt}], "max_tokens": 8}
        good.append(json.dumps(record))
    good.append(json.dumps({"id": 7, "prompt": "int id", "max_tokens": 5}))
    good.append(json.dumps({"id": "7", "prompt": "string id", "max_tokens": 5}))
    good.append(json.dumps({"id": "too-long", "prompt": "a" * 70}))
    good.append(json.dumps({"id": "q3", "prompt": "duplicate of q3", "max_tokens": 5}))  # reported, not run
    good.append("")  # blank lines are ignored
    lines, it = [], iter(good)
    for number in range(1, len(good) + len(MALFORMED) + 1):
        lines.append(MALFORMED_LINES[number] if number in MALFORMED_LINES else next(it))
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def line_of(path: Path, raw_id) -> int:
    """The 1-based input line where id `raw_id` first appears."""
    return next(n for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
                if f'"id": {json.dumps(raw_id)}' in line)


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def key(record: dict):
    return json.dumps(record["id"]) if record["id"] is not None else ("line", record["line"])


def outcome(recs: list[dict]) -> dict:
    """The run-independent part of every record (timings differ between runs)."""
    return {key(r): (r["text"], r["token_ids"], r["finish_reason"], r["error"]) for r in recs}


def assert_each_once(recs: list[dict]) -> None:
    counts = collections.Counter(key(r) for r in recs)
    assert all(c == 1 for c in counts.values()), [k for k, c in counts.items() if c > 1]


def counted(path: Path, record: dict, default_max_tokens: int = 128) -> tuple[list[int], str]:
    """(token ids, finish reason) the fake engine gives the first input line with `record`'s id."""
    engine, tok, _ = batch_job_entry.build()
    obj = json.loads(path.read_text(encoding="utf-8").splitlines()[line_of(path, record["id"]) - 1])
    ids = tok.encode(obj["prompt"] if "prompt" in obj else tok.apply_chat_template(obj["messages"]))
    tokens = engine.expected_output(ids, min(obj.get("max_tokens", default_max_tokens), engine.menu.max_len - len(ids)))
    return (tokens[:tokens.index(EOS) + 1], "eos") if EOS in tokens else (tokens, "length")


@pytest.fixture(scope="module")
def job():
    return batch_job_entry.build()  # identical to the subprocess's engine


@pytest.fixture(scope="module")
def reference(job, tmp_path_factory):
    d = tmp_path_factory.mktemp("batch")
    make_input(d / "in.jsonl")
    log = io.StringIO()
    summary = run_batch(*job, d / "in.jsonl", d / "ref.jsonl", progress=False, log=log)
    return d / "in.jsonl", records(d / "ref.jsonl"), summary, log.getvalue()


def test_uninterrupted_run(reference):
    inp, recs, summary, log = reference
    assert_each_once(recs)
    by_key = {key(r): r for r in recs}
    assert len(recs) == 20 + 3 + len(MALFORMED)  # good + int/str ids + too-long + malformed; no duplicate
    for number, error in MALFORMED.items():
        errs = [r for r in recs if r["error"] and f"line {number}:" in r["error"]]
        assert len(errs) == 1 and error in errs[0]["error"] and errs[0]["line"] == number
    assert by_key['"m-zero"']["id"] == "m-zero" and by_key[("line", 15)]["id"] is None
    too_long = by_key['"too-long"']  # fails validate_request: reported with its line, like a malformed one
    assert too_long["finish_reason"] == "error" and "max_len" in too_long["error"]
    assert too_long["line"] == line_of(inp, "too-long")
    assert by_key["7"]["text"] is not None and by_key['"7"']["text"] is not None
    q3 = by_key['"q3"']
    assert "duplicate id 'q3'" in log and summary.duplicates == 1
    assert q3["stats"]["prompt_tokens"] != len("duplicate of q3")  # the first q3 ran, once
    good = [r for r in recs if r["error"] is None]
    assert all((r["token_ids"], r["finish_reason"]) == counted(inp, r) for r in good)
    tok = ascii_tokenizer()
    for r in good:
        assert r["text"] == tok.decode(r["token_ids"]) and set(r["text"]) <= set(ASCII_ALPHABET)
        assert r["stats"]["completion_tokens"] == len(r["token_ids"]) > 0
    assert summary.errors == len(MALFORMED) + 1 and summary.completed == 22 and summary.exit_code == 1
    assert summary.malformed == len(MALFORMED) + 1
    assert summary.acceptance == sum(r["stats"]["accepted"] for r in good) / sum(r["stats"]["proposed"] for r in good)
    assert summary.generated_tokens == sum(len(r["token_ids"]) for r in recs)
    assert "tokens/s" in log and "mean acceptance" in log


def test_rerun_of_a_complete_output_does_nothing(job, reference, tmp_path):
    inp, recs, _, _ = reference
    out = tmp_path / "out.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in recs), encoding="utf-8")
    summary = run_batch(*job, inp, out, progress=False, log=io.StringIO())
    assert summary.already_done == len(recs) and summary.generated_tokens == 0
    assert records(out) == recs


def test_torn_last_line_is_truncated_and_redone(job, reference, tmp_path):
    inp, recs, _, _ = reference
    out = tmp_path / "out.jsonl"
    torn = json.dumps(recs[9])
    out.write_text("".join(json.dumps(r) + "\n" for r in recs[:9]) + torn[: len(torn) // 2], encoding="utf-8")
    run_batch(*job, inp, out, progress=False, log=io.StringIO())
    got = records(out)
    assert_each_once(got)
    assert got[:9] == recs[:9] and outcome(got) == outcome(recs)


def test_corrupt_middle_line_stops_the_job(job, reference, tmp_path):
    inp, recs, _, _ = reference
    out = tmp_path / "out.jsonl"
    out.write_text(json.dumps(recs[0]) + "\nGARBAGE\n" + json.dumps(recs[1]) + "\n", encoding="utf-8")
    args = argparse.Namespace(input=str(inp), output=str(out), max_tokens=8, temperature=0.0, top_p=1.0, top_k=0,
                              seed=None, stop=[], max_queue=8, no_progress=True)
    assert batch_job.run(args, build=lambda a: job) == 2
    with pytest.raises(BatchJobError, match="line 2 is not a batch record"):
        run_batch(*job, inp, out, progress=False, log=io.StringIO())


def test_cli_surface_and_missing_input(job, tmp_path):
    parser = argparse.ArgumentParser()
    batch_job.add_arguments(parser)
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"id": "a", "prompt": "hello"}\n{"id": "b", "prompt": "world", "stop": ["o", "x"]}\n')
    args = parser.parse_args(["--input", str(inp), "--output", str(tmp_path / "o.jsonl"), "--max-tokens", "4",
                              "--no-progress"])
    assert batch_job.run(args, build=lambda a: job) == 0
    recs = records(tmp_path / "o.jsonl")
    assert [r["id"] for r in sorted(recs, key=lambda r: r["id"])] == ["a", "b"]
    assert all(len(r["token_ids"]) <= 4 for r in recs)
    args = parser.parse_args(["--input", str(tmp_path / "missing.jsonl"), "--output", str(tmp_path / "x.jsonl")])
    assert batch_job.run(args, build=lambda a: job) == 2


def test_output_is_locked_against_a_second_job(tmp_path):
    with ResumableOutput(tmp_path / "o.jsonl"):
        with pytest.raises(BatchJobError, match="locked"):
            ResumableOutput(tmp_path / "o.jsonl").__enter__()


def _line_count(path: Path) -> int:
    try:
        return path.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def test_kill_9_at_several_points_then_resume(job, reference, tmp_path):
    inp, recs, _, _ = reference
    out = tmp_path / "out.jsonl"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    # kill points: during start-up, after the first results, near the end of the second run
    for target in (0, len(MALFORMED) + 3, len(MALFORMED) + 12):
        before = _line_count(out)
        proc = subprocess.Popen([sys.executable, "-m", "tests.batch_job_entry", str(inp), str(out),
                                 "--step-delay", "0.05"], cwd=ROOT, env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 90
        while proc.poll() is None and time.monotonic() < deadline:
            if (target == 0 and time.monotonic() > deadline - 89.5) or (target and _line_count(out) >= target):
                break
            time.sleep(0.005)
        proc.send_signal(signal.SIGKILL)
        _, err = proc.communicate()
        assert proc.returncode == -signal.SIGKILL, f"job ended before the kill: {err.decode()[-2000:]}"
        partial = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
        assert_each_once(partial)
        assert _line_count(out) >= before
    done_before = _line_count(out)
    assert len(MALFORMED) + 12 <= done_before < len(recs)
    summary = run_batch(*job, inp, out, progress=False, log=io.StringIO())
    got = records(out)
    assert_each_once(got)
    assert outcome(got) == outcome(recs)
    assert summary.already_done == done_before


def test_stop_strings_and_defaults_reach_the_requests(job, tmp_path):
    inp = tmp_path / "in.jsonl"
    lines = [{"id": "s", "prompt": "a", "stop": "de", "max_tokens": 10}, {"id": "d", "prompt": "a"},
             {"id": "big", "prompt": "a" * 50, "max_tokens": 100}, {"id": "e", "prompt": "'"}]
    inp.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    defaults = SamplingParams(max_tokens=3)
    run_batch(*job, inp, tmp_path / "o.jsonl", defaults=defaults, progress=False, log=io.StringIO())
    got = {r["id"]: r for r in records(tmp_path / "o.jsonl")}
    assert (got["s"]["text"], got["s"]["finish_reason"]) == ("bc", "stop")  # 'a' -> b c d e: cut before "de"
    assert (got["d"]["text"], got["d"]["finish_reason"]) == ("bcd", "length")  # the default max_tokens
    assert (len(got["big"]["token_ids"]), got["big"]["finish_reason"]) == (14, "length")  # the cache: 64 - 50
    assert (got["e"]["token_ids"], got["e"]["finish_reason"]) == ([0, EOS], "eos")  # "'" is id 63: pad, then eos


def test_runs_on_the_real_engine(tiny_model, tmp_path):
    engine = Engine(tiny_model, None, batch_job_entry.MENU.replace(k_menu=(0,)))
    engine.warmup(progress=False)
    inp = tmp_path / "in.jsonl"
    make_input(inp)
    summary = run_batch(engine, ascii_tokenizer(), NoSpeculation(), inp, tmp_path / "o.jsonl", progress=False,
                        log=io.StringIO())
    recs = records(tmp_path / "o.jsonl")
    assert_each_once(recs)
    good = [r for r in recs if r["error"] is None]
    assert summary.completed == len(good) == 22 and summary.errors == len(MALFORMED) + 1
    assert all(r["stats"]["completion_tokens"] == len(r["token_ids"]) > 0 for r in good)
