"""The most any proposer could gain in a bench cell on this device: each fixed k's run with every proposal accepted.

Reads a bench JSON (`jaxspec bench --json`, records with the loop's time accounts: `loop.decode_s`, written since
2026-12-06) holding `none` and `fixed:K` records of a cell, and writes, per cell and K:

    ceiling decode = decode_s(fixed:K) · tokens_per_step(fixed:K) / (K + 1)

(the same steps at their measured cost, each emitting K + 1 tokens a row instead of the tokens per step measured,
so tokens_per_step / (K + 1) as many of them), and

    ceiling span = span(fixed:K) − decode_s(fixed:K) + ceiling decode,    speed-up ceiling = span(none) / ceiling span

Prefill, admission and output processing keep their measured time: no proposer changes them. In a closed loop
the mean latency is proportional to the span (Little's law, the same requests and clients), so the speed-up
ceiling bounds the mean-latency ratio too. Usage:

    python benchmarks/speculation_ceiling.py docs/results/suffix/agentic_128_c4_r2.json \
        --json docs/results/suffix/ceiling_agentic_128_c4.json
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path


def cell_key(record: dict) -> tuple:
    load = record.get("concurrency", record.get("rate"))
    return record["workload"], record["proposer"], load


def ceilings(records: list[dict]) -> list[dict]:
    """One entry per (cell, fixed K) with the ceiling, and the achieved speed-up of each policy of the cell."""
    cells: dict[tuple, dict[str, dict]] = {}
    for r in records:
        if "loop" not in r:
            raise ValueError(f"record {cell_key(r)} {r['policy']} has no loop accounts: re-run the bench "
                             "(jaxspec bench writes them since 2026-12-06)")
        cells.setdefault(cell_key(r), {})[r["policy"]] = r
    out = []
    for (workload, proposer, load), by_policy in cells.items():
        none = by_policy.get("none")
        if none is None:
            continue
        for policy, r in by_policy.items():
            m = re.fullmatch(r"fixed:(\d+)", policy)
            if m is None:
                continue
            k, repeats = int(m.group(1)), r["repeats"]
            decode = r["loop"]["decode_s"] / repeats  # per repeat, as span_s
            ceiling_decode = decode * r["tokens_per_step"] / (k + 1)
            ceiling_span = r["span_s"] - decode + ceiling_decode
            out.append({"workload": workload, "proposer": proposer, "load": load, "k": k,
                        "decode_s": decode, "ceiling_decode_s": ceiling_decode, "span_s": r["span_s"],
                        "ceiling_span_s": ceiling_span, "none_span_s": none["span_s"],
                        "speedup_ceiling": none["span_s"] / ceiling_span,
                        "achieved": {p: none["span_s"] / x["span_s"] for p, x in by_policy.items()},
                        "achieved_latency": {p: none["mean_latency_s"] / x["mean_latency_s"]
                                             for p, x in by_policy.items()}})
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("bench_json", type=Path)
    parser.add_argument("--json", type=Path, help="write the ceilings here")
    args = parser.parse_args(argv)
    data = json.loads(args.bench_json.read_text())
    rows = ceilings(data["records"])
    for row in rows:
        print(f"{row['workload']} {row['proposer']} load={row['load']} k={row['k']}: speed-up ceiling "
              f"{row['speedup_ceiling']:.2f}x (decode {row['decode_s']:.1f} s -> {row['ceiling_decode_s']:.1f} s of "
              f"a {row['span_s']:.1f} s span); best achieved {max(row['achieved'].values()):.2f}x")
    if args.json:
        args.json.write_text(json.dumps({"source": str(args.bench_json), "source_meta": data.get("meta"),
                                         "ceilings": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
