"""Throughput of `jaxspec batch --ray` at 1 and N replicas against plain `jaxspec batch` (docs/scale_out.md).

    python -m benchmarks.ray_scaling --prompts 96 --max-tokens 24 --replicas 1,2 \
        --engine "--model tiny --tokenizer ascii --menu tiny --policy none" --out docs/results/ray_scaling.md

Method: one input file of N greedy prompts; each configuration runs as the real command (a subprocess),
in turn, `--repeats` times, on a fresh output. The table takes each run's own summary line:
tokens/s = generated tokens / generation seconds, which for plain `jaxspec batch` start once its engine is
warmed up and for `--ray` once every replica is (so building and warming engines is outside both, and
shown apart as start-up, the command's wall time minus generation). Ray overhead per request =
(generation s at 1 replica - plain generation s) / prompts; it includes plain's one fsync per record
(measured here too: `fsync_ms`), which `--ray` replaces by one atomic write per block. `uptime`'s load
averages are recorded before and after every run: the machine may be shared.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SUMMARY = re.compile(r"batch: (\d+) tokens in ([\d.]+) s = ([\d.]+) tokens/s")
TOPICS = ["a lighthouse keeper", "the history of tea", "how rainbows form", "a robot learning to paint",
          "sorting algorithms", "the moons of Jupiter", "a city under the sea", "writing clean code"]


def load() -> str:
    """The 1, 5 and 15 minute load averages."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def fsync_ms(directory: Path, n: int = 50) -> float:
    """Milliseconds per append + fsync of a record-sized line here: what plain `jaxspec batch` pays per
    record inside its engine loop (`--ray` writes a block at a time, in the driver)."""
    path = directory / "fsync-probe"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        t0 = time.perf_counter()
        for _ in range(n):
            os.write(fd, b"x" * 400 + b"\n")
            os.fsync(fd)
        return (time.perf_counter() - t0) / n * 1e3
    finally:
        os.close(fd)
        path.unlink()


def make_input(path: Path, prompts: int, max_tokens: int) -> None:
    with path.open("w", encoding="utf-8") as f:
        for i in range(prompts):
            f.write(json.dumps({"id": i, "prompt": f"Write about {TOPICS[i % len(TOPICS)]} ({i}).",
                                "max_tokens": max_tokens}) + "\n")


def run_once(name: str, flags: list[str], inp: Path, work: Path) -> dict:
    out = work / f"{name}-{time.monotonic_ns()}.jsonl"
    command = [sys.executable, "-m", "jaxspec.cli", "batch", "--input", str(inp), "--output", str(out),
               "--no-progress", *flags]
    before = load()
    t0 = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = load()
    match = SUMMARY.search(proc.stderr)
    if proc.returncode != 0 or match is None:
        raise SystemExit(f"{name}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    tokens, seconds = int(match.group(1)), float(match.group(2))
    return {"config": name, "tokens": tokens, "generation_s": seconds, "tokens_per_s": tokens / seconds,
            "wall_s": wall, "startup_s": wall - seconds, "load_before": before, "load_after": after,
            "output": out.read_text(encoding="utf-8")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=96)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--replicas", default="1,2", help="comma-separated replica counts for --ray")
    parser.add_argument("--block-lines", type=int, default=16)
    parser.add_argument("--engine", default="", help="engine flags for every run, one string")
    parser.add_argument("--no-plain", action="store_true", help="skip plain `jaxspec batch`")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None, help="write the markdown table here")
    args = parser.parse_args(argv)
    engine = shlex.split(args.engine)
    configs = ([] if args.no_plain else [("plain", engine)]) + [
        (f"ray x{r}", ["--ray", "--replicas", str(r), "--block-lines", str(args.block_lines), *engine])
        for r in (int(x) for x in args.replicas.split(","))]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        inp = work / "in.jsonl"
        make_input(inp, args.prompts, args.max_tokens)
        probes = [fsync_ms(work)]
        rows = []
        for _ in range(args.repeats):
            for name, flags in configs:
                row = run_once(name, flags, inp, work)
                print(f"{name}: {row['tokens']} tokens in {row['generation_s']:.2f} s = {row['tokens_per_s']:.1f} "
                      f"tokens/s (wall {row['wall_s']:.1f} s; load {row['load_before']} -> {row['load_after']})",
                      file=sys.stderr)
                rows.append(row)
        probes.append(fsync_ms(work))
    outputs = {r["config"]: [json.loads(line)["token_ids"] for line in sorted(
        r["output"].splitlines(), key=lambda line: json.loads(line)["id"])] for r in rows}
    same = len({json.dumps(v) for v in outputs.values()}) == 1
    text = report(args, rows, same, probes)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text, encoding="utf-8")
    return 0


def report(args, rows: list[dict], same: bool, probes: list[float]) -> str:
    median = {name: statistics.median(r["generation_s"] for r in rows if r["config"] == name)
              for name in dict.fromkeys(r["config"] for r in rows)}
    lines = [f"# `jaxspec batch --ray` scaling ({datetime.datetime.now().isoformat(timespec='minutes')})", "",
             f"- Command: `python -m benchmarks.ray_scaling {' '.join(shlex.quote(a) for a in sys.argv[1:])}`",
             f"- Input: {args.prompts} greedy prompts, max_tokens {args.max_tokens}; engine flags "
             f"`{args.engine or '(defaults)'}`; {os.cpu_count()} CPU cores.",
             f"- Every configuration generated the same tokens: {'yes' if same else 'NO'}.",
             f"- One append + fsync of a record on this disk: {probes[0]:.1f} ms before the runs, {probes[1]:.1f} ms "
             f"after (plain `jaxspec batch` pays it per record, in its engine loop).", "",
             "| run | config | tokens | generation s | tokens/s | start-up s | load before | load after |",
             "|---:|---|---:|---:|---:|---:|---|---|"]
    for i, r in enumerate(rows, 1):
        lines.append(f"| {i} | {r['config']} | {r['tokens']} | {r['generation_s']:.2f} | {r['tokens_per_s']:.1f} | "
                     f"{r['startup_s']:.1f} | {r['load_before']} | {r['load_after']} |")
    lines.append("")
    base = median.get("ray x1")
    for name, seconds in median.items():
        note = [f"median generation {seconds:.2f} s"]
        if base is not None and name.startswith("ray x") and name != "ray x1":
            note.append(f"{base / seconds:.2f}x the tokens/s of 1 replica")
        if name == "ray x1" and "plain" in median:
            plain = median["plain"]
            note.append(f"{(seconds - plain) / plain * 100:+.1f}% time vs plain, "
                        f"{(seconds - plain) / args.prompts * 1e3:+.2f} ms per request")
        lines.append(f"- {name}: " + ", ".join(note))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
