"""Load test of a running `jaxspec serve`: Poisson arrivals at a few rates, streaming latencies.

    python -m benchmarks.load_test --target 127.0.0.1:50051 --rates 0.5,1,2 --duration 60 \
        --max-tokens 128 --out artifacts/load_test

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
import json
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

    def __post_init__(self):
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


def run_rate(client: GenerationClient, config: LoadConfig, rate: float, rng: np.random.Generator,
             sleep: Callable[[float], None] = time.sleep) -> tuple[list[Sample], float]:
    """All arrivals of one rate; returns the samples and the wall seconds until the last one ended."""
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
        prompt = config.prompts[i % len(config.prompts)]

        def work(prompt=prompt):
            sample = _one_request(client, config, prompt, rate, t0)
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
    """Every rate in turn; the report that `write_report` saves."""
    own = client is None
    client = client or GenerationClient(config.target, auth_token=config.auth_token, tls_ca=config.tls_ca)
    rng = np.random.default_rng(config.seed)
    try:
        summaries, samples = [], []
        for rate in config.rates:
            got, wall = run_rate(client, config, rate, rng)
            samples += got
            summaries.append(summarize(rate, got, wall))
    finally:
        if own:
            client.close()
    settings = dataclasses.asdict(config)
    settings.pop("auth_token")
    return {"settings": settings, "summaries": summaries, "samples": [dataclasses.asdict(s) for s in samples]}


def markdown(report: dict) -> str:
    s = report["settings"]
    ms = lambda v: "-" if v is None else f"{v * 1e3:.1f}"  # noqa: E731
    lines = [
        f"Load test of `{s['target']}`: Poisson arrivals, {s['duration_s']:g} s per rate"
        + (f" (at most {s['max_requests']} requests)" if s["max_requests"] else "")
        + f", max_tokens {s['max_tokens']}, temperature {s['temperature']:g}"
        + (", ignore_eos" if s["ignore_eos"] else "") + ". Times in ms (client side), over OK requests.",
        "",
        "| rate (req/s) | requests | ok | other codes | tokens/s | TTFT p50 | TTFT p90 | TTFT p99 "
        "| TPOT p50 | TPOT p90 | TPOT p99 | latency p50 | latency p90 | latency p99 |",
        "|---:|---:|---:|:---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report["summaries"]:
        other = ", ".join(f"{c} {n}" for c, n in sorted(r["codes"].items()) if c != "OK") or "-"
        tps = "-" if r["tokens_per_s"] is None else f"{r['tokens_per_s']:.1f}"
        cells = [f"{r['rate']:g}", str(r["requests"]), str(r["ok"]), other, tps]
        for key in ("ttft_s", "tpot_s", "latency_s"):
            cells += [ms(r[key][f"p{p}"]) for p in PERCENTILES]
        lines.append("| " + " | ".join(cells) + " |")
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
    parser.add_argument("--target", default=d.target, help="host:port of the server")
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
                        auth_token=args.auth_token, tls_ca=args.tls_ca)
    report = run_load_test(config)
    json_path, md_path = write_report(report, args.out)
    print(markdown(report))
    print(f"wrote {json_path} and {md_path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
