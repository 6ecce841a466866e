"""Two `jaxspec serve` replicas (tiny model) behind one round_robin target (docs/scale_out.md): calls
spread over both; after SIGTERM one drains (health NOT_SERVING) and the client sends the rest to the
other; no call fails."""

from __future__ import annotations

import io
import re
import signal
import urllib.request
from concurrent import futures

import grpc
import pytest

from jaxspec.serving import client as client_cli
from jaxspec.serving.client import GenerationClient, lists_several
from jaxspec.serving.proto.jaxspec.v1 import generation_pb2 as pb
from tests.serving.conftest import HOST, free_port, wait_until
from tests.serving.test_sigterm import start_process

FLAGS = ("--model", "tiny", "--tokenizer", "ascii", "--menu", "tiny", "--proposer", "none", "--policy", "none",
         "--host", HOST, "--metrics-port", "0")  # + "--port" with a free port each


def metric(metrics_port: int, sample: str) -> float:
    """The value of one Prometheus sample ("name{labels}") of a replica, 0 while it is absent."""
    with urllib.request.urlopen(f"http://{HOST}:{metrics_port}/metrics", timeout=10) as response:
        text = response.read().decode()
    match = re.search(rf"^{re.escape(sample)} (\S+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


def ok_calls(metrics_port: int) -> int:
    """Generate calls the replica finished with OK."""
    return int(metric(metrics_port, 'jaxspec_requests_total{code="OK",method="Generate"}'))


def ports(lines: list[str]) -> tuple[int, int]:
    text = "".join(lines)
    return (int(re.search(r"jaxspec serve: tiny on [\d.]+:(\d+)", text).group(1)),
            int(re.search(r"metrics on :(\d+)", text).group(1)))


def generate(client: GenerationClient, i: int, max_tokens: int) -> list[pb.GenerateResponse]:
    return list(client.generate(f"request {i}", max_tokens=max_tokens, ignore_eos=True, timeout=60))


def unavailable_calls(metrics_port: int) -> int:
    """Generate calls the replica refused with UNAVAILABLE (e.g. while draining)."""
    return int(metric(metrics_port, 'jaxspec_requests_total{code="UNAVAILABLE",method="Generate"}'))


def routes_around(client: GenerationClient, metrics_port: int, probes: list[int]) -> bool:
    """Two calls in a row on the balanced `client`, none refused by the replica behind `metrics_port`.

    round_robin alternates its picks over the replicas it deems ready, so while the draining replica is
    still among them one of two consecutive picks lands there and is refused (then retried elsewhere): two
    calls without a refusal there show the channel has taken it out. Each call must succeed; `probes`
    collects their numbers."""
    refused = unavailable_calls(metrics_port)
    for _ in range(2):
        probes.append(len(probes))
        messages = generate(client, 300 + probes[-1], 4)
        assert messages[-1].finish_reason == pb.FINISH_REASON_LENGTH
    return unavailable_calls(metrics_port) == refused


def test_two_replicas_behind_one_target_and_a_drain(tmp_path):
    gate = tmp_path / "hold-replica-a"  # while it exists, replica A's engine steps wait: its drain lasts
    procs = [start_process(*FLAGS, "--port", str(free_port()), env={"JAXSPEC_TEST_STEP_GATE": str(gate)}),
             start_process(*FLAGS, "--port", str(free_port()))]
    try:
        for proc, lines in procs:
            wait_until(lambda: any("jaxspec serve: tiny on" in l for l in lines) or proc.poll() is not None,
                       timeout=120, what="a replica to start")
            assert proc.poll() is None, "".join(lines)
        (port_a, metrics_a), (port_b, metrics_b) = (ports(lines) for _, lines in procs)
        target = f"ipv4:{HOST}:{port_a},{HOST}:{port_b}"
        client = GenerationClient(target)
        assert client.balanced
        direct_a = GenerationClient(f"{HOST}:{port_a}")
        wait_until(lambda: direct_a.health() == "SERVING", what="replica A serving")
        # the channel connects to the replicas one by one: call until both have answered
        wait_until(lambda: generate(client, 0, 1) and ok_calls(metrics_a) > 0 and ok_calls(metrics_b) > 0,
                   timeout=60, what="the balanced channel to reach both replicas")

        with futures.ThreadPoolExecutor(8) as pool:
            # 20 calls: round_robin spreads them over both replicas
            a0, b0 = ok_calls(metrics_a), ok_calls(metrics_b)
            first = list(pool.map(lambda i: generate(client, i, 4), range(20)))
            assert all(m[-1].finish_reason == pb.FINISH_REASON_LENGTH for m in first)
            a1, b1 = ok_calls(metrics_a), ok_calls(metrics_b)
            assert (a1 - a0) + (b1 - b0) == 20 and a1 - a0 >= 5 and b1 - b0 >= 5, (a1 - a0, b1 - b0)

            # 6 long calls (60 tokens) start; replica A's are held in flight; A gets SIGTERM
            gate.touch()
            long = [pool.submit(generate, client, 100 + i, 60) for i in range(6)]
            wait_until(lambda: metric(metrics_a, "jaxspec_running_slots") > 0, what="a call running on A")
            procs[0][0].send_signal(signal.SIGTERM)
            wait_until(lambda: direct_a.health() == "NOT_SERVING", timeout=30, what="replica A NOT_SERVING")
            # the balanced channel's health watch hears it too (when, depends on the machine's load)
            probes: list[int] = []
            wait_until(lambda: routes_around(client, metrics_a, probes), timeout=60,
                       what="the balanced channel to route around the draining replica")
            refused = unavailable_calls(metrics_a)
            short = list(pool.map(lambda i: generate(client, 200 + i, 4), range(14)))
            assert all(m[-1].finish_reason == pb.FINISH_REASON_LENGTH for m in short)  # none failed
            # health checking, not retries, keeps the calls off A now: it refused none of them
            assert unavailable_calls(metrics_a) == refused
            assert ok_calls(metrics_a) == a1  # A served no call after the drain began (its long ones still run)
            gate.unlink()
            for call in long:  # the calls in flight on A drained
                messages = call.result(timeout=60)
                assert sum(len(m.token_ids) for m in messages) == 60
        # every call after the drain began (the probes and the 14) was served by B
        assert ok_calls(metrics_b) - b1 >= len(probes) + 14
        assert procs[0][0].wait(timeout=30) == 0, "".join(procs[0][1])
        assert any("stopped (drained)" in l for l in procs[0][1])

        # `jaxspec client --target` takes the same target
        parser = _client_parser()
        out = io.StringIO()
        assert client_cli.run_client(parser.parse_args(["hi", "--target", target, "--max-tokens", "3"]), out,
                                     io.StringIO()) == 0
        assert len(out.getvalue().strip()) > 0
        client.close()
        direct_a.close()
    finally:
        for proc, _ in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _client_parser():
    import argparse

    parser = argparse.ArgumentParser()
    client_cli.add_client_arguments(parser)
    return parser


def test_target_validation():
    assert not lists_several("127.0.0.1:50051") and lists_several("ipv4:127.0.0.1:1,127.0.0.1:2")
    with pytest.raises(ValueError, match="ipv4: or ipv6: scheme"):
        lists_several("127.0.0.1:1,127.0.0.1:2")
    with pytest.raises(ValueError, match="empty address"):
        lists_several("ipv4:127.0.0.1:1,")
    parser, err = _client_parser(), io.StringIO()
    assert client_cli.run_client(parser.parse_args(["hi", "--target", "a:1,b:2"]), io.StringIO(), err) == 2
    assert "ipv4: or ipv6: scheme" in err.getvalue()
    err = io.StringIO()
    assert client_cli.run_client(parser.parse_args(["hi", "--target", "x:1", "--port", "2"]), io.StringIO(), err) == 2
    assert "not both" in err.getvalue()


def test_a_balanced_channel_with_no_serving_replica_fails_fast():
    with GenerationClient(f"ipv4:{HOST}:1,{HOST}:2") as client:  # nothing listens there
        with pytest.raises(grpc.RpcError) as info:
            list(client.generate("hi", max_tokens=2, timeout=10))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
