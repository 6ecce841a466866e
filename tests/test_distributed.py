"""Multi-process JAX (jaxspec.engine.distributed): two processes on 127.0.0.1 with CPU (gloo) collectives and a mesh
data=1,model=2 spanning both run `jaxspec batch` through the scheduler; process 0 runs the job, process 1
mirrors its engine calls.

- the two-process job writes the same greedy tokens as one process on the same mesh (two host devices);
- kill -9 a follower mid-job: the leader exits 1 at once with a one-line reason (and writes no error records);
- kill -9 the leader: the follower exits 1 at once with a one-line reason.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from jaxspec.engine.distributed import (
    CONTROL_PORT_OFFSET,
    DistributedSpec,
    FollowerLink,
    LeaderLink,
    control_key,
    decode_params,
    encode_params,
)
from jaxspec.types import SamplingParams

pytestmark = pytest.mark.slow  # ~2 minutes on 2 CPU cores: four two-process jobs

ROOT = Path(__file__).resolve().parents[1]
MENU = """num_slots: 4
max_len: 128
batch_buckets: [4]
k_menu: [0, 2]
window_buckets: [128]
prefill_buckets: [32]
"""
RUN_TIMEOUT_S = 240  # one job, compilation included; a hang fails the test instead of blocking it
EXIT_BOUND_S = 20.0  # a survivor must be gone this soon after its peer is killed

# mixed: prompt lengths 1..~70 tokens (two prefill chunks), different max_tokens, a stop string
REQUESTS = [
    {"id": "short", "prompt": "q", "max_tokens": 16},
    {"id": "repeat", "prompt": "hello world hello world hello", "max_tokens": 12},
    {"id": "long", "prompt": "the quick brown fox jumps over the lazy dog " * 2 + "and then", "max_tokens": 20},
    {"id": "stop", "prompt": "xyzxyzxyzxyz", "max_tokens": 30, "stop": "x"},
    {"id": "three", "prompt": "abc", "max_tokens": 5},
    {"id": 6, "messages": [{"role": "user", "content": "count: one two three"}], "max_tokens": 9},
]


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("distributed")
    (path / "menu.yaml").write_text(MENU)
    (path / "mixed.jsonl").write_text("".join(json.dumps(r) + "\n" for r in REQUESTS))
    long_job = [{"id": i, "prompt": "abc " * (1 + i % 9), "max_tokens": 90} for i in range(400)]
    (path / "long.jsonl").write_text("".join(json.dumps(r) + "\n" for r in long_job))
    return path


def free_port_pair() -> int:
    """A port P with P and P + CONTROL_PORT_OFFSET free (the coordinator and the control channel)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + CONTROL_PORT_OFFSET))
            return port
        except OSError:
            continue
    raise RuntimeError("no free port pair")


def env_for(work: Path, devices: int | None = None, profiles: str = "profiles") -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_FLAGS", "JAXSPEC_"))}
    env.update(JAX_PLATFORMS="cpu", JAXSPEC_COMPILATION_CACHE=str(work / "xla-cache"),
               JAXSPEC_PROFILE_DIR=str(work / profiles), PYTHONPATH=str(ROOT))
    if devices is not None:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    return env


def batch_command(work: Path, input_name: str, output: Path, proposer: str, policy: str | None) -> list[str]:
    cmd = [sys.executable, "-m", "jaxspec.cli", "batch", "--model", "tiny", "--tokenizer", "ascii",
           "--menu", str(work / "menu.yaml"), "--mesh", "data=1,model=2", "--proposer", proposer,
           "--input", str(work / input_name), "--output", str(output), "--no-progress"]
    return cmd + (["--policy", policy] if policy else [])


def start_pair(work: Path, cmd: list[str], profiles: str = "profiles") -> list[subprocess.Popen]:
    port = free_port_pair()
    return [subprocess.Popen(cmd + ["--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id",
                                    str(i)], cwd=ROOT, env=env_for(work, profiles=profiles), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
            for i in range(2)]


def finish(procs: list[subprocess.Popen], timeout: float = RUN_TIMEOUT_S) -> list[tuple[int, str]]:
    """(exit code, stderr) of each process; kills them all if any outlives `timeout`."""
    deadline = time.monotonic() + timeout
    out = []
    try:
        for p in procs:
            _, err = p.communicate(timeout=max(deadline - time.monotonic(), 1))
            out.append((p.returncode, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return out


def records(path: Path) -> dict:
    """id -> what must be equal across runs (timings excluded)."""
    result = {}
    for line in path.read_text().splitlines():
        r = json.loads(line)
        result[json.dumps(r["id"])] = (r["token_ids"], r["text"], r["finish_reason"], r["error"],
                                       r["stats"] and r["stats"]["k"])
    return result


@pytest.mark.parametrize("proposer,policy", [("ngram", "fixed:2"), ("none", None)])
def test_two_processes_match_one(work, proposer, policy):
    single, multi = work / f"single-{proposer}.jsonl", work / f"multi-{proposer}.jsonl"
    ref = subprocess.run(batch_command(work, "mixed.jsonl", single, proposer, policy), cwd=ROOT,
                         env=env_for(work, devices=2), capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert ref.returncode == 0, ref.stderr
    (rc0, err0), (rc1, err1) = finish(start_pair(work, batch_command(work, "mixed.jsonl", multi, proposer, policy)))
    assert (rc0, rc1) == (0, 0), f"leader:\n{err0}\nfollower:\n{err1}"
    expected, got = records(single), records(multi)
    assert len(expected) == len(REQUESTS) and all(r[3] is None for r in expected.values())
    assert got == expected
    assert any(r[2] == "stop" for r in got.values()) and any(r[2] == "length" for r in got.values())


def _kill_mid_job(work: Path, victim: int, output: Path) -> tuple[int, str, float]:
    """Start a long two-process job (goodput: the leader profiles the engine through the mirrored calls),
    kill -9 process `victim` once records are being written; (survivor's exit code, its stderr, seconds
    from the kill to its exit)."""
    procs = start_pair(work, batch_command(work, "long.jsonl", output, "ngram", "goodput"),
                       profiles=f"profiles-kill-{victim}")
    survivor = procs[1 - victim]
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while not (output.exists() and output.read_text().count("\n") >= 2):
            assert all(p.poll() is None for p in procs), [p.communicate() for p in procs]
            assert time.monotonic() < deadline, "the job wrote no records"
            time.sleep(0.1)
        procs[victim].send_signal(signal.SIGKILL)
        killed = time.monotonic()
        try:
            _, err = survivor.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"process {1 - victim} did not exit within 60 s of process {victim}'s death")
        return survivor.returncode, err, time.monotonic() - killed
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.communicate()


def test_follower_death_stops_the_leader(work):
    output = work / "kill-follower.jsonl"
    rc, err, seconds = _kill_mid_job(work, victim=1, output=output)
    print(f"leader exited {rc} {seconds:.2f} s after the follower was killed")
    assert rc == 1, err
    assert "jaxspec: multi-process: process 1 of 2 disconnected (died or was killed); exiting" in err
    assert seconds < EXIT_BOUND_S
    assert "Traceback" not in err
    written = [json.loads(line) for line in output.read_text().splitlines()]
    assert written and all(r["error"] is None for r in written)  # no request failed on the way out


def test_leader_death_stops_the_follower(work):
    rc, err, seconds = _kill_mid_job(work, victim=0, output=work / "kill-leader.jsonl")
    print(f"follower exited {rc} {seconds:.2f} s after the leader was killed")
    assert rc == 1, err
    assert "jaxspec: multi-process: process 1: lost the leader (process 0): it disconnected" in err
    assert seconds < EXIT_BOUND_S
    assert "Traceback" not in err


# --- fast checks (no processes) ----------------------------------------------------------------

SECRET = "0123456789abcdef0123456789abcdef"


def test_off_loopback_the_control_channel_needs_a_shared_secret(tmp_path):
    for coordinator in ("10.0.0.1:1234", "jaxspec-leader.invalid:1234"):  # an address, an unresolvable name
        with pytest.raises(ValueError, match="off loopback.*JAXSPEC_DIST_SECRET"):
            DistributedSpec.from_values(coordinator, 2, 1, env={})
        assert DistributedSpec.from_values(coordinator, 2, 1, env={"JAXSPEC_DIST_SECRET": SECRET}).enabled
    for coordinator in ("127.0.0.1:1234", "localhost:1234", "[::1]:1234"):  # loopback: no secret needed
        assert DistributedSpec.from_values(coordinator, 2, 0, env={}).secret is None
    secret_file = tmp_path / "secret"
    secret_file.write_text(SECRET + "\n")
    from_file = DistributedSpec.from_values("10.0.0.1:1234", 2, 0, env={"JAXSPEC_DIST_SECRET_FILE": str(secret_file)})
    assert from_file.secret == SECRET.encode() and SECRET not in repr(from_file)
    assert control_key(from_file) == control_key(DistributedSpec("10.0.0.1:1234", 2, 1, secret=SECRET.encode()))
    assert control_key(from_file) != control_key(DistributedSpec("10.0.0.1:1234", 2, 1, secret=b"x" * 32))
    assert SECRET.encode() not in control_key(from_file)
    for env, message in (({"JAXSPEC_DIST_SECRET": SECRET, "JAXSPEC_DIST_SECRET_FILE": str(secret_file)}, "not both"),
                         ({"JAXSPEC_DIST_SECRET": "short"}, "at least 16 bytes"),
                         ({"JAXSPEC_DIST_SECRET_FILE": str(tmp_path / "missing")}, "cannot read")):
        with pytest.raises(ValueError, match=message):
            DistributedSpec.from_values("10.0.0.1:1234", 2, 0, env=env)


@pytest.mark.parametrize("secret", [None, SECRET.encode()], ids=["loopback-without-secret", "with-secret"])
def test_control_channel_admits_the_key_and_refuses_a_wrong_one(secret):
    """The leader's control channel on 127.0.0.1 (threads, no jax): a follower with a wrong secret is refused,
    on both sides, and the leader keeps accepting; the right one joins."""
    coordinator = f"127.0.0.1:{free_port_pair()}"
    leader_spec = DistributedSpec(coordinator, 2, 0, secret=secret)
    leader: dict[str, LeaderLink] = {}
    accepting = threading.Thread(target=lambda: leader.setdefault("link", LeaderLink.accept(leader_spec)))
    accepting.start()
    with pytest.raises(RuntimeError, match="did not accept this process's key"):
        FollowerLink.connect(DistributedSpec(coordinator, 2, 1, secret=b"a wrong secret, 32 bytes long..."))
    follower = FollowerLink.connect(DistributedSpec(coordinator, 2, 1, secret=secret))
    accepting.join(30)
    assert not accepting.is_alive() and "link" in leader
    leader["link"].send("free", {"slot": 3})
    assert follower.next_call()["call"] == "free"
    leader["link"].close()
    assert follower.next_call()["call"] == "stop"  # the reader thread ends: its disconnect is expected
    follower._conn.close()


def test_spec_from_flags_and_env():
    env = {"JAXSPEC_COORDINATOR": "10.0.0.1:1234", "JAXSPEC_NUM_PROCESSES": "4", "JAXSPEC_PROCESS_ID": "3",
           "JAXSPEC_DIST_SECRET": SECRET}
    spec = DistributedSpec.from_values(env=env)
    assert (spec.coordinator, spec.num_processes, spec.process_id, spec.is_leader) == ("10.0.0.1:1234", 4, 3, False)
    assert spec.control_address == ("10.0.0.1", 1234 + CONTROL_PORT_OFFSET)
    flags = argparse.Namespace(coordinator="h:99", num_processes=2, process_id=0)
    assert DistributedSpec.from_args(flags, env=env) == DistributedSpec("h:99", 2, 0, secret=SECRET.encode())
    assert not DistributedSpec.from_values(env={}).enabled
    for bad in ({"num_processes": 2}, {"coordinator": "h", "num_processes": 2},
                {"coordinator": "h:1", "num_processes": 2},  # off loopback without a secret
                {"coordinator": "h:1", "num_processes": 2, "process_id": 2, "secret": SECRET.encode()}):
        with pytest.raises(ValueError):
            DistributedSpec(**bad)
    with pytest.raises(ValueError, match="JAXSPEC_NUM_PROCESSES"):
        DistributedSpec.from_values(env={"JAXSPEC_NUM_PROCESSES": "two"})


def test_params_round_trip():
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=5, seed=None, max_tokens=3, stop_token_ids=(1, 2),
                            stop_strings=("a",))
    assert decode_params(json.loads(json.dumps(encode_params(params)))) == params
