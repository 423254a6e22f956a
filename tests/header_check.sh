#!/usr/bin/env bash
# Every header of keel compiles on its own (-fsyntax-only, one translation unit per header), with
# the flags keel's own sources are compiled with (taken from BUILD_DIR/compile_commands.json).
#   tests/header_check.sh SOURCE_DIR BUILD_DIR
set -euo pipefail
src="$1"; build="$2"
db="$build/compile_commands.json"
[ -f "$db" ] || { echo "FAIL: $db missing (configure with CMAKE_EXPORT_COMPILE_COMMANDS=ON)"; exit 1; }
# The command of one of keel's own sources, less its output, input and dependency-file arguments.
FLAGS=$(python3 - "$db" "$src/dist/ddp.cpp" <<'PY'
import json, shlex, sys
db, want = sys.argv[1], sys.argv[2]
for e in json.load(open(db)):
    if e["file"] == want:
        args = shlex.split(e["command"])[1:]
        out, skip = [], False
        for a in args:
            if skip: skip = False; continue
            if a in ("-o", "-c", "-MF", "-MT", "-MQ"): skip = True; continue
            if a in ("-MD", "-MMD") or a == want or a.endswith("ccache") or a.endswith("c++") or a.endswith("g++"): continue
            out.append(a)
        print(shlex.join(out)); break
else:
    sys.exit("no compile command for " + want)
PY
)
export FLAGS="$FLAGS -fsyntax-only"
cd "$src"
check() {
  if out=$(printf '#include "%s"\n' "$1" | eval g++ $FLAGS -x c++ - 2>&1); then echo "ok   $1"; else echo "FAIL $1"; echo "$out" | head -10; return 1; fi
}
export -f check
# The public headers as "keel/...", the private ones from the root.
{ (cd include && find keel -name '*.h'); find common trainer models dist amp checkpoint -name '*.h'; } | sort |
  xargs -P "$(nproc)" -I{} bash -c 'check {}'
