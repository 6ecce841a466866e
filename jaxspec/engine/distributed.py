"""Multi-process (multi-host) JAX for the engine: multi-controller SPMD (docs/multiprocess.md).

Every process runs the same command with its own `--process-id` (or $JAXSPEC_PROCESS_ID). `initialize`
starts `jax.distributed` (gloo collectives on CPU) before anything touches a device, so `jax.devices()` is
every process's devices and the engine's mesh (jaxspec.mesh) may span processes. Each process builds the
same engine (same flags, same menu). Process 0, the *leader*, runs the command as in one process (the
scheduler, the policy, the gRPC server, the batch job) on a `LeaderEngine`: before each call that changes
engine state (warmup, admit, prefill_chunk, step, dispatch_step and the reading of a dispatched step, free, reset; a
step's draft catch-up runs inside it) it sends
the call and its host arguments to every other process, then makes it itself. The others, *followers*, run
`follow(engine, link)`: they make each received call on their own engine, so every process calls the same
executables in the same order with the same host inputs; outputs are read on process 0 only.

Control channel: the leader listens on the coordinator's host (the address the followers dial) at the
coordinator's port + 1 (`CONTROL_PORT_OFFSET`) with `multiprocessing.connection`: an HMAC challenge both ways
(a follower proves the key to the leader, the leader to the follower) with `control_key`, derived from a
secret shared out of band ($JAXSPEC_DIST_SECRET or the file $JAXSPEC_DIST_SECRET_FILE, never a flag: argv is
public). Off loopback the run refuses to start without one; on loopback, without one, the key is derived from
the coordinator address alone (it keeps unrelated local runs apart; it is not a secret). Messages are JSON
(never pickle), each with a sequence number the follower checks.

Failure (measured on CPU, 2 processes on 127.0.0.1):
- A follower dies: the leader's watchdog thread reads EOF on its connection at once and the leader exits 1
  with "jaxspec: multi-process: process I of N disconnected ...". A collective in flight fails too (gloo:
  "Connection reset by peer"); an engine call that fails in a multi-process run is fatal (the processes'
  states can no longer be kept in step), after a grace period that lets the watchdog name the dead peer.
- The leader dies: each follower's reader thread reads EOF and the follower exits 1 with "jaxspec:
  multi-process: lost the leader (process 0) ...".
- A process that stops without closing its connections (frozen, host cut off): jax's coordination service
  misses its heartbeats for `HEARTBEAT_TIMEOUT_S` and aborts the others (jax's own abort, exit 134, long log;
  not measured here). A process whose Python code hangs while it lives is not detected.
These exits use os._exit: a normal exit would wait in jax.distributed's shutdown barrier for the dead peer
and then abort. A follower whose engine call fails reports the error to the leader, which exits 1 naming it.
Deterministic host-side errors (CapacityError, MenuMissError: raised before any device work, the same on
every process) are not failures: the leader's driver handles them, followers skip the call.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import hmac
import ipaddress
import json
import os
import queue
import signal
import socket
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection, Listener
from typing import Any, NoReturn

import numpy as np

from jaxspec.engine.api import EngineAPI, PagesExhaustedError, prefill_prompt
from jaxspec.menu import CapacityError, CatchUpKey, MenuMissError, PrefillKey, ShapeKey, StepKey
from jaxspec.types import SamplingParams, StepResult

ENV_COORDINATOR = "JAXSPEC_COORDINATOR"
ENV_NUM_PROCESSES = "JAXSPEC_NUM_PROCESSES"
ENV_PROCESS_ID = "JAXSPEC_PROCESS_ID"
ENV_SECRET = "JAXSPEC_DIST_SECRET"  # the control channel's shared secret (required off loopback)
ENV_SECRET_FILE = "JAXSPEC_DIST_SECRET_FILE"  # or a file holding it
MIN_SECRET_BYTES = 16
CONTROL_PORT_OFFSET = 1  # the leader's control channel: coordinator port + 1
HEARTBEAT_TIMEOUT_S = 10  # jax.distributed: a process silent this long is dead (the others are terminated)
CONNECT_TIMEOUT_S = 120  # processes starting up: jax.distributed.initialize and the control channel
SHUTDOWN_TIMEOUT_S = 60  # jax.distributed's shutdown barrier at exit
FAILURE_GRACE_S = 3.0  # after a failed engine call: time for a peer's death or error report to arrive
# raised on the host before device work, alike everywhere (the page pools are mirrored too)
DETERMINISTIC_ERRORS = (CapacityError, MenuMissError, PagesExhaustedError)
# what followers mirror (reading a dispatched step moves the host mirrors that choose the next step's shape)
MUTATING_CALLS = ("warmup", "admit", "prefill_chunk", "step", "dispatch_step", "read_step", "free", "reset")
KEY_TYPES = {cls.__name__: cls for cls in (StepKey, PrefillKey, CatchUpKey)}


def fatal(message: str) -> NoReturn:
    """One line on stderr, then exit 1 at once (no jax.distributed shutdown barrier: a peer is gone)."""
    try:
        sys.stdout.flush()
        print(f"jaxspec: multi-process: {message}", file=sys.stderr, flush=True)
    finally:
        os._exit(1)


# --- which process this is ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DistributedSpec:
    """This process's place in a multi-process run: the coordinator (HOST:PORT, process 0's jax.distributed
    service), how many processes and which one this is. num_processes=1: a plain single-process run."""

    coordinator: str | None = None
    num_processes: int = 1
    process_id: int = 0
    secret: bytes | None = dataclasses.field(default=None, repr=False, compare=False)  # see `read_secret`

    def __post_init__(self):
        if self.num_processes < 1:
            raise ValueError(f"--num-processes must be >= 1, got {self.num_processes}")
        if not 0 <= self.process_id < self.num_processes:
            raise ValueError(f"--process-id must be in [0, {self.num_processes}), got {self.process_id}")
        if self.num_processes > 1:
            if not self.coordinator:
                raise ValueError(f"--num-processes {self.num_processes} needs --coordinator HOST:PORT "
                                 f"(or ${ENV_COORDINATOR})")
            host, sep, port = self.coordinator.rpartition(":")
            if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535 - CONTROL_PORT_OFFSET:
                raise ValueError(f"--coordinator must be HOST:PORT with PORT in [1, {65535 - CONTROL_PORT_OFFSET}], "
                                 f"got {self.coordinator!r}")
            if self.secret is None and not is_loopback(self.control_address[0]):
                raise ValueError(f"--coordinator {self.coordinator} is off loopback: the control channel needs a "
                                 f"secret shared by every process, in ${ENV_SECRET} or a file named by "
                                 f"${ENV_SECRET_FILE} (e.g. `openssl rand -hex 32`); see docs/multiprocess.md")

    @property
    def enabled(self) -> bool:
        return self.num_processes > 1

    @property
    def is_leader(self) -> bool:
        return self.process_id == 0

    @property
    def control_address(self) -> tuple[str, int]:
        """(host, port) of the leader's control channel: the coordinator's host, its port + 1."""
        host, _, port = self.coordinator.rpartition(":")
        return host.strip("[]"), int(port) + CONTROL_PORT_OFFSET

    @classmethod
    def from_values(cls, coordinator: str | None = None, num_processes: int | None = None,
                    process_id: int | None = None, env: Mapping[str, str] | None = None) -> DistributedSpec:
        """Flags win over $JAXSPEC_COORDINATOR / $JAXSPEC_NUM_PROCESSES / $JAXSPEC_PROCESS_ID."""
        env = os.environ if env is None else env

        def number(value: int | None, name: str, default: int) -> int:
            if value is not None:
                return value
            text = env.get(name, "").strip()
            if not text:
                return default
            try:
                return int(text)
            except ValueError:
                raise ValueError(f"${name} must be an integer, got {text!r}") from None

        return cls(coordinator=coordinator or env.get(ENV_COORDINATOR) or None,
                   num_processes=number(num_processes, ENV_NUM_PROCESSES, 1),
                   process_id=number(process_id, ENV_PROCESS_ID, 0), secret=read_secret(env))

    @classmethod
    def from_args(cls, args: argparse.Namespace, env: Mapping[str, str] | None = None) -> DistributedSpec:
        return cls.from_values(getattr(args, "coordinator", None), getattr(args, "num_processes", None),
                               getattr(args, "process_id", None), env)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """--coordinator, --num-processes, --process-id (docs/multiprocess.md)."""
    group = parser.add_argument_group("multi-process (docs/multiprocess.md)")
    group.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                       help=f"process 0's address for jax.distributed; its control channel uses PORT+"
                       f"{CONTROL_PORT_OFFSET} (default: ${ENV_COORDINATOR})")
    group.add_argument("--num-processes", type=int, default=None, metavar="N",
                       help=f"processes in the run, each started with the same flags (default: "
                       f"${ENV_NUM_PROCESSES}, else 1)")
    group.add_argument("--process-id", type=int, default=None, metavar="I",
                       help=f"this process, 0..N-1; 0 runs the command, the others mirror its engine calls "
                       f"(default: ${ENV_PROCESS_ID}, else 0)")


# --- start-up ------------------------------------------------------------------------------------


def read_secret(env: Mapping[str, str]) -> bytes | None:
    """The control channel's shared secret: $JAXSPEC_DIST_SECRET, or the contents of the file
    $JAXSPEC_DIST_SECRET_FILE (one trailing newline dropped); None when neither is set. ValueError for both,
    an unreadable file, or fewer than MIN_SECRET_BYTES bytes."""
    value, path = env.get(ENV_SECRET), env.get(ENV_SECRET_FILE)
    if value is not None and path is not None:
        raise ValueError(f"set ${ENV_SECRET} or ${ENV_SECRET_FILE}, not both")
    if path is not None:
        try:
            secret = open(path, "rb").read().removesuffix(b"\n")
        except OSError as exc:
            raise ValueError(f"${ENV_SECRET_FILE}: cannot read {path}: {exc.strerror}") from None
    elif value is not None:
        secret = value.encode()
    else:
        return None
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"the control channel's secret must have at least {MIN_SECRET_BYTES} bytes, got "
                         f"{len(secret)} (e.g. `openssl rand -hex 32`)")
    return secret


def is_loopback(host: str) -> bool:
    """Whether `host` (an address or a name) is this machine's loopback only: every address it resolves to is."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False  # unresolvable here: not known to be loopback
    return bool(infos) and all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos)


def control_key(spec: DistributedSpec) -> bytes:
    """The control channel's HMAC key: HMAC-SHA256 of the run (coordinator, process count) under the shared
    secret; without a secret (loopback only, see DistributedSpec) the run's description itself."""
    run = f"jaxspec-control:{spec.coordinator}:{spec.num_processes}".encode()
    if spec.secret is None:
        return run
    return hmac.new(spec.secret, run, hashlib.sha256).digest()


def initialize(spec: DistributedSpec) -> LeaderLink | FollowerLink | None:
    """Start jax.distributed (before anything touches a device) and the control channel; None for a
    single-process run. Every process of the run must call this."""
    if not spec.enabled:
        return None
    import jax

    if spec.secret is None and not is_loopback(spec.control_address[0]):  # DistributedSpec refuses this too
        raise ValueError(f"--coordinator {spec.coordinator} is off loopback: set ${ENV_SECRET} or ${ENV_SECRET_FILE}")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU collectives across processes
    sigterm = signal.getsignal(signal.SIGTERM)
    jax.distributed.initialize(spec.coordinator, num_processes=spec.num_processes, process_id=spec.process_id,
                               initialization_timeout=CONNECT_TIMEOUT_S, heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT_S,
                               shutdown_timeout_seconds=SHUTDOWN_TIMEOUT_S)
    if sigterm is not None:  # jax's preemption notifier swallows SIGTERM; keep `kill PID` working
        signal.signal(signal.SIGTERM, sigterm)
    _keep_stdout_for_python()
    if spec.is_leader:
        return LeaderLink.accept(spec)
    return FollowerLink.connect(spec)


def _keep_stdout_for_python() -> None:
    """Send what native code writes to stdout (gloo's "[Gloo] Rank 0 is connected to 1 peer ranks" when its
    first collective connects) to stderr, so the commands' stdout (`generate --json`) stays clean: fd 1 becomes
    a copy of fd 2 and Python's sys.stdout writes to a duplicate of the original stdout."""
    sys.stdout.flush()
    original = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = os.fdopen(original, "w", buffering=1 if sys.stdout.line_buffering else -1,
                           encoding=sys.stdout.encoding, errors=sys.stdout.errors)


# --- the leader ------------------------------------------------------------------------------------


class LeaderLink:
    """Process 0's connections to every follower: sends each call (numbered); a watchdog thread per
    follower exits the process when that follower disconnects or reports an error."""

    def __init__(self, conns: dict[int, Connection], spec: DistributedSpec):
        self.spec = spec
        self._conns = conns
        self._seq = 0
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self.failure: str | None = None  # set by a watchdog just before it ends the process
        for pid, conn in conns.items():
            threading.Thread(target=self._watch, args=(pid, conn), name=f"jaxspec-watch-{pid}", daemon=True).start()

    @classmethod
    def accept(cls, spec: DistributedSpec) -> LeaderLink:
        address = spec.control_address
        try:
            listener = Listener(address, authkey=control_key(spec))
        except OSError as exc:
            raise OSError(f"cannot listen for the other processes on {address[0]}:{address[1]} (coordinator port + "
                          f"{CONTROL_PORT_OFFSET}): {exc}") from None
        conns: dict[int, Connection] = {}

        def accept_all() -> None:
            while len(conns) < spec.num_processes - 1:
                try:
                    conn = listener.accept()
                    hello = json.loads(conn.recv_bytes())
                except (OSError, EOFError, ValueError, AuthenticationError):
                    continue  # a stray connection, or one without the key
                pid = hello.get("process")
                if isinstance(pid, int) and 0 < pid < spec.num_processes and pid not in conns:
                    conns[pid] = conn
                else:
                    conn.close()

        thread = threading.Thread(target=accept_all, daemon=True)
        thread.start()
        thread.join(CONNECT_TIMEOUT_S)
        listener.close()
        if thread.is_alive():
            missing = sorted(set(range(1, spec.num_processes)) - set(conns))
            raise RuntimeError(f"processes {missing} did not connect to {address[0]}:{address[1]} within "
                               f"{CONNECT_TIMEOUT_S} s")
        return cls(conns, spec)

    def _watch(self, pid: int, conn: Connection) -> None:
        """Followers only ever send an error report; EOF before `close` means the follower died."""
        try:
            report = json.loads(conn.recv_bytes()).get("error", "an unreadable report")
            why = f"failed: {report}"
        except (EOFError, OSError, ValueError):
            why = "disconnected (died or was killed)"
        if self._closing.is_set():
            return
        self.failure = f"process {pid} of {self.spec.num_processes} {why}; exiting"
        fatal(self.failure)

    def send(self, call: str, args: dict[str, Any]) -> None:
        """Send one call to every follower."""
        with self._lock:
            if self._closing.is_set():
                raise RuntimeError(f"engine call {call} after the other processes were told to stop")
            self._seq += 1
            data = json.dumps({"seq": self._seq, "call": call, "args": args}).encode()
            for pid, conn in self._conns.items():
                try:
                    conn.send_bytes(data)
                except OSError as exc:
                    self.await_failure()
                    fatal(f"process {pid} of {self.spec.num_processes} is unreachable ({exc}); exiting")

    def await_failure(self) -> None:
        """Give a watchdog FAILURE_GRACE_S to notice a dead or failed follower (it then ends the process)."""
        time.sleep(FAILURE_GRACE_S)

    def close(self, ok: bool = True, reason: str = "") -> None:
        """Tell every follower to stop (exit 0, or 1 when not ok); then their disconnects are expected."""
        with self._lock:
            if self._closing.is_set():
                return
            self._closing.set()
            self._seq += 1
            data = json.dumps({"seq": self._seq, "call": "stop", "args": {"ok": ok, "reason": reason}}).encode()
            for conn in self._conns.values():
                try:
                    conn.send_bytes(data)
                except OSError:
                    pass  # that follower is gone already: nothing to stop

    def __enter__(self) -> LeaderLink:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(ok=exc_type is None, reason="" if exc is None else f"{type(exc).__name__}: {exc}")


class LeaderEngine:
    """The leader's engine (an `EngineAPI`): each state-changing call goes to every follower first, then to
    the local engine; reads are local. An engine call that fails (other than the deterministic host-side
    errors) ends the run: the processes could no longer be kept in step."""

    def __init__(self, engine: EngineAPI, link: LeaderLink):
        self.engine = engine
        self.link = link
        self._lock = threading.RLock()  # send + run as one: calls from different threads stay in one order
        self.menu = engine.menu
        self.model_name = engine.model_name
        self.vocab_size = engine.vocab_size
        self.eos_token_ids = engine.eos_token_ids
        self.proposer_name = engine.proposer_name
        self.dtype = engine.dtype
        self.mesh_spec = engine.mesh_spec
        self.kernels = engine.kernels
        self._dispatched = 0  # dispatch_step calls so far: a dispatched step's id
        self.logprobs = engine.logprobs
        with self._lock:
            link.send("hello", fingerprint(engine))

    def _run(self, call: str, args: dict[str, Any], local):
        with self._lock:
            self.link.send(call, args)
            try:
                return local()
            except DETERMINISTIC_ERRORS:
                raise
            except Exception as exc:  # noqa: BLE001 - any other failure ends the run, with its reason
                self.link.await_failure()  # a dead follower is the likely cause: let its watchdog say so
                fatal(f"engine call {call} failed on process 0: {type(exc).__name__}: {exc}; exiting")

    # --- state-changing calls: mirrored -----------------------------------------------------

    def warmup(self, keys: Sequence[ShapeKey] | None = None, progress: bool = True) -> int:
        encoded = None if keys is None else [encode_key(k) for k in keys]
        return self._run("warmup", {"keys": encoded}, lambda: self.engine.warmup(keys, progress=progress))

    def admit(self, slot: int, prompt: Sequence[int]) -> int | None:
        args = {"slot": int(slot), "prompt": [int(t) for t in prompt]}
        return self._run("admit", args, lambda: self.engine.admit(slot, prompt))

    def prefill_chunk(self, slot: int, tokens: np.ndarray, start: int, is_last: bool,
                      params: SamplingParams, seed: int, generated: int = 0) -> int | None:
        args = {"slot": int(slot), "tokens": [int(t) for t in np.asarray(tokens).reshape(-1)], "start": int(start),
                "is_last": bool(is_last), "params": encode_params(params), "seed": int(seed),
                "generated": int(generated)}
        return self._run("prefill_chunk", args,
                         lambda: self.engine.prefill_chunk(slot, tokens, start, is_last, params, seed, generated))

    def prefill(self, slot: int, prompt: Sequence[int], params: SamplingParams, seed: int | None = None) -> int:
        """Whole-prompt prefill through the mirrored `prefill_chunk` (`engine_api.prefill_prompt`)."""
        seed = seed if seed is not None else (params.seed if params.seed is not None else 0)
        return prefill_prompt(self, slot, prompt, params, seed)

    def step(self, slot_ids: Sequence[int], k: int, row_k: Sequence[int] | None = None) -> StepResult:
        args = {"slot_ids": [int(s) for s in slot_ids], "k": int(k),
                "row_k": None if row_k is None else [int(r) for r in row_k]}
        return self._run("step", args, lambda: self.engine.step(slot_ids, k, row_k))

    def dispatch_step(self, slot_ids: Sequence[int], k: int, row_k: Sequence[int] | None = None) -> LeaderStep:
        """`EngineAPI.dispatch_step`, mirrored; reading the step (`result()`) is mirrored too, so every process's
        length bounds, and so the shapes of later steps, stay the same."""
        with self._lock:
            self._dispatched += 1
            step_id = self._dispatched
            args = {"id": step_id, "slot_ids": [int(s) for s in slot_ids], "k": int(k),
                    "row_k": None if row_k is None else [int(r) for r in row_k]}
            local = self._run("dispatch_step", args, lambda: self.engine.dispatch_step(slot_ids, k, row_k))
        return LeaderStep(self, step_id, local)

    def free(self, slot: int) -> None:
        return self._run("free", {"slot": int(slot)}, lambda: self.engine.free(slot))

    def reset(self) -> None:
        return self._run("reset", {}, self.engine.reset)

    # --- reads: local ------------------------------------------------------------------------

    def shape_keys(self) -> list[ShapeKey]:
        return self.engine.shape_keys()

    def length(self, slot: int) -> int:
        return self.engine.length(slot)

    def first_token_logprobs(self, slot: int):
        return self.engine.first_token_logprobs(slot)

    def page_stats(self):
        return self.engine.page_stats()

    def room(self, slot: int) -> int:
        return self.engine.room(slot)

    def catch_up_plan(self, slot: int):
        return self.engine.catch_up_plan(slot)

    def state_lost(self) -> bool:
        return self.engine.state_lost()

    @property
    def catch_up_totals(self):
        return self.engine.catch_up_totals


@dataclasses.dataclass(eq=False)
class LeaderStep:
    """A step the leader dispatched; the first `result()` tells the followers to read their copy of it too."""

    engine: LeaderEngine
    step_id: int
    local: Any  # the local engine's PendingStep
    done: StepResult | None = None

    @property
    def catch_up_s(self) -> float:
        return self.local.catch_up_s

    def result(self) -> StepResult:
        if self.done is None:
            self.done = self.engine._run("read_step", {"id": self.step_id}, self.local.result)
        return self.done


# --- followers ----------------------------------------------------------------------------------


class FollowerLink:
    """A follower's connection to the leader; a reader thread queues the calls and ends the process
    when the leader disconnects without saying stop."""

    def __init__(self, conn: Connection, spec: DistributedSpec):
        self.spec = spec
        self._conn = conn
        self._calls: queue.Queue[dict] = queue.Queue()
        threading.Thread(target=self._read, name="jaxspec-leader-reader", daemon=True).start()

    @classmethod
    def connect(cls, spec: DistributedSpec) -> FollowerLink:
        host, port = spec.control_address
        deadline = time.monotonic() + CONNECT_TIMEOUT_S
        while True:
            try:
                conn = Client((host, port), authkey=control_key(spec))
                break
            except AuthenticationError:
                raise RuntimeError(f"process {spec.process_id}: the control channel at {host}:{port} did not accept "
                                   f"this process's key, or did not prove it has it: the processes' secrets "
                                   f"(${ENV_SECRET} / ${ENV_SECRET_FILE}) differ, or another program holds that "
                                   f"port") from None
            except (ConnectionRefusedError, ConnectionResetError, EOFError) as exc:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"process {spec.process_id}: cannot reach the leader's control channel at "
                                       f"{host}:{port} within {CONNECT_TIMEOUT_S} s: {exc}") from None
                time.sleep(0.2)
        conn.send_bytes(json.dumps({"process": spec.process_id}).encode())
        return cls(conn, spec)

    def _read(self) -> None:
        while True:
            try:
                message = json.loads(self._conn.recv_bytes())
            except (EOFError, OSError, ValueError) as exc:
                why = "it disconnected (died or was killed)" if isinstance(exc, (EOFError, OSError)) else f"{exc}"
                fatal(f"process {self.spec.process_id}: lost the leader (process 0): {why}; exiting")
            self._calls.put(message)
            if message.get("call") == "stop":
                return

    def next_call(self) -> dict:
        return self._calls.get()

    def fail(self, error: str) -> NoReturn:
        """Tell the leader this process failed (it then exits naming the error), and exit 1."""
        message = f"process {self.spec.process_id}: {error}"
        try:
            self._conn.send_bytes(json.dumps({"error": message}).encode())
        except OSError:
            pass  # the leader is gone already
        fatal(f"{message}; exiting")


def follow(engine: EngineAPI, link: FollowerLink) -> int:
    """Make every call the leader sends on `engine`, until it says stop. Returns the exit code: 0, or 1
    when the leader stopped on an error. Exits the process (1) on any other failure.

    SIGINT and SIGTERM are ignored meanwhile: a signal to the whole process group lets the leader drain
    (it needs every process for that) and then stop the others."""
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
    expected = 1
    dispatched: dict[int, Any] = {}  # the leader's step id -> this engine's PendingStep, until read
    while True:
        message = link.next_call()
        seq, call, args = message.get("seq"), message.get("call"), message.get("args", {})
        if seq != expected:
            link.fail(f"call {seq} ({call}) arrived where call {expected} was due: out of step")
        expected += 1
        if call == "stop":
            if not args.get("ok", True):
                print(f"jaxspec: multi-process: process {link.spec.process_id}: the leader stopped on an error: "
                      f"{args.get('reason', '')}", file=sys.stderr, flush=True)
                return 1
            return 0
        if call == "hello":
            mine = fingerprint(engine)
            if args != mine:
                diff = {k: (args.get(k), mine.get(k)) for k in mine if args.get(k) != mine.get(k)}
                link.fail(f"this process's engine differs from the leader's (leader, this): {diff}; "
                                "start every process with the same flags")
            continue
        try:
            _apply(engine, call, args, dispatched)
        except DETERMINISTIC_ERRORS:
            pass  # raised on the leader too, before any device work: its driver handles it
        except Exception as exc:  # noqa: BLE001 - any other failure ends the run, with its reason
            time.sleep(FAILURE_GRACE_S)  # a dead leader is the likely cause: let the reader thread say so
            link.fail(f"engine call {call} failed: {type(exc).__name__}: {exc}")


def _apply(engine: EngineAPI, call: str, args: dict[str, Any], dispatched: dict[int, Any]) -> None:
    if call == "warmup":
        keys = None if args["keys"] is None else [decode_key(k) for k in args["keys"]]
        engine.warmup(keys, progress=False)
    elif call == "admit":
        engine.admit(args["slot"], args["prompt"])
    elif call == "prefill_chunk":
        tokens = np.asarray(args["tokens"], np.int32)  # [n]
        engine.prefill_chunk(args["slot"], tokens, args["start"], args["is_last"], decode_params(args["params"]),
                             args["seed"], args["generated"])
    elif call == "step":
        engine.step(args["slot_ids"], args["k"], args["row_k"])
    elif call == "dispatch_step":
        dispatched[args["id"]] = engine.dispatch_step(args["slot_ids"], args["k"], args["row_k"])
    elif call == "read_step":
        step = dispatched.pop(args["id"], None)  # None: its dispatch raised a deterministic error on every process
        if step is not None:
            step.result()
    elif call == "free":
        engine.free(args["slot"])
    elif call == "reset":
        engine.reset()
    else:
        raise ValueError(f"unknown call {call!r} (known: {', '.join(MUTATING_CALLS)})")


# --- wire encodings -----------------------------------------------------------------------------


def fingerprint(engine: EngineAPI) -> dict[str, Any]:
    """What must be equal on every process for the same calls to run the same executables."""
    return {"model": engine.model_name, "proposer": engine.proposer_name, "dtype": engine.dtype,
            "mesh": str(engine.mesh_spec), "vocab_size": int(engine.vocab_size), "menu": repr(engine.menu),
            "logprobs": int(engine.logprobs)}


def encode_key(key: ShapeKey) -> list:
    return [type(key).__name__, *dataclasses.astuple(key)]


def decode_key(value: list) -> ShapeKey:
    return KEY_TYPES[value[0]](*value[1:])


def encode_params(params: SamplingParams) -> dict[str, Any]:
    return dataclasses.asdict(params)


def decode_params(value: dict[str, Any]) -> SamplingParams:
    return SamplingParams(**{k: tuple(v) if isinstance(v, list) else v for k, v in value.items()})


__all__ = ["DistributedSpec", "FollowerLink", "LeaderEngine", "LeaderLink", "add_arguments", "follow", "initialize"]
