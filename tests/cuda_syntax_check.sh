#!/usr/bin/env bash
# Syntax-only compile of keel's CUDA/NCCL code paths (KEEL_WITH_CUDA) against the CUDA and
# LibTorch headers on a machine without a GPU or a CUDA LibTorch. What this cannot check
# (linking, running) happens on a GPU machine: see docs/gpu.md.
#   tests/cuda_syntax_check.sh SOURCE_DIR BUILD_DIR
set -euo pipefail
src="$1"; build="$2"
cuda=/usr/local/cuda/include
if [ ! -f "$cuda/cuda_runtime_api.h" ] || [ ! -f "$cuda/nccl.h" ]; then
  echo "SKIP: no CUDA/NCCL headers under /usr/local/cuda; the CUDA syntax check needs them"
  exit 77
fi
stub="$build/cuda_stub"
mkdir -p "$stub/c10/cuda/impl"
# A header that CUDA builds of LibTorch generate; an empty stand-in suffices for parsing.
echo '#pragma once' > "$stub/c10/cuda/impl/cuda_cmake_macros.h"
flags=(-std=c++17 -fsyntax-only -DUSE_C10D_NCCL -DUSE_C10D_GLOO -DUSE_DISTRIBUTED -DKEEL_WITH_CUDA=1
       -DKEEL_WITH_MPI=1 -DOMPI_SKIP_MPICXX=1 -DTOML_HEADER_ONLY=1
       -I"$stub" -I"$src" -I"$build/generated" -I"$src/cmake/stubs" -I"$cuda"
       -isystem /usr/include/torch/csrc/api/include -isystem /usr/lib/x86_64-linux-gnu/openmpi/include)
files=(dist/process_group.cpp dist/collectives.cpp dist/ddp.cpp trainer/config.cpp)
pids=()
for f in "${files[@]}"; do
  g++ "${flags[@]}" "$src/$f" & pids+=($!)
done
status=0
for i in "${!files[@]}"; do
  if wait "${pids[$i]}"; then echo "ok   ${files[$i]} (KEEL_WITH_CUDA)"; else echo "FAIL ${files[$i]}"; status=1; fi
done
exit $status
