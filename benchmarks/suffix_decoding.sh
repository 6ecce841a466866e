#!/usr/bin/env bash
# Suffix decoding vs prompt lookup vs plain decoding, side by side in one run (c = 1 and 4, or LOADS), on this CPU.
# Writes docs/results/suffix/${NAME:-bench}.json (the bench's records + command, date, machine and load
# before/after). Every policy runs the same requests (same seeds); the suffix index and the prefix cache are cleared
# before each cell. REPEATS=R runs every cell R times (paired intervals).
set -euo pipefail
out=${OUT:-docs/results/suffix}
name=${NAME:-bench}
mkdir -p "$out"
before=$(cut -d' ' -f1-3 /proc/loadavg); date=$(date -u +%FT%TZ)
cmd=(python -m jaxspec.bench.cli --closed-loop "${LOADS:-1,4}" --proposers ngram,suffix
     --policies "${POLICIES:-none,fixed:2,fixed:4,fixed:8,goodput}"
     --workload "${WORKLOADS:-agentic,chat,edit}" --requests "${REQUESTS:-8}" --max-tokens "${MAX_TOKENS:-48}"
     --repeats "${REPEATS:-1}" --max-prompt-tokens 512 --k-menu "${K_MENU:-0,2,4,8}" --ignore-eos --no-plots
     --no-progress --json "$out/$name.json" --out "$out")
"${cmd[@]}"
after=$(cut -d' ' -f1-3 /proc/loadavg)
python - "$out/$name.json" "$date" "$before" "$after" "${cmd[*]}" <<'PY'
import json, sys
path, date, before, after, cmd = sys.argv[1:]
data = json.load(open(path))
data["meta"].update(date=date, loadavg_before=before.split(), loadavg_after=after.split(), command=cmd)
json.dump(data, open(path, "w"), indent=1)
PY
