#!/usr/bin/env bash
# Goodput against every fixed k with 95 % paired bootstrap intervals (issue 46), the default model, R repeats of N
# requests a cell. Writes docs/results/goodput/NAME.{json,md}.
#   benchmarks/goodput_intervals.sh [REPEATS] [REQUESTS] [NAME]     (default 3 8 intervals_cpu)
# Environment: WORKLOADS (default code,chat), LOAD (closed-loop concurrencies, default 1; or FRACTIONS for Poisson
# load at these fractions of the measured service rate), PROPOSERS (default ngram), K_MENU (default 0,1,2,3,5),
# POLICIES (default none + fixed at every k of K_MENU + goodput), TREE (an N[:D] envelope for the *-tree proposers),
# SLICE (seconds: a cell's policies run at once, taking turns of that long, `jaxspec bench --slice`; default 0.5;
# 0: one after another).
set -euo pipefail
cd "$(dirname "$0")/.."
R=${1:-3}
N=${2:-8}
NAME=${3:-intervals_cpu}
K_MENU=${K_MENU:-0,1,2,3,5}
fixed=$(echo "$K_MENU" | tr ',' '\n' | awk '$1 > 0 {printf ",fixed:%s", $1}')
POLICIES=${POLICIES:-none${fixed},goodput}
if [[ -n "${FRACTIONS:-}" ]]; then load=(--load-fractions "$FRACTIONS"); prefix=bench; else
  load=(--closed-loop "${LOAD:-1}"); prefix=closed_loop; fi
PYTHONPATH=. ${PYTHON:-python} -m jaxspec.cli bench "${load[@]}" --workloads "${WORKLOADS:-code,chat}" \
  --proposers "${PROPOSERS:-ngram}" --policies "$POLICIES" --k-menu "$K_MENU" --repeats "$R" --requests "$N" \
  ${TREE:+--tree "$TREE"} --slice "${SLICE:-0.5}" --max-tokens 32 --max-prompt-tokens 192 --decision-log --no-plots --no-progress \
  --json "docs/results/goodput/$NAME.json" --out docs/results/goodput
mv "docs/results/goodput/$prefix.md" "docs/results/goodput/$NAME.md"
