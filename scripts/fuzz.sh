#!/usr/bin/env bash
# Fuzzes, with libFuzzer (clang from Debian: clang, libclang-rt-dev; scripts/setup.sh installs
# them), each of keel's parsers of checkpoint files for SECONDS seconds (default 60): the
# safetensors header (corpus tests/fuzz/corpus) and a step's meta.json and index
# (tests/fuzz/corpus_meta), growing each corpus with the new inputs it finds.
# Exit 0: no crash, leak or sanitizer report.
# Usage: scripts/fuzz.sh [SECONDS] [--no-merge]
set -euo pipefail
cd "$(dirname "$0")/.."
secs="${1:-60}"
merge=1
[ "${2:-}" = "--no-merge" ] && merge=0
command -v clang++ >/dev/null || { echo "fuzz: clang++ not found (apt-get install clang libclang-rt-dev)" >&2; exit 77; }
out=build/fuzz
mkdir -p "$out"
# target  sources  corpus
targets=(
  "fuzz_safetensors_header|tests/fuzz/fuzz_safetensors_header.cpp checkpoint/safetensors_header.cpp|tests/fuzz/corpus"
  "fuzz_checkpoint_meta|tests/fuzz/fuzz_checkpoint_meta.cpp checkpoint/meta.cpp|tests/fuzz/corpus_meta"
)
for t in "${targets[@]}"; do
  IFS='|' read -r name sources corpus <<< "$t"
  # shellcheck disable=SC2086
  clang++ -std=c++20 -O1 -g -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined -Iinclude -iquote . \
    $sources -o "$out/$name"
  work="$out/corpus-$name"
  rm -rf "$work" && mkdir -p "$work"
  cp "$corpus"/* "$work/"
  echo "== $name ($secs s)"
  "$out/$name" -max_total_time="$secs" -max_len=4096 -timeout=10 -print_final_stats=1 \
    -artifact_prefix="$out/$name-" "$work" 2>&1 | tail -n 15
  if [ "$merge" = 1 ]; then
    # Keep only inputs that add coverage (the committed corpus stays small).
    "$out/$name" -merge=1 "$corpus" "$work" 2>&1 | tail -n 2
  fi
done
