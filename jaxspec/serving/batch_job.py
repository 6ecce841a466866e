"""`jaxspec batch --input IN.jsonl --output OUT.jsonl`: offline generation, crash-safe and resumable.

Input lines:  {"id", "prompt"} or {"id", "messages"} (chat template), optional max_tokens,
              temperature, top_p, top_k, seed, stop (a string or a list). Blank lines are ignored.
Output lines: {"id", "text", "token_ids", "finish_reason", "error", "stats"}; a malformed input line
              or one that fails `jaxspec.scheduling.requests.validate_request` (e.g. a prompt too long for the
              cache) gives an error record with its "line" number (and "id": null if it has none).

Crash safety: the output is append-only; every record is one write, flushed and fsynced before the
next request's result is written, so a kill -9 loses only in-flight requests. On start, a torn last
line (no newline: killed mid-write) is truncated away; ids (and id-less error lines) already in the
output are skipped, so a rerun completes the file with every id exactly once (an error record
counts as done: delete its line to have it redone). A duplicate id in the input is reported (log
and summary) and not run twice. An exclusive lock refuses a second job on the same output file.

Exit code: 0 every line has a good record, 1 finished with error records or duplicate ids,
2 could not run (unreadable input, corrupt output, locked output).
"""

from __future__ import annotations

import argparse
import dataclasses
import fcntl
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TextIO

from tqdm import tqdm

from jaxspec.engine.api import EngineAPI
from jaxspec.policy.base import Policy
from jaxspec.scheduling.requests import (
    FinishReason,
    InvalidRequestError,
    Request,
    RequestLimits,
    RequestResult,
    validate_request,
)
from jaxspec.scheduling.scheduler import Scheduler, SchedulerConfig
from jaxspec.types import SamplingParams

SAMPLING_KEYS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop")
ALLOWED_KEYS = frozenset(("id", "prompt", "messages", *SAMPLING_KEYS))

#: build(args) -> (warmed-up engine, tokenizer, policy); jaxspec/cli.py supplies it.
Builder = Callable[[argparse.Namespace], tuple[EngineAPI, Any, Policy]]


class BatchJobError(Exception):
    """The job cannot run (input, output or lock problem); the message says what to fix."""


class MalformedLine(ValueError):
    """An input line that cannot become a request."""

    def __init__(self, message: str, raw_id: Any = None):
        super().__init__(message)
        self.raw_id = raw_id


# --- the CLI surface -------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The batch subcommand's own flags (model / proposer / policy flags are the builder's)."""
    parser.add_argument("--input", required=True, help="input JSONL: {id, prompt | messages, [sampling params]}")
    parser.add_argument("--output", required=True, help="output JSONL (appended to; a rerun resumes it)")
    parser.add_argument("--max-tokens", type=int, default=128, help="default max_tokens per request")
    parser.add_argument("--temperature", type=float, default=0.0, help="default temperature (0 = greedy)")
    parser.add_argument("--top-p", type=float, default=1.0, help="default top_p")
    parser.add_argument("--top-k", type=int, default=0, help="default top_k (0 = off)")
    parser.add_argument("--seed", type=int, default=None, help="default seed of sampled requests")
    parser.add_argument("--stop", action="append", default=[], help="default stop string (repeatable)")
    parser.add_argument("--max-queue", type=int, default=256, help="requests queued ahead of the engine")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace, build: Builder) -> int:
    """Run the job described by `args` on what `build(args)` returns (a warmed-up engine, its
    tokenizer, a policy); returns the exit code."""
    try:
        defaults = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                  top_k=args.top_k, seed=args.seed, stop_strings=tuple(args.stop))
        defaults.validate()
    except ValueError as exc:
        print(f"jaxspec batch: {exc}", file=sys.stderr)
        return 2
    engine, tokenizer, policy = build(args)
    try:
        summary = run_batch(engine, tokenizer, policy, args.input, args.output, defaults=defaults,
                            progress=not args.no_progress, max_queue=args.max_queue,
                            overlap=not getattr(args, "no_overlap", False))
    except BatchJobError as exc:
        print(f"jaxspec batch: {exc}", file=sys.stderr)
        return 2
    return summary.exit_code


# --- the job -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class BatchSummary:
    """What one run did.

    already_done:  input lines skipped because the output holds their record (resume).
    completed:     requests finished this run without error.
    errors:        error records written this run (malformed lines included).
    duplicates:    input lines whose id appeared on an earlier line (reported, not run).
    tokens_per_s:  generated tokens / wall time of this run.
    acceptance:    accepted / proposed speculative tokens this run (None without speculation).
    """

    lines: int
    already_done: int
    completed: int
    errors: int
    malformed: int
    duplicates: int
    generated_tokens: int
    elapsed_s: float
    finish_reasons: dict[str, int]
    acceptance: float | None

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def exit_code(self) -> int:
        return 0 if self.errors == 0 and self.duplicates == 0 else 1

    def describe(self) -> str:
        acc = "n/a" if self.acceptance is None else f"{self.acceptance:.3f}"
        reasons = ", ".join(f"{k}={v}" for k, v in sorted(self.finish_reasons.items())) or "none"
        return (f"batch: {self.lines} lines | {self.already_done} already done | {self.completed} completed | "
                f"{self.errors} errors ({self.malformed} malformed) | {self.duplicates} duplicate ids\n"
                f"batch: {self.generated_tokens} tokens in {self.elapsed_s:.2f} s = {self.tokens_per_s:.1f} tokens/s | "
                f"mean acceptance {acc} | finish reasons: {reasons}")


def run_batch(engine: EngineAPI, tokenizer: Any, policy: Policy | None, input_path: str | os.PathLike,
              output_path: str | os.PathLike, *, defaults: SamplingParams = SamplingParams(), progress: bool = True,
              max_queue: int = 256, log: TextIO | None = None, overlap: bool = True) -> BatchSummary:
    """Generate a record for every input line not yet in the output (see the module docstring).
    The engine must be warmed up (a shape outside its menu fails the requests that need it).
    overlap=False: the synchronous scheduler loop (`--no-overlap`)."""
    log = log or sys.stderr
    t0 = time.monotonic()
    lines = read_input(Path(input_path))
    limits = RequestLimits.for_engine(engine, tokenizer)
    with ResumableOutput(Path(output_path)) as out:
        scheduler = Scheduler(engine, policy, tokenizer, SchedulerConfig(max_queue=max_queue, overlap=overlap))
        counts = dict(already_done=0, completed=0, errors=0, malformed=0, duplicates=0, tokens=0, proposed=0,
                      accepted=0)
        reasons: dict[str, int] = {}
        raw_ids: dict[str, Any] = {}  # scheduler id -> the input's id, while in flight
        bar = tqdm(total=len(lines), desc="batch", unit="req", disable=not progress, file=log, dynamic_ncols=True)

        def write(record: dict) -> None:
            out.append(record)
            bar.update(1)
            if record["error"] is not None:
                counts["errors"] += 1
            reasons[record["finish_reason"]] = reasons.get(record["finish_reason"], 0) + 1

        def requests() -> Iterator[Request]:
            first_line: dict[str, int] = {}
            for number, text in lines:
                request, error = None, None
                try:
                    key, raw_id, request = parse_line(text, number, tokenizer, defaults, limits)
                except MalformedLine as exc:
                    raw_id, error = exc.raw_id, str(exc)
                    key = record_key(raw_id) if raw_id is not None else None
                if key is not None:
                    if key in first_line:
                        counts["duplicates"] += 1
                        bar.update(1)
                        tqdm.write(f"batch: line {number}: duplicate id {raw_id!r} (first on line "
                                   f"{first_line[key]}); not run again", file=log)
                        continue
                    first_line[key] = number
                if out.done(key, number):
                    counts["already_done"] += 1
                    bar.update(1)
                elif request is None:
                    counts["malformed"] += 1
                    write(error_record(raw_id, number, error))
                else:
                    raw_ids[key] = raw_id
                    yield request

        for result in scheduler.iter_completed(requests()):
            record = result_record(raw_ids.pop(result.request_id), result)
            write(record)
            if result.finish_reason is not FinishReason.ERROR:
                counts["completed"] += 1
            counts["tokens"] += len(result.token_ids)
            counts["proposed"] += result.proposed
            counts["accepted"] += result.accepted
            elapsed = time.monotonic() - t0
            bar.set_postfix_str(f"{counts['tokens'] / max(elapsed, 1e-9):.1f} tok/s", refresh=False)
        bar.close()
    summary = BatchSummary(
        lines=len(lines), already_done=counts["already_done"], completed=counts["completed"], errors=counts["errors"],
        malformed=counts["malformed"], duplicates=counts["duplicates"], generated_tokens=counts["tokens"],
        elapsed_s=time.monotonic() - t0, finish_reasons=reasons,
        acceptance=counts["accepted"] / counts["proposed"] if counts["proposed"] else None)
    print(summary.describe(), file=log)
    return summary


# --- input ---------------------------------------------------------------------------------


def read_input(path: Path) -> list[tuple[int, str]]:
    """(1-based line number, text) of every non-blank line."""
    try:
        with path.open("r", encoding="utf-8") as f:
            return [(n, line) for n, line in enumerate(f, 1) if line.strip()]
    except (OSError, UnicodeDecodeError) as exc:
        raise BatchJobError(f"cannot read input {path}: {exc}") from None


def record_key(raw_id: Any) -> str:
    """The scheduler's request id for an input id (1 and "1" stay distinct)."""
    return json.dumps(raw_id, ensure_ascii=False)


def _valid_id(raw_id: Any) -> bool:
    return not isinstance(raw_id, bool) and isinstance(raw_id, (str, int)) and raw_id != ""


def input_key(text: str) -> str | None:
    """The `record_key` of an input line's id, or None for a line without a valid one (what resume and
    duplicate detection go by, as `parse_line` would find it)."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return None
    raw_id = obj.get("id") if isinstance(obj, dict) else None
    return record_key(raw_id) if _valid_id(raw_id) else None


def parse_line(text: str, number: int, tokenizer: Any, defaults: SamplingParams,
                limits: RequestLimits) -> tuple[str, Any, Request]:
    """(scheduler id, input id, a request that passed `validate_request`); MalformedLine says why not."""
    where = f"line {number}"
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise MalformedLine(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(obj, dict):
        raise MalformedLine(f"{where}: expected a JSON object, got {type(obj).__name__}")
    raw_id = obj.get("id")
    if not _valid_id(raw_id):
        raise MalformedLine(f"{where}: 'id' must be a non-empty string or an integer, got {raw_id!r}")
    try:
        unknown = sorted(set(obj) - ALLOWED_KEYS)
        if unknown:
            raise ValueError(f"unknown keys {unknown} (allowed: {sorted(ALLOWED_KEYS)})")
        if ("prompt" in obj) == ("messages" in obj):
            raise ValueError("needs exactly one of 'prompt' and 'messages'")
        if "prompt" in obj:
            if not isinstance(obj["prompt"], str):
                raise ValueError("'prompt' must be a string")
            ids = _tokenize(lambda: tokenizer.encode(obj["prompt"]))
        else:
            messages = obj["messages"]
            if not isinstance(messages, list) or not all(
                    isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                    for m in messages):
                raise ValueError("'messages' must be a list of {role, content} string objects")
            ids = _tokenize(lambda: tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False))
        key = record_key(raw_id)
        request = Request(key, ids, _sampling_params(obj, defaults))
        validate_request(request, limits)
    except InvalidRequestError as exc:
        raise MalformedLine(f"{where}: {exc.reason}", raw_id) from None
    except ValueError as exc:
        raise MalformedLine(f"{where}: {exc}", raw_id) from None
    return key, raw_id, request


def _tokenize(encode: Callable[[], list[int]]) -> list[int]:
    try:
        return encode()
    except Exception as exc:  # noqa: BLE001 - any tokenizer failure makes this line (only) malformed
        raise ValueError(f"tokenization failed: {exc}") from None


def _sampling_params(obj: dict, defaults: SamplingParams) -> SamplingParams:
    changes: dict[str, Any] = {}
    for name, kinds in (("max_tokens", int), ("top_k", int), ("seed", int), ("temperature", (int, float)),
                        ("top_p", (int, float))):
        if name in obj:
            value = obj[name]
            if isinstance(value, bool) or not isinstance(value, kinds):
                raise ValueError(f"'{name}' must be a number{'' if kinds is not int else ' (integer)'}, got {value!r}")
            changes[name] = value
    if "stop" in obj:
        stop = obj["stop"]
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise ValueError("'stop' must be a non-empty string or a list of them")
        changes["stop_strings"] = tuple(stop)
    return dataclasses.replace(defaults, **changes)  # validated with the request


# --- output --------------------------------------------------------------------------------


def error_record(raw_id: Any, number: int, error: str) -> dict:
    return {"id": raw_id, "line": number, "text": None, "token_ids": [], "finish_reason": FinishReason.ERROR.value,
            "error": error, "stats": None}


def result_record(raw_id: Any, result: RequestResult) -> dict:
    return {"id": raw_id, "text": result.text, "token_ids": list(result.token_ids),
            "finish_reason": result.finish_reason.value, "error": result.error, "stats": result.stats()}


class ResumableOutput:
    """The append-only output file: repairs a torn tail, knows what is done, appends durably."""

    def __init__(self, path: Path):
        self.path = path
        self._fd: int | None = None
        self._done_keys: set[str] = set()
        self._done_lines: set[int] = set()  # input lines of id-less error records

    def __enter__(self) -> ResumableOutput:
        new = not self.path.exists()
        try:
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        except OSError as exc:
            raise BatchJobError(f"cannot open output {self.path}: {exc}") from None
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._fd)
            raise BatchJobError(f"output {self.path} is locked by another running batch job") from None
        try:
            if new:
                fsync_dir(self.path.parent)
            self._load()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            os.close(self._fd)  # releases the lock
            self._fd = None

    def done(self, key: str | None, line: int) -> bool:
        return (key in self._done_keys) if key is not None else (line in self._done_lines)

    def append(self, record: dict) -> None:
        """One line, one write, then fsync: after this returns the record survives a kill -9."""
        data = (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8")
        view = memoryview(data)
        while view:
            written = os.write(self._fd, view)
            view = view[written:]
        os.fsync(self._fd)
        self._remember(record)

    def _remember(self, record: dict) -> None:
        if record.get("id") is not None:
            self._done_keys.add(record_key(record["id"]))
        elif isinstance(record.get("line"), int):
            self._done_lines.add(record["line"])

    def _load(self) -> None:
        data = os.pread(self._fd, os.fstat(self._fd).st_size, 0)
        keep = data.rfind(b"\n") + 1  # a last line without its newline was torn by a kill
        if keep < len(data):
            os.ftruncate(self._fd, keep)
            os.fsync(self._fd)
        for number, line in enumerate(data[:keep].splitlines(), 1):
            try:
                record = json.loads(line)
                if not isinstance(record, dict) or "id" not in record:
                    raise ValueError("not a record")
            except (ValueError, UnicodeDecodeError):
                raise BatchJobError(f"output {self.path} line {number} is not a batch record; "
                                    f"remove or fix that line, then rerun") from None
            self._remember(record)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
