#!/usr/bin/env bash
# No function in keel's sources is longer than 100 lines (issue 26; the Python sources too,
# issue 51).
# C++ (.cpp/.h): a definition that opens at column 0 (a function, a TEST body) or at column 2 (a
# member defined in its class, not a statement inside a function) runs to the closing brace at
# the same column; clang-format's layout (scripts/format.sh) makes that hold.
# Python (.py): python3's ast module gives every function and method, nested ones and async ones
# included, its lines from the `def` line (decorators not counted) to its last line.
# Usage: tests/function_length_check.sh [SOURCE_DIR] [LIMIT]
set -euo pipefail
cd "${1:-$(dirname "$0")/..}"
limit="${2:-100}"
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  mapfile -t files < <(git ls-files -- '*.cpp' '*.h')
  mapfile -t pyfiles < <(git ls-files -- '*.py')
else
  mapfile -t files < <(find . -path ./build -prune -o \( -name '*.cpp' -o -name '*.h' \) -print | grep -v '^./build')
  mapfile -t pyfiles < <(find . -path ./build -prune -o -name '*.py' -print | grep -v '^./build')
fi
long=$(awk -v limit="$limit" '
  FNR == 1 { top = 0; member = 0 }
  /^[A-Za-z].*\) *(const|override|noexcept| )*\{$/ { top = FNR; head = $0 }
  top && /^}/ { if (FNR - top + 1 > limit) printf "%s:%d: %d lines: %s\n", FILENAME, top, FNR - top + 1, head; top = 0 }
  !top && /^  [A-Za-z].*\) *(const|override|noexcept| )*\{$/ { member = FNR; mhead = $0 }
  member && /^  }$/ { if (FNR - member + 1 > limit) printf "%s:%d: %d lines: %s\n", FILENAME, member, FNR - member + 1, mhead; member = 0 }
' "${files[@]}")
# A file that does not parse stops the check (python3 says where, exit 1).
long_py=$(python3 - "$limit" ${pyfiles[@]+"${pyfiles[@]}"} <<'PY'
import ast, sys
limit, bad = int(sys.argv[1]), False
for path in sys.argv[2:]:
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
    except (OSError, SyntaxError, ValueError) as e:
        print(f"function_length_check.sh: {path}: cannot read it as Python: {e}", file=sys.stderr)
        bad = True
        continue
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            n = node.end_lineno - node.lineno + 1
            if n > limit:
                kind = "async def" if isinstance(node, ast.AsyncFunctionDef) else "def"
                print(f"{path}:{node.lineno}: {n} lines: {kind} {node.name}(...)")
sys.exit(1 if bad else 0)
PY
)
long=$(printf '%s\n%s\n' "$long" "$long_py" | sed '/^$/d')
if [ -n "$long" ]; then
  echo "functions over $limit lines (split them into named steps):"
  echo "$long"
  exit 1
fi
echo "no function over $limit lines in ${#files[@]} C++ and ${#pyfiles[@]} Python files"
