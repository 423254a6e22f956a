#!/usr/bin/env bash
# Prepares what scripts/gpu_check.sh needs on a GPU machine that has LibTorch (torch 2.11 in its
# Python), CUDA, cmake and ninja but no network and none of keel's other build dependencies:
# Debian's -dev packages keel builds with, downloaded here and unpacked (dpkg -x) into
# .gpu_deps/ (git-ignored; ~24 MB), which travels with the working tree.
#   scripts/gpu_deps.sh [DIR]      # writes DIR/root/usr/... and DIR/logroot/usr/... (DIR: .gpu_deps)
# Exit 77 when apt cannot download (no network, no apt): nothing to check then.
# spdlog and Debian's fmt go to logroot/ apart from the rest: an include folder that holds fmt 9
# must never be on the path of keel's own sources, which use LibTorch's fmt 12 (common/log.h).
# Protobuf (the TensorBoard event messages: headers, the lite runtime, protoc) comes whole; of
# Boost (header-only Boost.CRC) only the headers boost/crc.hpp includes, with boost/config/ and
# boost/type_traits/ whole (other compilers take other branches there) and Boost's CMake package
# files: the whole of Boost's headers (~160 MB) would not fit the 64 MiB a device call carries.
set -euo pipefail
out=$(realpath -m "${1:-$(dirname "$0")/../.gpu_deps}")
cd "$(dirname "$0")/.."
pkgs=(libcli11-dev libtomlplusplus-dev nlohmann-json3-dev libgloo-dev libssl-dev libssl3 zlib1g-dev zlib1g
      libprotobuf-dev libprotobuf32 libprotobuf-lite32 libprotoc32 protobuf-compiler)
logpkgs=(libspdlog-dev libspdlog1.10 libfmt-dev libfmt9)
boostpkg=libboost1.74-dev
if [ -n "$(ls -A "$out" 2>/dev/null)" ] && [ ! -d "$out/root" ]; then
  echo "gpu_deps: $out holds files and is no gpu_deps folder: not replaced"; exit 2
fi
rm -rf "$out"; mkdir -p "$out/debs" "$out/logdebs" "$out/boostdeb" "$out/root" "$out/logroot"
fetch() {  # fetch DIR PACKAGE...
  local d=$1; shift
  (cd "$d" && apt-get download "$@" 2>/dev/null) || { echo "gpu_deps: apt-get download $* failed (no network or no apt?)"; exit 77; }
}
fetch "$out/debs" "${pkgs[@]}"
fetch "$out/logdebs" "${logpkgs[@]}"
fetch "$out/boostdeb" "$boostpkg"
for f in "$out"/debs/*.deb; do dpkg -x "$f" "$out/root"; done
for f in "$out"/logdebs/*.deb; do dpkg -x "$f" "$out/logroot"; done
boost="$out/boostdeb/x"
dpkg -x "$out"/boostdeb/*.deb "$boost"
printf '#include <boost/crc.hpp>\n#include <boost/version.hpp>\n' |
  "${CXX:-g++}" -std=c++20 -M -I"$boost/usr/include" -x c++ - | tr ' \\' '\n\n' | grep "^$boost/usr/include/boost/" |
  sort -u | while read -r h; do
    rel=${h#"$boost/"}; mkdir -p "$out/root/$(dirname "$rel")"; cp "$h" "$out/root/$rel"
  done
cp -r "$boost/usr/include/boost/config" "$boost/usr/include/boost/type_traits" "$out/root/usr/include/boost/"
mkdir -p "$out/root/usr/lib/x86_64-linux-gnu/cmake"
cp -r "$boost"/usr/lib/x86_64-linux-gnu/cmake/Boost-* "$boost"/usr/lib/x86_64-linux-gnu/cmake/boost_headers-* \
  "$out/root/usr/lib/x86_64-linux-gnu/cmake/"
[ -f "$out/root/usr/include/boost/crc.hpp" ] || { echo "gpu_deps: boost/crc.hpp not copied"; exit 1; }
rm -rf "$out/debs" "$out/logdebs" "$out/boostdeb" "$out"/*/usr/share/doc "$out"/*/usr/share/man
# Static archives keel never links (libgloo.a is most of the size).
find "$out" -name '*.a' -delete
# Absolute symlinks (e.g. libz.so -> /lib/x86_64-linux-gnu/libz.so.1.2.13) would point outside
# the folder on the GPU machine: make them relative.
for r in root logroot; do
  find "$out/$r" -type l | while read -r l; do
    t=$(readlink "$l")
    case "$t" in /*) ln -sfn "$(realpath -m --relative-to="$(dirname "$l")" "$out/$r$t")" "$l";; esac
  done
done
du -sh "$out"
