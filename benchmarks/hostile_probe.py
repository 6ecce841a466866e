"""Hostile-client probe (issue 40): a server on 127.0.0.1 (the fake engine, ascii tokenizer, default limits)
measured while attackers hold it.

    python -m benchmarks.hostile_probe --out docs/results/hostile_probe.json

  health      health-check latency (1 s deadline) under 200 half-open health calls on one connection
  pending     a normal client's 20-token Generate under 70 half-open Generate calls from one connection,
              re-opened as they are refused or cancelled
  big_prompt  a 20-token Generate's latency (and health's) while four clients send ~1 MB prompts

Each phase first measures the same calls with no attacker. Loopback only; every loop is bounded.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import multiprocessing
import os
import platform
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

import grpc

from jaxspec.engine.fake import FakeEngine
from jaxspec.menu import Menu
from jaxspec.serving.client import GenerationClient
from jaxspec.serving.serve_config import ServeConfig
from jaxspec.serving.service import SERVICE_NAME, GenerationServer
from jaxspec.serving.toy_tokenizer import ascii_tokenizer

HOST = "127.0.0.1"
GENERATE = f"/{SERVICE_NAME}/Generate"
HEALTH_CHECK = "/grpc.health.v1.Health/Check"
OWN_CONNECTION = (("grpc.use_local_subchannel_pool", 1),)


def free_port() -> int:
    """A port free on HOST now (port 0 would turn gRPC off)."""
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def start() -> GenerationServer:
    menu = Menu(num_slots=8, max_len=128, batch_buckets=(8,), k_menu=(0,), window_buckets=(128,),
                prefill_buckets=(32,))
    engine = FakeEngine(menu, vocab_size=64, accept=0, proposer_name="fake")
    return GenerationServer(engine, ascii_tokenizer(), None, ServeConfig(host=HOST, port=free_port()),
                            model_name="fake").start()


class HalfOpen:
    """Keeps `n` calls of `method` open on one connection without a request message, re-opening each
    one that ends (refused, cancelled), until closed."""

    def __init__(self, port: int, method: str, n: int):
        self.channel = grpc.insecure_channel(f"{HOST}:{port}", options=OWN_CONNECTION)
        self.release = threading.Event()
        self.ended: collections.Counter = collections.Counter()
        self._open = self.channel.stream_stream(method)
        self._calls = [self._start() for _ in range(n)]
        self._keeper = threading.Thread(target=self._keep, daemon=True)
        self._keeper.start()

    def _no_message(self):
        self.release.wait()
        return
        yield

    def _start(self):
        return self._open(self._no_message(), timeout=120)

    def _keep(self) -> None:
        while not self.release.wait(0.05):
            for i, call in enumerate(self._calls):
                if call.done():
                    self.ended[call.code().name] += 1
                    self._calls[i] = self._start()

    def close(self) -> dict[str, int]:
        self.release.set()
        self._keeper.join()
        for call in self._calls:
            call.cancel()
        self.channel.close()
        return dict(self.ended)


def health_latencies(port: int, n: int, deadline_s: float = 1.0) -> dict:
    times, failed = [], collections.Counter()
    with GenerationClient(f"{HOST}:{port}") as client:
        for _ in range(n):
            t = time.perf_counter()
            try:
                client.health(timeout=deadline_s)
                times.append(time.perf_counter() - t)
            except grpc.RpcError as exc:
                failed[exc.code().name] += 1
            time.sleep(0.05)
    return summary(times, failed, n)


def generate_latencies(port: int, n: int, tokens: int = 20) -> dict:
    times, failed = [], collections.Counter()
    with GenerationClient(f"{HOST}:{port}") as client:
        for _ in range(n):
            t = time.perf_counter()
            try:
                messages = list(client.generate("a normal client", max_tokens=tokens, ignore_eos=True, timeout=30))
                assert sum(len(m.token_ids) for m in messages) == tokens
                times.append(time.perf_counter() - t)
            except grpc.RpcError as exc:
                failed[exc.code().name] += 1
    return summary(times, failed, n)


def summary(times: list[float], failed: collections.Counter, n: int) -> dict:
    ms = sorted(1000 * t for t in times)
    return {"calls": n, "ok": len(ms), "failed": dict(failed),
            "median_ms": round(statistics.median(ms), 2) if ms else None,
            "max_ms": round(ms[-1], 2) if ms else None}


def big_prompts(port: int, clients: int, size: int, started, stop, sent) -> None:
    """`clients` threads sending `size`-byte prompts until `stop` is set (`started` is set once a call of
    each ended); puts their end codes on `sent`.
    Runs in a process of its own, so the attackers' own work does not share the server's interpreter."""
    counts: collections.Counter = collections.Counter()

    def run():
        with GenerationClient(f"{HOST}:{port}") as client:
            prompt = "y" * size
            while not stop.is_set():
                try:
                    list(client.generate(prompt, max_tokens=2, timeout=30))
                    counts["OK"] += 1
                except grpc.RpcError as exc:
                    counts[exc.code().name] += 1
                if sum(counts.values()) >= clients:
                    started.set()

    threads = [threading.Thread(target=run, daemon=True) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    sent.put(dict(counts))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="write the JSON here (default: stdout only)")
    parser.add_argument("--calls", type=int, default=13, help="measured calls per phase")
    args = parser.parse_args(argv)
    load_before = os.getloadavg()
    server = start()
    port = server.port
    result: dict = {"command": " ".join([Path(sys.executable).name, "-m", "benchmarks.hostile_probe", *(argv or
                                         sys.argv[1:])]),
                    "date": datetime.datetime.now().isoformat(timespec="seconds"),
                    "machine": f"{os.cpu_count()} CPU cores ({platform.processor() or platform.machine()}), "
                               f"python {platform.python_version()}, grpc {grpc.__version__}",
                    "server": "fake engine, ascii tokenizer, default ServeConfig on 127.0.0.1",
                    "load_before": load_before}
    try:
        result["health"] = {"idle": health_latencies(port, args.calls)}
        held = HalfOpen(port, HEALTH_CHECK, 200)
        time.sleep(1.0)
        result["health"]["under_200_half_open_health_calls"] = health_latencies(port, args.calls)
        result["health"]["attacker_calls_ended"] = held.close()

        result["pending"] = {"idle": generate_latencies(port, args.calls)}
        held = HalfOpen(port, GENERATE, 70)
        time.sleep(1.0)
        result["pending"]["under_70_half_open_generate_calls_one_connection"] = generate_latencies(port, args.calls)
        result["pending"]["attacker_calls_ended"] = held.close()

        result["big_prompt"] = {"idle": {"generate_20_tokens": generate_latencies(port, args.calls),
                                         "health": health_latencies(port, args.calls)}}
        spawn = multiprocessing.get_context("spawn")
        started, stop, sent = spawn.Event(), spawn.Event(), spawn.Queue()
        attackers = spawn.Process(target=big_prompts, args=(port, 4, 1_000_000, started, stop, sent), daemon=True)
        attackers.start()
        if not started.wait(timeout=300):
            raise RuntimeError("the big-prompt clients did not start within 300 s")
        result["big_prompt"]["under_4_clients_sending_1MB_prompts"] = {
            "generate_20_tokens": generate_latencies(port, args.calls), "health": health_latencies(port, args.calls)}
        stop.set()
        result["big_prompt"]["attacker_calls_ended"] = sent.get(timeout=120)
        attackers.join(timeout=60)
    finally:
        server.shutdown(drain=False, timeout=5)
    result["load_after"] = os.getloadavg()
    text = json.dumps(result, indent=1)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
