#!/usr/bin/env bash
# Goodput against every fixed k with 95 % paired bootstrap intervals (issue 46): prompt lookup on code and chat,
# closed loop c = 1, R repeats, the default model. Writes docs/results/goodput/NAME.{json,md}.
#   benchmarks/goodput_intervals.sh [REPEATS] [REQUESTS] [NAME]     (default 3 8 intervals_cpu)
set -euo pipefail
cd "$(dirname "$0")/.."
R=${1:-3}
N=${2:-8}
NAME=${3:-intervals_cpu}
PYTHONPATH=. ${PYTHON:-python} -m jaxspec.cli bench --closed-loop 1 --workloads code,chat --proposers ngram \
  --policies none,fixed:1,fixed:2,fixed:3,fixed:5,goodput --k-menu 0,1,2,3,5 --repeats "$R" --requests "$N" \
  --max-tokens 32 --max-prompt-tokens 192 --decision-log --no-plots --no-progress \
  --json "docs/results/goodput/$NAME.json" --out docs/results/goodput
mv docs/results/goodput/closed_loop.md "docs/results/goodput/$NAME.md"
