"""`jaxspec batch --ray`: the batch job on a pool of Ray actors, one warmed-up engine each (docs/scale_out.md).

The contract is `jaxspec batch`'s (jaxspec/serving/batch_job.py): the same input lines, records, error records,
duplicate-id handling and exit codes, and the output ends up in input order.

    driver (this process)                          Ray actors (--replicas N, `Replica`)
    read the input, cut it into blocks of lines ─> engine + policy + scheduler, built and warmed once;
    two blocks in flight per replica            <─ a block's records, in input order
    each finished block -> OUT.blocks/block-NNNNNN.jsonl (temp file, fsync, rename, fsync of the directory)
    every block done -> OUT rewritten in input order (the same atomic write), OUT.blocks removed

Resume: a block whose file exists is not run again; a line whose record is already in OUT (from a plain
`jaxspec batch`, or a run killed after its final write) is skipped inside its block. OUT.blocks/job.json
names the input (SHA-256) and the block size; another input or block size is refused. OUT is locked
(`batch_job.ResumableOutput`) for the whole run, against a second job of either kind.

Failure: a replica that dies (ray.kill, out of memory, its node lost) has its blocks put back in the queue
for the others; the job stops (exit 1, finished blocks kept for the rerun) only when no replica is left.
A request that fails inside an engine is an error record (the scheduler's failure isolation).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import hashlib
import json
import os
import shutil
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from tqdm import tqdm

from jaxspec.engine.api import EngineAPI
from jaxspec.engine.args import EngineArgs
from jaxspec.policy.base import Policy
from jaxspec.scheduling.requests import FinishReason, InvalidRequestError, QueueFullError, RequestLimits, RequestResult
from jaxspec.scheduling.scheduler import Scheduler, SchedulerConfig
from jaxspec.serving.batch_job import (
    BatchJobError,
    BatchSummary,
    MalformedLine,
    ResumableOutput,
    error_record,
    fsync_dir,
    input_key,
    parse_line,
    read_input,
    record_key,
    result_record,
)
from jaxspec.types import SamplingParams

#: build() -> (warmed-up engine, tokenizer, policy), run inside each actor; must pickle (a module-level function
#: or a functools.partial of one).
ReplicaBuilder = Callable[[], tuple[EngineAPI, Any, Policy]]

STATE_VERSION = 1
ACTOR_NAME = "jaxspec-batch"  # replicas are named f"{ACTOR_NAME}-{driver pid}-{index}" (ray.util.list_named_actors)
POLL_S = 0.5  # how often the driver asks the replicas how far they are (the progress bar)


@dataclasses.dataclass(frozen=True)
class RayBatchConfig:
    """How the job runs on Ray.

    replicas:      actors, each with its own engine (each takes replica_cpus CPUs and replica_gpus GPUs).
    address:       an existing cluster ("auto", or the head's "HOST:PORT"); None starts a local Ray.
    block_lines:   input lines per block (the unit of scheduling, retry and resume).
    in_flight:     blocks handed to a replica at once (2: its batch never drains between blocks).
    """

    replicas: int = 2
    address: str | None = None
    block_lines: int = 64
    replica_cpus: float = 1.0
    replica_gpus: float = 0.0
    in_flight: int = 2

    def __post_init__(self):
        if self.replicas < 1:
            raise ValueError(f"--replicas must be >= 1, got {self.replicas}")
        if self.block_lines < 1:
            raise ValueError(f"--block-lines must be >= 1, got {self.block_lines}")
        if self.replica_cpus < 0 or self.replica_gpus < 0:
            raise ValueError("--replica-cpus and --replica-gpus must be >= 0")
        if self.in_flight < 1:
            raise ValueError(f"in_flight must be >= 1, got {self.in_flight}")


# --- the CLI surface -------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("Ray (docs/scale_out.md; needs the .[ray] extra)")
    group.add_argument("--ray", action="store_true", help="run the job on a pool of Ray actors, one engine each")
    group.add_argument("--replicas", type=int, default=None, metavar="N", help="with --ray: engines (default 2)")
    group.add_argument("--ray-address", default=None, metavar="ADDR",
                       help="with --ray: join this cluster ('auto' or the head's HOST:PORT); default: a local Ray")
    group.add_argument("--block-lines", type=int, default=None, metavar="L",
                       help="with --ray: input lines per block, the unit of retry and resume (default 64)")
    group.add_argument("--replica-cpus", type=float, default=None, metavar="C", help="with --ray: CPUs per replica "
                       "(default 1)")
    group.add_argument("--replica-gpus", type=float, default=None, metavar="G", help="with --ray: GPUs per replica "
                       "(default 0)")


RAY_ONLY = ("replicas", "ray_address", "block_lines", "replica_cpus", "replica_gpus")


def config_from_args(args: argparse.Namespace) -> RayBatchConfig:
    """The RayBatchConfig of --replicas ... (ValueError for values out of range)."""
    given = {name: getattr(args, name) for name in RAY_ONLY if getattr(args, name, None) is not None}
    if "ray_address" in given:
        given["address"] = given.pop("ray_address")
    return RayBatchConfig(**given)


def ray_flags_without_ray(args: argparse.Namespace) -> list[str]:
    """The --ray-only flags given without --ray (an error: they would be ignored)."""
    return ["--" + name.replace("_", "-") for name in RAY_ONLY if getattr(args, name, None) is not None]


def build_replica(engine_args: EngineArgs) -> tuple[EngineAPI, Any, Policy]:
    """What a replica runs: the runtime `jaxspec batch` builds, without progress bars."""
    from jaxspec.serving.runtime import build_runtime

    runtime = build_runtime(engine_args, progress=False)
    return runtime.engine, runtime.tokenizer, runtime.policy


def run(args: argparse.Namespace, build: ReplicaBuilder, log: TextIO | None = None) -> int:
    """`jaxspec batch --ray ...`: returns the exit code (batch_job's: 0 / 1 / 2)."""
    log = log or sys.stderr
    try:
        config = config_from_args(args)
        defaults = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                  top_k=args.top_k, seed=args.seed, stop_strings=tuple(args.stop))
        defaults.validate()
    except ValueError as exc:
        print(f"jaxspec batch: {exc}", file=log)
        return 2
    try:
        summary = run_ray_batch(build, args.input, args.output, config=config, defaults=defaults,
                                progress=not args.no_progress, max_queue=args.max_queue, log=log)
    except BatchJobError as exc:
        print(f"jaxspec batch: {exc}", file=log)
        return 2
    except ReplicasLost as exc:
        print(f"jaxspec batch: {exc}", file=log)
        return 1
    return summary.exit_code


class ReplicasLost(Exception):
    """Every replica died before the job finished (finished blocks are kept: a rerun resumes)."""


# --- one replica (a Ray actor) ------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class BlockResult:
    """One block's records (serialised as `ResumableOutput.append` writes them) and its counts."""

    index: int
    lines: tuple[str, ...]
    completed: int
    errors: int
    malformed: int
    tokens: int
    proposed: int
    accepted: int
    finish_reasons: dict[str, int]


class Replica:
    """One engine (built and warmed by `build()` once, in the actor's process) with its own policy and a
    scheduler loop of its own; `run` may be called for several blocks at once, which share the batch."""

    def __init__(self, build: ReplicaBuilder, max_queue: int):
        engine, self._tokenizer, policy = build()
        self._limits = RequestLimits.for_engine(engine, self._tokenizer)
        self._scheduler = Scheduler(engine, policy, self._tokenizer, SchedulerConfig(max_queue=max_queue))
        self._scheduler.start()
        self._lock = threading.Lock()
        self._live: dict[int, list] = {}  # block index -> its handles (progress)
        self._description = f"{engine.model_name} / {engine.proposer_name}, mesh {engine.mesh_spec}, pid {os.getpid()}"

    def ready(self) -> str:
        return self._description

    def run(self, index: int, lines: list[tuple[int, str]], defaults: SamplingParams) -> BlockResult:
        records: dict[int, dict] = {}
        handles = []
        malformed = 0
        with self._lock:
            self._live[index] = handles
        try:
            for number, text in lines:
                try:
                    _, raw_id, request = parse_line(text, number, self._tokenizer, defaults, self._limits)
                except MalformedLine as exc:
                    records[number] = error_record(exc.raw_id, number, str(exc))
                    malformed += 1
                    continue
                try:
                    handles.append((number, raw_id, self._submit(request)))
                except InvalidRequestError as exc:
                    records[number] = result_record(raw_id, RequestResult.rejected(request, str(exc)))
            results = []
            for number, raw_id, handle in handles:
                result = handle.result()
                results.append(result)
                records[number] = result_record(raw_id, result)
        finally:
            with self._lock:
                self._live.pop(index, None)
        reasons = collections.Counter(r["finish_reason"] for r in records.values())
        return BlockResult(
            index=index, lines=tuple(json.dumps(records[n], ensure_ascii=False) for n in sorted(records)),
            completed=sum(r.finish_reason is not FinishReason.ERROR for r in results),
            errors=sum(r["error"] is not None for r in records.values()), malformed=malformed,
            tokens=sum(len(r.token_ids) for r in results), proposed=sum(r.proposed for r in results),
            accepted=sum(r.accepted for r in results), finish_reasons=dict(reasons))

    def _submit(self, request):
        while True:  # the queue holds `in_flight` blocks (see run_ray_batch); full only for a moment
            try:
                return self._scheduler.submit(request, stream=False)
            except QueueFullError:
                time.sleep(0.01)

    def progress(self) -> tuple[int, int]:
        """(requests finished, tokens they generated) in the blocks this replica is running."""
        with self._lock:
            done = [h.result() for handles in self._live.values() for _, _, h in handles if h.done()]
        return len(done), sum(len(r.token_ids) for r in done)


# --- the state directory -------------------------------------------------------------------


def write_atomic(path: Path, data: bytes) -> None:
    """`path` holds `data` entirely or not at all, also after a kill -9 or a power cut."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_dir(path.parent)


class BlockState:
    """OUT.blocks/: job.json (input digest, line count, block size) and one file per finished block."""

    def __init__(self, output: Path, digest: str, lines: int, block_lines: int):
        self.dir = output.with_name(output.name + ".blocks")
        self._job = {"version": STATE_VERSION, "input_sha256": digest, "lines": lines, "block_lines": block_lines}

    def open(self) -> BlockState:
        job_file = self.dir / "job.json"
        if job_file.exists():
            try:
                job = json.loads(job_file.read_text(encoding="utf-8"))
            except (OSError, ValueError) as exc:
                raise BatchJobError(f"{job_file} is unreadable ({exc}): delete {self.dir} to start over") from None
            if job != self._job:
                raise BatchJobError(f"{self.dir} holds the blocks of another job ({_describe(job)}; this one: "
                                    f"{_describe(self._job)}): rerun with that input and --block-lines, or delete "
                                    f"{self.dir} to start over")
        else:
            self.dir.mkdir(exist_ok=True)
            fsync_dir(self.dir.parent)
            write_atomic(job_file, json.dumps(self._job).encode())
        return self

    def block_path(self, index: int) -> Path:
        return self.dir / f"block-{index:06d}.jsonl"

    def finished(self, index: int) -> bool:
        return self.block_path(index).exists()

    def save(self, result: BlockResult) -> None:
        write_atomic(self.block_path(result.index), "".join(line + "\n" for line in result.lines).encode("utf-8"))

    def records(self, index: int) -> list[bytes]:
        return self.block_path(index).read_bytes().splitlines() if self.finished(index) else []

    def remove(self) -> None:
        shutil.rmtree(self.dir)
        fsync_dir(self.dir.parent)


def _describe(job: dict) -> str:
    return f"input sha256 {str(job.get('input_sha256'))[:12]}…, {job.get('lines')} lines, " \
           f"--block-lines {job.get('block_lines')}"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(functools.partial(f.read, 1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _record_line_key(line: bytes) -> Any:
    """The key an output record is found by: its id's record_key, or ("line", n) for an id-less error record."""
    record = json.loads(line)
    return record_key(record["id"]) if record["id"] is not None else ("line", record.get("line"))


# --- the job -----------------------------------------------------------------------------------


def run_ray_batch(build: ReplicaBuilder, input_path: str | os.PathLike, output_path: str | os.PathLike, *,
                  config: RayBatchConfig = RayBatchConfig(), defaults: SamplingParams = SamplingParams(),
                  progress: bool = True, max_queue: int = 256, log: TextIO | None = None) -> BatchSummary:
    """Generate a record for every input line not yet done, on `config.replicas` Ray actors, then write
    the output in input order (see the module docstring). Uses the Ray connection of this process if
    there is one, else connects (`config.address`) or starts a local Ray, and shuts down what it started."""
    log = log or sys.stderr
    t0 = time.monotonic()
    input_path, output_path = Path(input_path), Path(output_path)
    lines = read_input(input_path)
    digest = _sha256(input_path)
    counts = collections.Counter()
    reasons: collections.Counter[str] = collections.Counter()
    with ResumableOutput(output_path) as out:
        state = BlockState(output_path, digest, len(lines), config.block_lines).open()
        first_line: dict[str, int] = {}
        order: list[Any] = []  # the output's keys, in input order
        queue: collections.deque[tuple[int, list[tuple[int, str]]]] = collections.deque()
        for index, start in enumerate(range(0, len(lines), config.block_lines)):
            todo = []
            for number, text in lines[start:start + config.block_lines]:
                key = input_key(text)
                if key is not None and key in first_line:
                    counts["duplicates"] += 1
                    print(f"batch: line {number}: duplicate id {json.loads(text)['id']!r} (first on line "
                          f"{first_line[key]}); not run again", file=log)
                    continue
                if key is not None:
                    first_line[key] = number
                order.append(key if key is not None else ("line", number))
                if out.done(key, number):
                    counts["already_done"] += 1
                else:
                    todo.append((number, text))
            if todo and state.finished(index):
                counts["already_done"] += len(todo)
            elif todo:
                queue.append((index, todo))
        generating_s = None
        if queue:
            generating_s = _run_blocks(build, queue, state, config, defaults, max_queue, progress, len(lines),
                                       len(lines) - sum(len(t) for _, t in queue), counts, reasons, log)
        _assemble(output_path, order, state, len(lines), config.block_lines)
    state.remove()
    summary = BatchSummary(
        lines=len(lines), already_done=counts["already_done"], completed=counts["completed"],
        errors=counts["errors"], malformed=counts["malformed"], duplicates=counts["duplicates"],
        generated_tokens=counts["tokens"], elapsed_s=generating_s or time.monotonic() - t0,
        finish_reasons=dict(reasons),
        acceptance=counts["accepted"] / counts["proposed"] if counts["proposed"] else None)
    print(summary.describe(), file=log)
    return summary


def _assemble(output_path: Path, order: list[Any], state: BlockState, n_lines: int, block_lines: int) -> None:
    """Rewrite the output in input order: each key's record from the output (first) or its block, then
    any output records of ids the input does not have, in their old order."""
    old = output_path.read_bytes().splitlines()
    found: dict[Any, bytes] = {}
    for line in old:
        found.setdefault(_record_line_key(line), line)
    for index in range((n_lines + block_lines - 1) // block_lines):
        for line in state.records(index):
            found.setdefault(_record_line_key(line), line)
    missing = [k for k in order if k not in found]
    if missing:  # cannot happen after every block finished; refuse rather than write a short output
        raise BatchJobError(f"no record for {len(missing)} input lines (first: {missing[0]}); rerun to redo them")
    wanted = set(order)
    new = [found[k] for k in order] + [line for line in old if _record_line_key(line) not in wanted]
    data = b"".join(line + b"\n" for line in new)
    if data != b"".join(line + b"\n" for line in old):
        write_atomic(output_path, data)


def _run_blocks(build, queue, state, config, defaults, max_queue, progress, total, initial, counts, reasons,
                log) -> float:
    """Run the queued blocks on the replicas, saving each result as it arrives. Returns the seconds from
    the replicas being ready to the last block (what `jaxspec batch` times: its engine is built first)."""
    ray = _import_ray()
    t_start = time.monotonic()
    _check_reachable(config.address)
    started_ray = not ray.is_initialized()
    if started_ray:
        try:
            ray.init(address=config.address, include_dashboard=False, logging_level="WARNING")
        except ConnectionError as exc:
            raise BatchJobError(f"cannot join the Ray cluster at {config.address}: {exc}") from None
        except Exception as exc:  # Ray raises a bare Exception when its local node misses its startup wait
            if config.address is not None or RAY_STARTUP_TIMEOUT not in str(exc):
                raise
            raise BatchJobError(f"the local Ray did not start ({exc}); rerun, or start one with "
                                f"`ray start --head` and pass --ray-address auto") from None
    replicas: list = []
    try:
        replicas = _start_replicas(ray, build, config, max_queue, log)
        t0 = time.monotonic()
        print(f"batch: {len(replicas)} replicas ready in {t0 - t_start:.1f} s; {len(queue)} blocks to run", file=log)
        bar = tqdm(total=total, initial=initial, desc="batch", unit="req", disable=not progress, file=log,
                   dynamic_ncols=True)
        free = {i: config.in_flight for i in range(len(replicas))}  # live replica -> blocks it can take
        running: dict[Any, tuple[int, tuple[int, list]]] = {}  # ref -> (replica, block)
        done_lines, last_poll = initial, 0.0
        while queue or running:
            for i in free:
                while free[i] > 0 and queue:
                    block = queue.popleft()
                    running[replicas[i].run.remote(block[0], block[1], defaults)] = (i, block)
                    free[i] -= 1
            ready, _ = ray.wait(list(running), num_returns=1, timeout=POLL_S)
            for ref in ready:
                i, block = running.pop(ref)
                try:
                    result: BlockResult = ray.get(ref)
                except ray.exceptions.RayActorError as exc:
                    queue.appendleft(block)
                    if free.pop(i, None) is not None:
                        tqdm.write(f"batch: replica {i} died ({type(exc).__name__}); its blocks go back to the queue",
                                   file=log)
                    if not free:
                        raise ReplicasLost(f"every replica died; {len(queue)} blocks not done (finished blocks are "
                                           f"kept in {state.dir}: rerun to resume)") from None
                    continue
                state.save(result)
                if i in free:
                    free[i] += 1
                done_lines += len(block[1])
                for name in ("completed", "errors", "malformed", "tokens", "proposed", "accepted"):
                    counts[name] += getattr(result, name)
                reasons.update(result.finish_reasons)
            if time.monotonic() - last_poll >= POLL_S:
                last_poll = time.monotonic()
                live_n, live_tokens = _poll(ray, [replicas[i] for i in free])
                bar.n = min(total, done_lines + live_n)
                bar.set_postfix_str(f"{(counts['tokens'] + live_tokens) / max(last_poll - t0, 1e-9):.1f} tok/s "
                                    f"| {len(free)} replicas", refresh=False)
                bar.refresh()
        bar.n = done_lines
        bar.close()
        return time.monotonic() - t0
    finally:
        for replica in replicas:
            ray.kill(replica)
        if started_ray:
            ray.shutdown()


def _poll(ray, replicas) -> tuple[int, int]:
    """(requests, tokens) finished in the blocks the live replicas are running; a dead one counts 0."""
    refs = [r.progress.remote() for r in replicas]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=POLL_S)
    n = tokens = 0
    for ref in ready:
        try:
            a, b = ray.get(ref)
        except ray.exceptions.RayActorError:
            continue
        n, tokens = n + a, tokens + b
    return n, tokens


def _start_replicas(ray, build, config: RayBatchConfig, max_queue: int, log: TextIO) -> list:
    """The replicas that built their engine; BatchJobError when none did or the cluster cannot hold them."""
    have = ray.cluster_resources()
    for name, each in (("CPU", config.replica_cpus), ("GPU", config.replica_gpus)):
        if each * config.replicas > have.get(name, 0.0):
            raise BatchJobError(f"{config.replicas} replicas x {each:g} {name} need {each * config.replicas:g} "
                                f"{name}s; the Ray cluster has {have.get(name, 0.0):g} (lower --replicas, "
                                f"--replica-cpus or --replica-gpus)")
    actor = ray.remote(Replica)
    # the queue of one replica holds every request of its in-flight blocks
    queue = max(max_queue, config.in_flight * config.block_lines)
    started = [actor.options(name=f"{ACTOR_NAME}-{os.getpid()}-{i}", num_cpus=config.replica_cpus,
                             num_gpus=config.replica_gpus, max_restarts=0,
                             max_concurrency=config.in_flight + 1).remote(build, queue)
               for i in range(config.replicas)]
    replicas, errors = [], []
    for i, replica in enumerate(started):
        try:
            description = ray.get(replica.ready.remote())
        except ray.exceptions.RayError as exc:
            errors.append(f"replica {i}: {_cause(exc)}")
            continue
        print(f"batch: replica {i}: {description}", file=log)
        replicas.append(replica)
    for error in errors:
        print(f"batch: {error}", file=log)
    if not replicas:
        raise BatchJobError(f"no replica could build its engine ({errors[0]})")
    return replicas


def _cause(exc: Exception) -> str:
    """The first line of what a replica raised, without Ray's traceback."""
    cause = getattr(exc, "cause", None) or getattr(getattr(exc, "error", None), "cause", None)
    text = f"{type(cause).__name__}: {cause}" if cause is not None else str(exc)
    return text.strip().splitlines()[-1] if text.strip() else type(exc).__name__


RAY_STARTUP_TIMEOUT = "timed out during startup"  # Ray's message when its raylet misses a fixed 30 s wait


def _check_reachable(address: str | None, timeout_s: float = 5.0) -> None:
    """A HOST:PORT address must accept a TCP connection (ray.init would retry for minutes)."""
    if address is None or address == "auto" or "://" in address:
        return
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise BatchJobError(f"--ray-address must be 'auto' or HOST:PORT, got {address!r}")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise BatchJobError(f"no Ray cluster at {address} ({exc}); start one with `ray start --head` "
                            f"or leave out --ray-address for a local Ray") from None


def _import_ray():
    try:
        import ray
    except ImportError:
        raise BatchJobError("--ray needs Ray: pip install 'jaxspec[ray]'") from None
    return ray
