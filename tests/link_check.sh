#!/usr/bin/env bash
# A CUDA build of keel resolves libtorch_cuda.so and libnccl.so.2 (the NCCL of torch's
# nvidia-nccl wheel, through libtorch_cuda's RUNPATH), and no second Gloo library; every build
# names libstdc++ before libtorch (cmake/KeelDeps.cmake says why).
#   tests/link_check.sh BINARY CUDA_BUILD(0|1)
set -euo pipefail
bin="$1"; cuda="$2"
status=0
needed=$(readelf -d "$bin" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p')
first_std=$(printf '%s\n' "$needed" | grep -n '^libstdc++' | head -1 | cut -d: -f1)
first_torch=$(printf '%s\n' "$needed" | grep -n '^libtorch' | head -1 | cut -d: -f1)
if [ -n "$first_std" ] && [ -n "$first_torch" ] && [ "$first_std" -lt "$first_torch" ]; then
  echo "ok   libstdc++ (NEEDED #$first_std) before libtorch (#$first_torch)"
else
  echo "FAIL libstdc++ must precede libtorch in $bin's NEEDED list:"; printf '%s\n' "$needed" | head -6; status=1
fi
if [ "$cuda" != 1 ]; then echo "SKIP the CUDA part: a CPU build of keel (its LibTorch has no CUDA)"; exit $(( status ? 1 : 77 )); fi
libs=$(ldd "$bin")
for lib in libtorch_cuda.so libnccl.so.2 libtorch_cpu.so libc10_cuda.so; do
  line=$(printf '%s\n' "$libs" | grep -F "$lib" | head -1 || true)
  if [ -z "$line" ]; then echo "FAIL $lib: not among the libraries $bin loads"; status=1
  elif printf '%s' "$line" | grep -q "not found"; then echo "FAIL $line"; status=1
  else echo "ok   $line"; fi
done
# The NCCL must be the one torch pins (nvidia-nccl wheel), not a system copy.
nccl=$(printf '%s\n' "$libs" | awk '/libnccl.so.2/ {print $3}')
case "$nccl" in */nvidia/nccl/lib/*|*/nvidia/cu*/lib/*) echo "ok   NCCL from torch's wheel: $nccl";;
  *) echo "note: NCCL resolved outside the nvidia wheel: $nccl";; esac
if printf '%s\n' "$libs" | grep -q libgloo; then echo "FAIL a second Gloo library is linked:"; printf '%s\n' "$libs" | grep libgloo; status=1; fi
exit $status
