#!/usr/bin/env bash
# Every public header compiles on its own (-fsyntax-only, one translation unit per header).
#   tests/header_check.sh SOURCE_DIR BUILD_DIR
set -euo pipefail
src="$1"; build="$2"
export FLAGS="-std=c++17 -fsyntax-only -DUSE_C10D_GLOO -DUSE_DISTRIBUTED -DTOML_HEADER_ONLY=1 -I$src -I$build/generated -I$src/cmake/stubs -isystem /usr/include/torch/csrc/api/include -isystem /usr/lib/x86_64-linux-gnu/openmpi/include"
cd "$src"
check() {
  if out=$(printf '#include "%s"\n' "$1" | g++ $FLAGS -x c++ - 2>&1); then echo "ok   $1"; else echo "FAIL $1"; echo "$out" | head -10; return 1; fi
}
export -f check
ls trainer/*.h models/*.h dist/*.h amp/*.h checkpoint/*.h | xargs -P "$(nproc)" -I{} bash -c 'check {}'
