#!/usr/bin/env bash
# Build the fused feature draft on a GPU from carried inputs: the data build this CPU cannot afford.
#
#   benchmarks/gpu_feature_draft.sh PARTS_DIR PROMPTS.npz OUT_DIR      (≤ 9 minutes)
#
# PARTS_DIR holds the target's GGUF in parts (target.gguf.part-*) and its checksum (target.gguf.sha256, a
# `sha256sum` line naming target.gguf):
# the default target's 98 MB file does not fit one call's 64 MiB, so the parts travel over several calls to
# the same warm machine (docs/drafts.md, "Building on an accelerator"). PROMPTS.npz comes from
# `jaxspec distill --save-prompts` (the ShareGPT package is not carried). The script joins and checks the
# GGUF, runs `jaxspec distill --kind feature` with on-policy data from all the prompts, and leaves the draft
# (draft.json, weights.npz) and the log in OUT_DIR; bring the draft back and measure it here
# (benchmarks/feature_draft_study.py). Set PYTHON to choose the interpreter (default: python); the sizes
# below can be overridden (ROWS, GEN_LEN, PROMPT_LEN, STEPS, BATCH, DATA_MINUTES, BUILD_LIMIT_S).
set -u
PARTS="${1:?usage: $0 PARTS_DIR PROMPTS.npz OUT_DIR}"
PROMPTS="${2:?usage: $0 PARTS_DIR PROMPTS.npz OUT_DIR}"
OUT="${3:?usage: $0 PARTS_DIR PROMPTS.npz OUT_DIR}"
mkdir -p "$OUT"
PARTS=$(realpath "$PARTS") PROMPTS=$(realpath "$PROMPTS") OUT=$(realpath "$OUT")
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export JAX_PLATFORMS="${JAX_PLATFORMS:-cuda}"          # fail loudly instead of silently running on CPU
export XLA_PYTHON_CLIENT_PREALLOCATE=false
export PYTHONUNBUFFERED=1
WORK="${WORK:-/tmp/jaxspec-feature-build}"
mkdir -p "$WORK"

# 1) the target, joined from its parts and checked against the checksum taken where it was split
cat "$PARTS"/target.gguf.part-* > "$WORK/target.gguf" || exit 3
(cd "$WORK" && sha256sum -c "$PARTS/target.gguf.sha256") || {
  echo "the joined GGUF does not match $PARTS/target.gguf.sha256: a part is missing or damaged" >&2; exit 3; }

# 2) the build: on-policy target continuations of every carried prompt (features of layers 2, 15, 30 kept
#    with them), then training; the last data shard is the held-out one the build reports agreement on
timeout "${BUILD_LIMIT_S:-480}" "$PY" -m jaxspec.cli distill --kind feature --model "$WORK/target.gguf" \
  --prompts-file "$PROMPTS" --prompts 1000000 --prompt-len "${PROMPT_LEN:-256}" --rows "${ROWS:-256}" \
  --gen-len "${GEN_LEN:-128}" --data-minutes "${DATA_MINUTES:-3}" --tf-minutes 0 --tf-sequences 0 \
  --steps "${STEPS:-1500}" --batch "${BATCH:-64}" --lr 0.0015 --ttt-passes 3 --reg-weight 1.0 \
  --feature-layers 1 --feature-fuse 2,15,30 --work "$WORK/work" --data "$WORK/data" --out "$OUT/draft" \
  --no-progress > "$OUT/build.log" 2>&1
rc=$?
echo "distill rc=$rc (124 = timed out; log: $OUT/build.log)"
tail -n 30 "$OUT/build.log"
ls -la "$OUT/draft" 2>/dev/null
exit $rc
