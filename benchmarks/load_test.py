"""Load test of a running `jaxspec serve`: Poisson arrivals at a few rates, streaming latencies.

    python -m benchmarks.load_test --target 127.0.0.1:50051 --rates 0.5,1,2 --duration 60 \
        --max-tokens 128 --out artifacts/load_test
    python -m benchmarks.load_test --http-target 127.0.0.1:8000 ...      the OpenAI HTTP API instead
    python -m benchmarks.load_test --target ... --http-target ... --closed-loop 1 --requests 20 ...
        both, alternating request by request: the HTTP layer's overhead against gRPC, side by side

`--http-target` streams `/v1/completions` (or `/v1/chat/completions` with --chat) as server-sent events;
`--closed-loop C` keeps C requests in flight (each replaced when it ends) instead of Poisson arrivals.

Method: for each rate r (requests/s), arrival gaps are exponential with mean 1/r (seeded), for
`--duration` seconds or `--requests` arrivals, whichever ends first; every arrival opens its own
streaming Generate call (a thread), so slow responses never delay later arrivals. Rates run one
after another, each after the previous one's requests finished. Measured on the client:

    ttft      call sent -> first message carrying a token (time to first token)
    tpot      (last token message - first token message) / (tokens - 1): time per output token
              after the first (requests with at least two tokens)
    latency   call sent -> stream ended
    tokens/s  output tokens of OK requests / (last stream end - first call sent)

Percentiles are over the requests that ended OK; other endings are counted by gRPC status code.
Writes `load_test.json` (settings, per-request samples, summaries) and `load_test.md` (a table).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import http.client
import json
import os
import platform
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import grpc
import numpy as np

from jaxspec.serving.client import GenerationClient

DEFAULT_PROMPTS = (
    "Write a short story about a lighthouse keeper.",
    "Explain how rainbows form.",
    "List three facts about the moons of Jupiter.",
    "Describe a city under the sea.",
    "Give advice on writing clean code.",
    "Summarise the history of tea in a paragraph.",
)
PERCENTILES = (50, 90, 99)


@dataclasses.dataclass(frozen=True)
class LoadConfig:
    target: str = "127.0.0.1:50051"
    rates: tuple[float, ...] = (0.5, 1.0, 2.0)
    duration_s: float = 60.0
    max_requests: int | None = None  # per rate
    max_tokens: int = 128
    temperature: float = 0.0
    ignore_eos: bool = False
    chat: bool = False
    prompts: tuple[str, ...] = DEFAULT_PROMPTS
    seed: int = 0
    timeout_s: float = 300.0  # per request deadline
    auth_token: str | None = None
    tls_ca: str | None = None
    http_target: str | None = None  # host:port of the OpenAI HTTP API
    protocols: tuple[str, ...] = ("grpc",)  # which endpoints run; several alternate request by request
    closed_loop: int | None = None  # requests in flight at once instead of Poisson arrivals

    def __post_init__(self):
        if not self.protocols or any(p not in ("grpc", "http") for p in self.protocols):
            raise ValueError(f"protocols must be grpc and/or http, got {self.protocols}")
        if "http" in self.protocols and not self.http_target:
            raise ValueError("the http protocol needs http_target")
        if self.closed_loop is not None and (self.closed_loop < 1 or self.max_requests is None):
            raise ValueError("closed_loop needs a concurrency >= 1 and max_requests")
        if not self.rates or any(r <= 0 for r in self.rates):
            raise ValueError(f"rates must be positive, got {self.rates}")
        if self.duration_s <= 0:
            raise ValueError(f"duration_s must be > 0, got {self.duration_s}")
        if self.max_requests is not None and self.max_requests < 1:
            raise ValueError(f"max_requests must be >= 1, got {self.max_requests}")
        if not self.prompts:
            raise ValueError("no prompts")


@dataclasses.dataclass(frozen=True)
class Sample:
    """One request. Times in seconds; None where not reached (e.g. an error before the first token)."""

    rate: float
    sent_s: float  # since the rate's start
    code: str
    tokens: int
    ttft_s: float | None
    tpot_s: float | None
    latency_s: float
    error: str | None = None
    protocol: str = "grpc"


class HttpClient:
    """Streams completions from the OpenAI HTTP API (stdlib http.client: no client library's overhead), one
    keep-alive connection per thread."""

    def __init__(self, target: str, auth_token: str | None = None):
        self.host, _, port = target.removeprefix("http://").rpartition(":")
        self.port = int(port)
        self.headers = {"content-type": "application/json",
                        **({"authorization": f"Bearer {auth_token}"} if auth_token else {})}
        self._local = threading.local()

    def stream(self, config: LoadConfig, prompt: str):
        """Yields (text, completion tokens or None) per SSE chunk (the usage chunk last); raises
        RuntimeError('HTTP <status>: ...') on an error."""
        body = {"max_tokens": config.max_tokens, "temperature": config.temperature, "stream": True,
                "stream_options": {"include_usage": True}, "ignore_eos": config.ignore_eos}
        path = "/v1/chat/completions" if config.chat else "/v1/completions"
        body.update({"messages": [{"role": "user", "content": prompt}]} if config.chat else {"prompt": prompt})
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._local.conn = http.client.HTTPConnection(self.host, self.port, timeout=config.timeout_s)
        try:
            conn.request("POST", path, json.dumps(body), self.headers)
            response = conn.getresponse()
        except (OSError, http.client.HTTPException):
            self._local.conn = None
            conn.close()
            raise
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {response.read()[:200]!r}")
        for line in response:
            if not line.startswith(b"data: "):
                continue
            data = line[6:].strip()
            if data == b"[DONE]":
                break
            event = json.loads(data)
            if "error" in event:
                raise RuntimeError(f"stream error: {event['error']['message']}")
            for choice in event["choices"]:
                piece = choice["delta"].get("content") if config.chat else choice["text"]
                yield piece or "", None
            if event.get("usage"):
                yield "", event["usage"]["completion_tokens"]
        response.read()


def _one_http_request(client: HttpClient, config: LoadConfig, prompt: str, rate: float, t0: float) -> Sample:
    """As `_one_request` over HTTP (tokens from the usage chunk; TPOT over the chunks that carried text)."""
    sent = time.perf_counter()
    first = last = None
    chunks, tokens, code, error = 0, 0, "OK", None
    try:
        for text, completion in client.stream(config, prompt):
            if text:
                now = time.perf_counter()
                first = first if first is not None else now
                last = now
                chunks += 1
            tokens = completion if completion is not None else tokens
    except (RuntimeError, OSError, http.client.HTTPException) as exc:
        code, error = "ERROR", str(exc)
    end = time.perf_counter()
    return Sample(rate=rate, sent_s=sent - t0, code=code, tokens=tokens, ttft_s=None if first is None else first - sent,
                  tpot_s=(last - first) / (chunks - 1) if first is not None and chunks > 1 else None,
                  latency_s=end - sent, error=error, protocol="http")


def _one_request(client: GenerationClient, config: LoadConfig, prompt: str, rate: float, t0: float) -> Sample:
    sent = time.perf_counter()
    first = last = None
    tokens = 0
    code, error = "OK", None
    kwargs = dict(max_tokens=config.max_tokens, temperature=config.temperature, ignore_eos=config.ignore_eos,
                  timeout=config.timeout_s)
    try:
        stream = (client.generate(messages=[("user", prompt)], **kwargs) if config.chat
                  else client.generate(prompt, **kwargs))
        for message in stream:
            if message.token_ids:
                now = time.perf_counter()
                first = first if first is not None else now
                last = now
                tokens += len(message.token_ids)
    except grpc.RpcError as exc:
        code, error = exc.code().name, exc.details()
    end = time.perf_counter()
    return Sample(rate=rate, sent_s=sent - t0, code=code, tokens=tokens,
                  ttft_s=None if first is None else first - sent,
                  tpot_s=(last - first) / (tokens - 1) if first is not None and tokens > 1 else None,
                  latency_s=end - sent, error=error)


def _send(clients: dict, config: LoadConfig, i: int, rate: float, t0: float) -> Sample:
    """Request i, on protocol i mod len(protocols) (alternating, so both see the same load and prompts)."""
    protocol = config.protocols[i % len(config.protocols)]
    prompt = config.prompts[(i // len(config.protocols)) % len(config.prompts)]
    if protocol == "http":
        return _one_http_request(clients["http"], config, prompt, rate, t0)
    return _one_request(clients["grpc"], config, prompt, rate, t0)


def run_closed(clients: dict, config: LoadConfig) -> tuple[list[Sample], float]:
    """`closed_loop` workers, each sending its next request when the last one ended, max_requests in all."""
    samples: list[Sample] = []
    lock = threading.Lock()
    counter = iter(range(config.max_requests))
    t0 = time.perf_counter()

    def worker():
        while True:
            with lock:
                i = next(counter, None)
            if i is None:
                return
            sample = _send(clients, config, i, 0.0, t0)
            with lock:
                samples.append(sample)

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(config.closed_loop)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sorted(samples, key=lambda s: s.sent_s), time.perf_counter() - t0


def run_rate(client: GenerationClient, config: LoadConfig, rate: float, rng: np.random.Generator,
             sleep: Callable[[float], None] = time.sleep) -> tuple[list[Sample], float]:
    """All arrivals of one rate; returns the samples and the wall seconds until the last one ended.
    `client`: a GenerationClient, or {"grpc": ..., "http": HttpClient} for several protocols."""
    clients = client if isinstance(client, dict) else {"grpc": client}
    samples: list[Sample] = []
    lock = threading.Lock()
    threads = []
    t0 = time.perf_counter()
    next_at = 0.0
    i = 0
    while next_at < config.duration_s and (config.max_requests is None or i < config.max_requests):
        delay = t0 + next_at - time.perf_counter()
        if delay > 0:
            sleep(delay)
        def work(i=i):
            sample = _send(clients, config, i, rate, t0)
            with lock:
                samples.append(sample)

        thread = threading.Thread(target=work, name=f"load-{rate}-{i}", daemon=True)
        thread.start()
        threads.append(thread)
        i += 1
        next_at += float(rng.exponential(1.0 / rate))
    for thread in threads:
        thread.join(config.timeout_s + 10)
    return sorted(samples, key=lambda s: s.sent_s), time.perf_counter() - t0


def _percentiles(values: Sequence[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}}
    arr = np.asarray(values, np.float64)
    return {"mean": float(arr.mean()), **{f"p{p}": float(np.percentile(arr, p)) for p in PERCENTILES}}


def _achieved_rate(samples: list[Sample]) -> float | None:
    """Arrivals per second actually sent: (n - 1) / (last send - first send)."""
    if len(samples) < 2:
        return None
    span = samples[-1].sent_s - samples[0].sent_s
    return (len(samples) - 1) / span if span > 0 else None


def summarize(rate: float, samples: list[Sample], wall_s: float) -> dict:
    ok = [s for s in samples if s.code == "OK"]
    codes: dict[str, int] = {}
    for s in samples:
        codes[s.code] = codes.get(s.code, 0) + 1
    span = max((s.sent_s + s.latency_s for s in ok), default=0.0) - min((s.sent_s for s in ok), default=0.0)
    tokens = sum(s.tokens for s in ok)
    return {
        "rate": rate, "requests": len(samples), "ok": len(ok), "codes": codes, "wall_s": wall_s,
        "achieved_rate": _achieved_rate(samples),
        "output_tokens": tokens, "tokens_per_s": tokens / span if span > 0 else None,
        "ttft_s": _percentiles([s.ttft_s for s in ok if s.ttft_s is not None]),
        "tpot_s": _percentiles([s.tpot_s for s in ok if s.tpot_s is not None]),
        "latency_s": _percentiles([s.latency_s for s in ok]),
    }


def run_load_test(config: LoadConfig, client: GenerationClient | None = None) -> dict:
    """Every rate in turn (or the closed loop), per protocol; the report that `write_report` saves, with the
    machine, date and load average before and after."""
    own = client is None and "grpc" in config.protocols
    if own:
        client = GenerationClient(config.target, auth_token=config.auth_token, tls_ca=config.tls_ca)
    clients = {"grpc": client}
    if "http" in config.protocols:
        clients["http"] = HttpClient(config.http_target, config.auth_token)
    rng = np.random.default_rng(config.seed)
    load_before = os.getloadavg()
    try:
        summaries, samples = [], []
        runs = [(0.0, None)] if config.closed_loop else [(rate, rng) for rate in config.rates]
        for rate, rate_rng in runs:
            got, wall = run_closed(clients, config) if config.closed_loop else run_rate(clients, config, rate,
                                                                                       rate_rng)
            samples += got
            for protocol in config.protocols:
                summaries.append({"protocol": protocol, "concurrency": config.closed_loop,
                                  **summarize(rate, [s for s in got if s.protocol == protocol], wall)})
    finally:
        if own:
            client.close()
    settings = dataclasses.asdict(config)
    settings.pop("auth_token")
    return {"command": " ".join(["python -m benchmarks.load_test", *sys.argv[1:]]),
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "machine": {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version()},
            "loadavg_before": load_before, "loadavg_after": os.getloadavg(), "settings": settings,
            "summaries": summaries, "overhead": _overhead(summaries),
            "samples": [dataclasses.asdict(s) for s in samples]}


def _overhead(summaries: list[dict]) -> dict | None:
    """HTTP's mean latency and TTFT relative to gRPC's (1.02 = 2 % slower), where both ran."""
    by = {s["protocol"]: s for s in summaries}
    if set(by) != {"grpc", "http"}:
        return None
    ratio = lambda key: (by["http"][key]["mean"] / by["grpc"][key]["mean"]  # noqa: E731
                         if by["http"][key]["mean"] and by["grpc"][key]["mean"] else None)
    return {"latency_mean_http_over_grpc": ratio("latency_s"), "ttft_mean_http_over_grpc": ratio("ttft_s")}


def markdown(report: dict) -> str:
    s = report["settings"]
    ms = lambda v: "-" if v is None else f"{v * 1e3:.1f}"  # noqa: E731
    lines = [
        f"Load test of `{s['target']}`" + (f" and `{s['http_target']}` (HTTP)" if s.get("http_target") else "")
        + (f": closed loop, {s['closed_loop']} in flight" if s.get("closed_loop") else
           f": Poisson arrivals, {s['duration_s']:g} s per rate")
        + (f" (at most {s['max_requests']} requests)" if s["max_requests"] else "")
        + f", max_tokens {s['max_tokens']}, temperature {s['temperature']:g}"
        + (", ignore_eos" if s["ignore_eos"] else "") + ". Times in ms (client side), over OK requests.",
        "",
        "| rate (req/s) | requests | ok | other codes | tokens/s | TTFT p50 | TTFT p90 | TTFT p99 "
        "| TPOT p50 | TPOT p90 | TPOT p99 | latency p50 | latency p90 | latency p99 | latency mean | protocol |",
        "|---:|---:|---:|:---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---|",
    ]
    for r in report["summaries"]:
        other = ", ".join(f"{c} {n}" for c, n in sorted(r["codes"].items()) if c != "OK") or "-"
        tps = "-" if r["tokens_per_s"] is None else f"{r['tokens_per_s']:.1f}"
        load = f"c={r['concurrency']}" if r.get("concurrency") else f"{r['rate']:g}"
        cells = [load, str(r["requests"]), str(r["ok"]), other, tps]
        for key in ("ttft_s", "tpot_s", "latency_s"):
            cells += [ms(r[key][f"p{p}"]) for p in PERCENTILES]
        lines.append("| " + " | ".join([*cells, ms(r["latency_s"]["mean"]), r.get("protocol", "grpc")]) + " |")
    overhead = report.get("overhead")
    if overhead and overhead["latency_mean_http_over_grpc"] is not None:
        lines += ["", f"HTTP / gRPC mean latency: {overhead['latency_mean_http_over_grpc']:.3f}; mean TTFT: "
                  f"{overhead['ttft_mean_http_over_grpc']:.3f}. HTTP TPOT is per text chunk (one per engine step)."]
    return "\n".join(lines) + "\n"


def write_report(report: dict, out_dir: str | Path) -> tuple[Path, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out / "load_test.json", out / "load_test.md"
    json_path.write_text(json.dumps(report, indent=1))
    md_path.write_text(markdown(report))
    return json_path, md_path


def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def main(argv: list[str] | None = None) -> int:
    d = LoadConfig()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=d.target, help="host:port of the server (gRPC)")
    parser.add_argument("--http-target", default=None, help="host:port of its OpenAI HTTP API (--http-port); "
                        "with --target too, both run, alternating request by request")
    parser.add_argument("--grpc-off", action="store_true", help="with --http-target: drive HTTP only")
    parser.add_argument("--closed-loop", type=int, default=None, metavar="C",
                        help="keep C requests in flight (needs --requests) instead of Poisson arrivals")
    parser.add_argument("--rates", type=_floats, default=d.rates, help="arrival rates in requests/s, e.g. 0.5,1,2")
    parser.add_argument("--duration", type=float, default=d.duration_s, help="seconds of arrivals per rate")
    parser.add_argument("--requests", type=int, default=None, help="at most this many arrivals per rate")
    parser.add_argument("--max-tokens", type=int, default=d.max_tokens)
    parser.add_argument("--temperature", type=float, default=d.temperature)
    parser.add_argument("--ignore-eos", action="store_true", help="always generate max_tokens tokens")
    parser.add_argument("--chat", action="store_true", help="send prompts as chat user messages")
    parser.add_argument("--prompts", type=Path, default=None, help="a text file, one prompt per line")
    parser.add_argument("--seed", type=int, default=d.seed, help="seed of the arrival times")
    parser.add_argument("--timeout", type=float, default=d.timeout_s, help="per-request deadline (s)")
    parser.add_argument("--auth-token", default=None)
    parser.add_argument("--tls-ca", default=None)
    parser.add_argument("--out", type=Path, required=True, help="output directory")
    args = parser.parse_args(argv)
    prompts = d.prompts
    if args.prompts is not None:
        prompts = tuple(line for line in args.prompts.read_text().splitlines() if line.strip())
    config = LoadConfig(target=args.target, rates=args.rates, duration_s=args.duration, max_requests=args.requests,
                        max_tokens=args.max_tokens, temperature=args.temperature, ignore_eos=args.ignore_eos,
                        chat=args.chat, prompts=prompts, seed=args.seed, timeout_s=args.timeout,
                        auth_token=args.auth_token, tls_ca=args.tls_ca, http_target=args.http_target,
                        protocols=(("http",) if args.grpc_off else ("grpc", "http")) if args.http_target else ("grpc",),
                        closed_loop=args.closed_loop)
    report = run_load_test(config)
    json_path, md_path = write_report(report, args.out)
    print(markdown(report))
    print(f"wrote {json_path} and {md_path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
