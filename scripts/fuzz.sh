#!/usr/bin/env bash
# Fuzzes the safetensors header parser with libFuzzer (clang from Debian: clang,
# libclang-rt-dev; scripts/setup.sh installs them) for SECONDS seconds (default 60), growing
# tests/fuzz/corpus with the new inputs it finds. Exit 0: no crash, leak or sanitizer report.
# Usage: scripts/fuzz.sh [SECONDS] [--no-merge]
set -euo pipefail
cd "$(dirname "$0")/.."
secs="${1:-60}"
merge=1
[ "${2:-}" = "--no-merge" ] && merge=0
command -v clang++ >/dev/null || { echo "fuzz: clang++ not found (apt-get install clang libclang-rt-dev)" >&2; exit 77; }
out=build/fuzz
mkdir -p "$out"
clang++ -std=c++17 -O1 -g -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined -I. \
  tests/fuzz/fuzz_safetensors_header.cpp checkpoint/safetensors_header.cpp -o "$out/fuzz_safetensors_header"
work="$out/corpus"
rm -rf "$work" && mkdir -p "$work"
cp tests/fuzz/corpus/* "$work/"
"$out/fuzz_safetensors_header" -max_total_time="$secs" -max_len=4096 -timeout=10 -print_final_stats=1 \
  -artifact_prefix="$out/" "$work" 2>&1 | tail -n 15
if [ "$merge" = 1 ]; then
  # Keep only inputs that add coverage (the committed corpus stays small).
  "$out/fuzz_safetensors_header" -merge=1 tests/fuzz/corpus "$work" 2>&1 | tail -n 2
fi
