"""Recompute the `checks` of recorded benchmark JSON with the current goal check.

    python -m benchmarks.recompute_checks [--check] [PATH ...]   # default: every JSON under docs/results

`jaxspec bench` (and `benchmarks/gpu_bench.py`, per preset) store `checks`, the goals computed from the run's
`records` by `jaxspec.bench.cli.check_goals`. Files written before a change to that function hold the old
verdicts; this rewrites them from the same records, leaving everything else in the file as it was. The records
are measurements and are never touched. `--check` only lists the files whose checks are stale (exit 1 if any).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from jaxspec.bench.cli import check_goals

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"


def recompute(result: dict) -> bool:
    """Recompute `result`'s checks in place (top level, or per preset for gpu_bench); True if any changed."""
    changed = False
    holders = [result] + [p for p in result.get("presets", {}).values() if isinstance(p, dict)]
    for holder in holders:
        if "checks" not in holder:
            continue
        if "records" not in holder:
            raise ValueError("a `checks` field without the `records` it was computed from")
        fresh = check_goals(holder["records"])
        if fresh != holder["checks"]:
            holder["checks"] = fresh
            changed = True
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="*", type=Path, help="JSON files (default: every *.json under docs/results)")
    parser.add_argument("--check", action="store_true", help="list stale files, rewrite nothing; exit 1 if any")
    args = parser.parse_args(argv)
    paths = args.paths or sorted(RESULTS.rglob("*.json"))
    stale = []
    for path in paths:
        result = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(result, dict) or not recompute(result):
            continue
        stale.append(path)
        if not args.check:
            path.write_text(json.dumps(result, indent=1), encoding="utf-8")
        print(f"{'stale' if args.check else 'rewrote'} {path}")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
