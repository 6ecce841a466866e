#!/usr/bin/env bash
# CI: the built wheel installs into a fresh venv and runs from outside the repository, with its package data
# (jaxspec/configs, jaxspec/drafts) found through jaxspec.resources. Usage: .ci/check_wheel.sh [PYTHON]
# PYTHON (default .venv/bin/python) builds the wheel from a clean copy of the source tree (git's tracked and
# untracked-but-not-ignored files: no stale build/ dir can leak into it); the fresh venv takes its dependencies
# from pip's cache.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
python=$(realpath "${1:-.venv/bin/python}")
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
start=$SECONDS

mkdir "$tmp/src"
git ls-files -z --cached --others --exclude-standard |
  while IFS= read -r -d '' f; do if [ -e "$f" ]; then printf '%s\0' "$f"; fi; done |
  tar --null -T - -cf - | tar -xf - -C "$tmp/src"
(cd "$tmp/src" && "$python" -m pip wheel -q --no-deps -w "$tmp/dist" .)
wheel=$(ls "$tmp"/dist/jaxspec-*.whl)
python3 -m venv "$tmp/venv"
"$tmp/venv/bin/pip" install -q "$wheel"

cd "$tmp"  # nothing of the repository on sys.path from here on
"$tmp/venv/bin/python" - "$repo" "$wheel" <<'EOF'
import sys
import zipfile
from pathlib import Path

import jaxspec
from jaxspec import resources

repo = Path(sys.argv[1]).resolve()
package = Path(jaxspec.__file__).resolve().parent
assert repo not in package.parents, f"jaxspec imported from the repository ({package}), not the wheel"
for path in (resources.config_file("engine.yaml"), resources.config_file("policy.yaml"),
             resources.config_file("serving.yaml"), resources.draft_arch_file("wide2"),
             resources.shipped_draft_dir("smollm2-135m") / "draft.json",
             resources.shipped_draft_dir("smollm2-135m") / "weights.npz"):
    assert path.is_file() and package in path.parents, f"missing from the installed package: {path}"
import jaxspec.bench.cli  # noqa: F401, E402  (`jaxspec bench` imports it: it ships)
import jaxspec.models.cache_attention  # noqa: E402  (the compiled XLA:CPU kernel, built into the wheel)

kernel = Path(jaxspec.models.cache_attention._cache_attention.__file__).resolve()
assert kernel.parent == package / "models", f"the kernel is not the wheel's: {kernel}"

tops = {name.split("/")[0] for name in zipfile.ZipFile(sys.argv[2]).namelist()}
assert {top for top in tops if not top.endswith(".dist-info")} == {"jaxspec"}, \
    f"the wheel installs more than `jaxspec` at the top level: {sorted(tops)}"
print(f"check_wheel: package data present under {package}")
EOF
out=$("$tmp/venv/bin/jaxspec" generate --model tiny --tokenizer ascii --menu tiny --max-tokens 4 "hi")
echo "check_wheel: jaxspec generate printed ${out@Q}"
# the other commands a user runs, from outside the checkout: a batch job end to end, and every command's flags
printf '{"id": "a", "prompt": "hi", "max_tokens": 3}\n' >"$tmp/in.jsonl"
"$tmp/venv/bin/jaxspec" batch --model tiny --tokenizer ascii --menu tiny --input "$tmp/in.jsonl" \
  --output "$tmp/out.jsonl" >/dev/null 2>&1 || { echo "check_wheel: jaxspec batch failed" >&2; exit 1; }
grep -q '"id": "a"' "$tmp/out.jsonl" || { echo "check_wheel: jaxspec batch wrote no row" >&2; exit 1; }
for command in serve bench profile distill client models; do
  "$tmp/venv/bin/jaxspec" "$command" --help >/dev/null || { echo "check_wheel: jaxspec $command --help" >&2; exit 1; }
done
echo "check_wheel: jaxspec batch wrote a row; every command's --help works"
echo "check_wheel: ok in $((SECONDS - start)) s"
