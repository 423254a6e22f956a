#!/usr/bin/env bash
# No function in keel's sources is longer than 100 lines (issue 26): a definition that opens at
# column 0 (a function, a TEST body) or at column 2 (a member defined in its class, not a
# statement inside a function) runs to the closing brace at the same column; clang-format's
# layout (scripts/format.sh) makes that hold.
# Usage: tests/function_length_check.sh [SOURCE_DIR] [LIMIT]
set -euo pipefail
cd "${1:-$(dirname "$0")/..}"
limit="${2:-100}"
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  mapfile -t files < <(git ls-files -- '*.cpp' '*.h')
else
  mapfile -t files < <(find . -path ./build -prune -o \( -name '*.cpp' -o -name '*.h' \) -print | grep -v '^./build')
fi
long=$(awk -v limit="$limit" '
  FNR == 1 { top = 0; member = 0 }
  /^[A-Za-z].*\) *(const|override|noexcept| )*\{$/ { top = FNR; head = $0 }
  top && /^}/ { if (FNR - top + 1 > limit) printf "%s:%d: %d lines: %s\n", FILENAME, top, FNR - top + 1, head; top = 0 }
  !top && /^  [A-Za-z].*\) *(const|override|noexcept| )*\{$/ { member = FNR; mhead = $0 }
  member && /^  }$/ { if (FNR - member + 1 > limit) printf "%s:%d: %d lines: %s\n", FILENAME, member, FNR - member + 1, mhead; member = 0 }
' "${files[@]}")
if [ -n "$long" ]; then
  echo "functions over $limit lines (split them into named steps):"
  echo "$long"
  exit 1
fi
echo "no function over $limit lines in ${#files[@]} files"
