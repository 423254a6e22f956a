#!/usr/bin/env bash
# keel's C++ formatting: .clang-format, applied by clang-format 14.
#
#   scripts/format.sh           # format every tracked .cpp/.h in place
#   scripts/format.sh --check   # list the files clang-format would change; exit 1 if any (CI, ctest)
#
# The clang-format: $KEEL_CLANG_FORMAT, else the venv's (scripts/setup.sh pins clang-format
# 14.0.6 from PyPI there), else clang-format-14 or clang-format on PATH when it is version 14.
# Another major version formats differently, so none is taken silently: exit 1 saying so.
set -euo pipefail
cd "$(dirname "$0")/.."
check=0
[ "${1:-}" = --check ] && check=1

want=14
cf="${KEEL_CLANG_FORMAT:-}"
if [ -z "$cf" ]; then
  for c in ${KEEL_PYTHON:+"$(dirname "$KEEL_PYTHON")/clang-format"} "${KEEL_VENV:-$HOME/.cache/keel/venv}/bin/clang-format" \
           clang-format-$want clang-format; do
    if command -v "$c" >/dev/null 2>&1 && "$c" --version 2>/dev/null | grep -q "version $want\."; then cf=$c; break; fi
  done
fi
if [ -z "$cf" ]; then
  echo "format.sh: no clang-format $want found (scripts/setup.sh installs it into the venv; or set KEEL_CLANG_FORMAT)" >&2
  exit 1
fi

# Every tracked C++ file (git's list where there is one; a tree without .git: find).
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  mapfile -t files < <(git ls-files -- '*.cpp' '*.h')
else
  mapfile -t files < <(find . -path ./build -prune -o \( -name '*.cpp' -o -name '*.h' \) -print | grep -v '^./build')
fi
if [ $check = 0 ]; then
  "$cf" -i --style=file "${files[@]}"
  echo "format.sh: formatted ${#files[@]} files with $("$cf" --version)"
  exit 0
fi
bad=()
for f in "${files[@]}"; do
  "$cf" --style=file --dry-run -Werror "$f" >/dev/null 2>&1 || bad+=("$f")
done
if [ ${#bad[@]} -gt 0 ]; then
  echo "format.sh: ${#bad[@]} of ${#files[@]} files differ from .clang-format (run scripts/format.sh):" >&2
  printf '  %s\n' "${bad[@]}" >&2
  exit 1
fi
echo "format.sh: ${#files[@]} files formatted ($("$cf" --version))"
