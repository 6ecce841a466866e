#!/usr/bin/env bash
# GPU check (issue 42): the GPU step against its floor, Qwen2.5-1.5B-shaped bf16 random weights, one call ≤ 8 minutes.
#
#   benchmarks/gpu_check.sh "$OUT"              on one H100/H200 (stages' limits: 455 s, + 120 s of XLA-form reruns)
#   benchmarks/gpu_check.sh --dry-run "$OUT"    (or GPU_CHECK_DRY_RUN=1) the same Python on CPU, the tiny model
#
# What travels: the repository, and the wheels in .whl/ (gitignored) when present: the device image has JAX 0.11.2
# with its CUDA 13 plugin, not the pinned 0.10.2 (whose CUDA wheels are 124-174 MB, over the 64 MiB a call carries),
# and lacks only `gguf` of what these stages import. benchmarks/gpu_wheelhouse.sh downloads it; name `.whl` in
# `carry`. Set PYTHON to choose the interpreter (default python3: on the device, the one that holds JAX).
# docs/results/gpu/README.md says how to run it and what each file holds.
#
# Stages, each with its own time limit, log and JSON in $OUT, so a failing stage leaves the others' results:
#   0) the device: JAX's version and devices, the carried wheels installed, the stages' imports (exit 3 if no GPU);
#   1) decode.json: plain decode (k = 0) at B = 1 and B = 16 over full windows, the step executable alone and
#      Engine.step, as a fraction of HBM bandwidth (peak from the device name); the scheduler's loop overlapped
#      against synchronous (when the scheduler has the option), alternated; the kernel plan in use;
#   2) floor.json: the B = 1 step at k = 0, 4, 8 against the bare chain of its own matmuls, and the same step of an
#      engine built with --kernels xla (on a GPU the plan picks the Pallas attention kernel), alternated;
#      KERNELS=xla runs every stage in the XLA form; with the default (auto), a stage 1 or 2 that fails (not one
#      that times out) is rerun once in the XLA form, so the goals still get a figure (its kernel_plan says so);
#   3) decode_cmdbuf_off.json, decode_cmdbuf_on.json: B = 1 plain decode with XLA's command buffers (CUDA graphs)
#      off and on (XLA_FLAGS, one process each; stage 1 is XLA's default);
#   4) step_trace.json: the k = 0 step and its bare chain kernel by kernel (jax.profiler), the top kernels by name;
#   5) summary.json: the goals (B = 1 plain decode ≥ 50 % of HBM bandwidth; the k = 0 step ≤ 1.2× its bare chain),
#      met or not, with the figures beside them.
# Opt-in stages for a second call on the still-warm machine (they do not fit the 8 minutes): GOODPUT=1 (the
# goodput benchmark, benchmarks/gpu_bench.py), TESTS=1 (the engine's tests), MESH=1 (benchmarks/mesh_bench.py),
# HOST=1 (benchmarks/host_overhead.py), DECODE_SPEED=1 (benchmarks/decode_speed.py, k ∈ {0,2,4,8} × W ∈ {512,2048}).
set -u
DRY_RUN="${GPU_CHECK_DRY_RUN:-0}"
if [ "${1:-}" = "--dry-run" ]; then DRY_RUN=1; shift; fi
OUT="${1:-${OUT:-}}"
if [ -z "$OUT" ]; then echo "usage: $0 [--dry-run] OUT_DIR (or set \$OUT)" >&2; exit 2; fi
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export XLA_PYTHON_CLIENT_PREALLOCATE=false             # allocate as needed: two engines' weights in stage 2
export PYTHONUNBUFFERED=1
CACHE="${JAXSPEC_COMPILATION_CACHE:-/tmp/jaxspec-xla-cache}"  # outside $OUT: large
export JAXSPEC_COMPILATION_CACHE="$CACHE"
export JAX_COMPILATION_CACHE_DIR="$CACHE" JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0  # tests too
BASE_XLA_FLAGS="${XLA_FLAGS:-}"
CMDBUF_OFF="${CMDBUF_OFF:---xla_gpu_enable_command_buffer=}"
CMDBUF_ON="${CMDBUF_ON:---xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN}"
if [ "$DRY_RUN" = 1 ]; then
  # the same stages on CPU with the tiny model, small windows and few repeats: proves the plumbing, measures nothing
  export JAX_PLATFORMS=cpu
  MODEL="${MODEL:-tiny}" DTYPE="${DTYPE:-float32}" WINDOW="${WINDOW:-128}" MAX_TOKENS="${MAX_TOKENS:-64}"
  REPEATS="${REPEATS:-8}" LOOP_REPEATS="${LOOP_REPEATS:-2}" CALLS="${CALLS:-3}" K="${K:-0,4}"
  SCALE=3  # a loaded 2-core CPU compiles slower than a GPU machine's 16 cores
else
  export JAX_PLATFORMS="${JAX_PLATFORMS:-cuda}"        # fail loudly instead of silently running on CPU
  MODEL="${MODEL:-qwen2.5-1.5b}" DTYPE="${DTYPE:-bfloat16}" WINDOW="${WINDOW:-512}" MAX_TOKENS="${MAX_TOKENS:-128}"
  REPEATS="${REPEATS:-30}" LOOP_REPEATS="${LOOP_REPEATS:-3}" CALLS="${CALLS:-10}" K="${K:-0,4,8}"
  SCALE=1
fi
KERNELS="${KERNELS:-auto}"  # the engines' kernel plan choice (auto: Pallas attention on a GPU)
PIECE=(--model "$MODEL" --dtype "$DTYPE" --window "$WINDOW" --repeats "$REPEATS")
status=0
limit() { echo $(( $1 * SCALE )); }
xla_retry() {  # xla_retry NAME: after stage NAME failed (not timed out) with the auto plan, "yes" to rerun it in
  # the XLA form (it raised), so the call still records the goal's figure; the JSON's kernel_plan says so
  local rc; rc=$(grep -o "^== $1 rc=[0-9]*" "$OUT/check.log" | tail -n 1 | sed "s/.*rc=//")
  if [ "$KERNELS" = auto ] && [ "$rc" = 1 ]; then echo yes; fi  # 1: an exception (2: bad flags, 124: timed out)
}
# $OUT gets the JSON files and one log, check.log (a device call brings back at most 8 files)
LOGS="$(mktemp -d)"
: > "$OUT/check.log"
stage() {  # stage NAME LIMIT_S CMD...: run with a time limit, its output appended to $OUT/check.log; print its tail
  local name=$1 seconds=$2; shift 2
  local t0=$SECONDS
  timeout "$seconds" "$@" > "$LOGS/$name.log" 2>&1
  local rc=$?
  local line="== $name rc=$rc in $((SECONDS - t0)) s (limit $seconds s; 124 = timed out)"
  { echo "$line"; cat "$LOGS/$name.log"; } >> "$OUT/check.log"
  echo "$line"
  [ $rc -eq 0 ] || status=1
  grep -v -E '^[[:space:]]|^[{}]' "$LOGS/$name.log" | tail -n 12
}

# 0) the device, ≤ 30 s: the carried wheels (.whl/) installed where PYTHONPATH finds them, then JAX and the imports
if ls .whl/*.whl > /dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/gpu-check-site \
    .whl/*.whl >> "$OUT/check.log" 2>&1 || echo "installing .whl/ failed: see $OUT/check.log" >&2
  export PYTHONPATH="$PYTHONPATH:/tmp/gpu-check-site"
fi
timeout "$(limit 30)" "$PY" - "$DRY_RUN" > "$LOGS/device.log" 2>&1 <<'PYEOF'
import sys
import jax
import benchmarks.gpu_floor as gpu_floor
import benchmarks.step_trace  # noqa: F401  (the stages' imports, checked before any stage runs)
devices = jax.devices()
kind = devices[0].device_kind
print("jax", jax.__version__, devices, repr(kind), "peak HBM GB/s:", gpu_floor.peak_hbm_gbs(kind))
print("scheduler overlap option:", gpu_floor.overlap_option())
if sys.argv[1] != "1":
    assert devices[0].platform == "gpu", f"expected a GPU, got {devices[0].platform}"
PYEOF
rc=$?
if command -v nvidia-smi > /dev/null; then  # read-only: the card as found (name, clocks, memory, driver)
  nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,clocks.max.sm,driver_version --format=csv \
    >> "$LOGS/device.log" 2>&1
fi
{ echo "== device rc=$rc"; cat "$LOGS/device.log"; } >> "$OUT/check.log"
cat "$LOGS/device.log"
if [ $rc -ne 0 ]; then echo "the device check failed (rc $rc): see $OUT/check.log" >&2; exit 3; fi

# 1) plain decode at B = 1 and 16 as a fraction of HBM bandwidth, and the loop overlapped vs synchronous, ≤ 100 s
stage decode "$(limit 100)" "$PY" -m benchmarks.gpu_floor decode "${PIECE[@]}" --kernels "$KERNELS" --batch 1,16 \
  --loop --max-tokens "$MAX_TOKENS" --loop-repeats "$LOOP_REPEATS" --out "$OUT/decode.json"
[ "$(xla_retry decode)" = yes ] && stage decode_xla "$(limit 60)" "$PY" -m benchmarks.gpu_floor decode "${PIECE[@]}" \
  --kernels xla --batch 1,16 --label "xla (the auto plan failed: check.log)" --out "$OUT/decode.json"

# 2) the step against its bare chain at k = 0, 4, 8, and the --kernels xla engine alternated with it, ≤ 130 s
stage floor "$(limit 130)" "$PY" -m benchmarks.gpu_floor floor "${PIECE[@]}" --kernels "$KERNELS" --k "$K" \
  --xla-reference --out "$OUT/floor.json"
[ "$(xla_retry floor)" = yes ] && stage floor_xla "$(limit 60)" "$PY" -m benchmarks.gpu_floor floor "${PIECE[@]}" \
  --kernels xla --k "$K" --out "$OUT/floor.json"

# 3) XLA's command buffers (CUDA graphs) off and on, B = 1 plain decode, ≤ 55 s each (own compile caches: the
#    flags are part of what was compiled)
for setting in off on; do
  flag=$CMDBUF_OFF; [ "$setting" = on ] && flag=$CMDBUF_ON
  JAXSPEC_COMPILATION_CACHE="$CACHE-cmdbuf-$setting" JAX_COMPILATION_CACHE_DIR="$CACHE-cmdbuf-$setting" \
    XLA_FLAGS="$BASE_XLA_FLAGS $flag" stage "cmdbuf_$setting" "$(limit 55)" "$PY" -m benchmarks.gpu_floor decode \
    "${PIECE[@]}" --kernels "$KERNELS" --batch 1 --label "cmdbuf-$setting" --out "$OUT/decode_cmdbuf_$setting.json"
done

# 4) the k = 0 step kernel by kernel, next to its bare chain, ≤ 70 s
stage step_trace "$(limit 70)" "$PY" -m benchmarks.step_trace --model "$MODEL" --dtype "$DTYPE" --k 0 \
  --kernels "$KERNELS" --window "$WINDOW" --calls "$CALLS" --out "$OUT/step_trace.json"

# 5) the goals, met or not, ≤ 15 s
dry=(); [ "$DRY_RUN" = 1 ] && dry=(--dry-run)
stage summary "$(limit 15)" "$PY" -m benchmarks.gpu_floor summary --dir "$OUT" "${dry[@]}" --out "$OUT/summary.json"

# --- opt-in stages (a second call) ---------------------------------------------------------------------------
if [ "${DECODE_SPEED:-0}" = 1 ]; then  # the earlier floor table: k ∈ {0,2,4,8} × W ∈ {512, 2048}, ≤ 150 s
  stage decode_speed "${FLOOR_LIMIT_S:-150}" "$PY" -m benchmarks.decode_speed --model "$MODEL" --dtype "$DTYPE" \
    --skip-hf --k-menu 0,2,4,8 --windows 512,2048 --step-repeats 30 --tokens 64 --repeats 3 \
    --out "$OUT/decode_speed.json"
fi
if [ "${GOODPUT:-0}" = 1 ]; then  # goodput against every fixed k with intervals (issue 46): NoisyProposer(ALPHA) over
  # a truncated self-draft, code and chat, Poisson 0.3 / 0.8, 2 paired repeats, the policies taking turns, ≤ 420 s
  for preset in ${PRESETS:-qwen2.5-1.5b}; do
    stage "gpu_bench_$preset" "${PRESET_LIMIT_S:-420}" "$PY" -m benchmarks.gpu_bench --presets "$preset" \
      --dtype "$DTYPE" --alpha "${ALPHA:-0.8}" --draft "${DRAFT:-truncated:2}" --requests 8 --max-tokens 64 \
      --max-prompt-tokens 160 --capacity 8 --k-menu 0,1,3,5 --fractions 0.3,0.8 --workloads "${WORKLOADS:-code,chat}" \
      --repeats "${GOODPUT_REPEATS:-2}" --slice "${SLICE:-0.5}" \
      --policies none,fixed:1,fixed:3,fixed:5,goodput --out "$OUT/gpu_bench/$preset"
  done
fi
if [ "${TESTS:-0}" = 1 ]; then  # the engine's tests first (distribution, greedy equality), ≤ 80 s, past failures
  ENGINE_TESTS="tests/test_sampling_distribution.py tests/test_feature_draft_distribution.py
    tests/test_tree_sampling_distribution.py tests/test_draft_tree_distribution.py tests/test_engine_greedy.py
    tests/test_engine_runtime.py tests/test_feature_draft.py tests/test_tree.py tests/test_draft_tree.py
    tests/test_engine_contract.py tests/test_noisy_proposer.py tests/test_dtype.py tests/test_floor.py"
  # shellcheck disable=SC2086
  timeout -s INT "${TEST_LIMIT_S:-80}" "$PY" -m pytest -q -rf --tb=line -p no:cacheprovider --maxfail=25 \
    -m "not slow" $ENGINE_TESTS > "$LOGS/pytest.log" 2>&1
  rc=$?; echo "== pytest rc=$rc"; [ $rc -eq 0 ] || status=1
  { echo "== pytest rc=$rc"; cat "$LOGS/pytest.log"; } >> "$OUT/check.log"
  tail -n 3 "$LOGS/pytest.log"
fi
if [ "${MESH:-0}" = 1 ]; then  # the mesh path on every visible GPU, ≤ 100 s
  NGPU=$("$PY" -c "import jax; print(len(jax.devices()))" 2>/dev/null || echo 1)
  MESHES="1x1"; [ "$NGPU" -ge 2 ] && MESHES="$MESHES,1x2"; [ "$NGPU" -ge 4 ] && MESHES="$MESHES,1x4"
  stage mesh_bench "${MESH_LIMIT_S:-100}" "$PY" -m benchmarks.mesh_bench --model qwen2.5-1.5b --dtype bfloat16 \
    --meshes "$MESHES" --batch 16 --peak-gbs "${PEAK_GBS:-4800}" --quiet --json "$OUT/mesh_bench.json"
fi
if [ "${HOST:-0}" = 1 ]; then  # the host's work per step and per policy, ≤ 120 s
  stage host_overhead "${HOST_LIMIT_S:-120}" "$PY" -m benchmarks.host_overhead --model "$MODEL" --dtype "$DTYPE" \
    --batch 1,8 --repeats 50 --out "$OUT/host_overhead.json"
fi
exit $status
