"""SIGTERM drains a real `jaxspec serve` process (--model tiny --tokenizer ascii): health goes
NOT_SERVING, new calls are refused, in-flight streams finish, the process exits 0; a second SIGTERM
drops what is left and the process exits 1."""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import grpc

from jaxspec.serving.client import GenerationClient
from jaxspec.serving.proto.jaxspec.v1 import generation_pb2 as pb
from tests.serving.conftest import HOST, free_port, wait_until

ROOT = Path(__file__).resolve().parents[2]
STEP_DELAY = 0.05
TOKENS = 40  # in flight for >= TOKENS * STEP_DELAY = 2 s after the signal


def start_process(*flags: str, env: dict[str, str] | None = None) -> tuple[subprocess.Popen, list[str]]:
    """`serve_entry` with `flags` (and `env` added to the environment); its stderr lines, gathered as they come."""
    env = dict(os.environ, JAXSPEC_TEST_STEP_DELAY=str(STEP_DELAY), PYTHONPATH=str(ROOT), **(env or {}))
    proc = subprocess.Popen([sys.executable, "-m", "tests.serving.serve_entry", *flags], cwd=ROOT, env=env,
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    lines: list[str] = []

    def pump():  # keep the pipe drained, remember everything for assertion messages
        for line in proc.stderr:
            lines.append(line)

    threading.Thread(target=pump, daemon=True).start()
    return proc, lines


def connect(proc, lines) -> GenerationClient:
    """Wait for the served tiny model to announce its port; a client for it."""
    wait_until(lambda: any("jaxspec serve: tiny on" in l for l in lines) or proc.poll() is not None,
               timeout=120, what="the server to start")
    assert proc.poll() is None, "".join(lines)
    port = int(re.search(r"jaxspec serve: tiny on [\d.]+:(\d+)", "".join(lines)).group(1))
    return GenerationClient(f"{HOST}:{port}")


def test_sigterm_drains_in_flight_streams_and_exits_0():
    proc, lines = start_process("--model", "tiny", "--tokenizer", "ascii", "--menu", "tiny", "--proposer", "none",
                                "--policy", "none", "--host", HOST, "--port", str(free_port()))
    try:
        client = connect(proc, lines)
        assert client.health() == "SERVING"
        calls = [client.generate("drain me", max_tokens=TOKENS, ignore_eos=True, timeout=60) for _ in range(3)]
        firsts = [next(call) for call in calls]
        assert all(m.token_ids for m in firsts)

        proc.send_signal(signal.SIGTERM)
        wait_until(lambda: client.health() == "NOT_SERVING", timeout=5, what="health NOT_SERVING")
        try:
            list(client.generate("too late", max_tokens=2))
            raise AssertionError("a call after SIGTERM was accepted")
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc
        for first, call in zip(firsts, calls):  # the in-flight streams run to the end
            messages = [first, *call]
            assert messages[-1].finish_reason == pb.FINISH_REASON_LENGTH
            assert sum(len(m.token_ids) for m in messages) == TOKENS
        client.close()
        assert proc.wait(timeout=30) == 0, "".join(lines)
        assert any("jaxspec serve: stopped (drained)" in l for l in lines), "".join(lines)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_second_sigterm_drops_in_flight_streams_and_exits_1():
    """A second SIGTERM cancels the streams still running: they end UNAVAILABLE, the process says how
    many requests it dropped and exits 1 (not "drained", not 0)."""
    proc, lines = start_process("--model", "tiny", "--tokenizer", "ascii", "--menu", "tiny", "--proposer", "none",
                                "--policy", "none", "--host", HOST, "--port", str(free_port()))
    try:
        client = connect(proc, lines)
        # 100 tokens: >= 5 s of steps after the first message, far past the two signals below
        calls = [client.generate("drop me", max_tokens=100, ignore_eos=True, timeout=60) for _ in range(3)]
        assert all(next(call).token_ids for call in calls)
        proc.send_signal(signal.SIGTERM)
        wait_until(lambda: client.health() == "NOT_SERVING", timeout=5, what="health NOT_SERVING")
        proc.send_signal(signal.SIGTERM)
        for call in calls:
            try:
                list(call)
                raise AssertionError("a stream finished although the second SIGTERM cancelled it")
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc
        client.close()
        assert proc.wait(timeout=30) == 1, "".join(lines)
        text = "".join(lines)
        assert "jaxspec serve: stopped: 3 in-flight requests dropped (exit 1)" in text, text
        assert "drained" not in text, text
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_preset_without_tokenizer_is_a_clear_error(capsys):
    from jaxspec.serving.serve_cmd import add_serve_arguments, run_serve

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    assert run_serve(parser.parse_args(["--model", "tiny", "--menu", "tiny"])) == 2
    err = capsys.readouterr().err
    assert "model 'tiny' has no tokenizer" in err and "--tokenizer ascii" in err
