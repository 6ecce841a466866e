#!/usr/bin/env bash
# Load test of `jaxspec serve` on the default model: the same Poisson load against a server with
# the goodput policy and one without speculation (prompt lookup proposer), one after the other.
#   bash benchmarks/serve_load.sh OUT_DIR [RATES] [REQUESTS_PER_RATE]
set -euo pipefail
out=${1:?usage: serve_load.sh OUT_DIR [RATES] [REQUESTS]}; rates=${2:-0.1,0.25,0.5}; requests=${3:-10}
py=${PYTHON:-python}
mkdir -p "$out"
for policy in goodput none; do
  port=$((50100 + RANDOM % 500))
  proposer=ngram; [ "$policy" = none ] && proposer=none
  $py -m jaxspec.cli serve --port "$port" --proposer "$proposer" --policy "$policy" --menu serve-small \
      > "$out/server-$policy.log" 2>&1 &
  server=$!
  for _ in $(seq 600); do  # wait (up to 10 min) for warm-up + profiling: health SERVING
    if $py -c "import sys; from jaxspec.serving.client import GenerationClient as C; sys.exit(C('127.0.0.1:$port').health() != 'SERVING')" 2>/dev/null; then break; fi
    sleep 1
  done
  $py -m benchmarks.load_test --target "127.0.0.1:$port" --rates "$rates" --requests "$requests" \
      --duration 120 --max-tokens 64 --chat --out "$out/$policy"
  kill -TERM "$server"; wait "$server" || true
done
