#!/usr/bin/env bash
# Prepares what scripts/gpu_check.sh needs on a GPU machine that has LibTorch (torch 2.11 in its
# Python), CUDA, cmake and ninja but no network and none of keel's other build dependencies:
# Debian's -dev packages keel builds with, downloaded here and unpacked (dpkg -x) into
# .gpu_deps/ (git-ignored; ~25 MB), which travels with the working tree.
#   scripts/gpu_deps.sh            # writes .gpu_deps/root/usr/... and .gpu_deps/logroot/usr/...
# spdlog and Debian's fmt go to logroot/ apart from the rest: an include folder that holds fmt 9
# must never be on the path of keel's own sources, which use LibTorch's fmt 12 (common/log.h).
set -euo pipefail
cd "$(dirname "$0")/.."
out=.gpu_deps
pkgs=(libcli11-dev libtomlplusplus-dev nlohmann-json3-dev libgloo-dev libssl-dev libssl3 zlib1g-dev zlib1g)
logpkgs=(libspdlog-dev libspdlog1.10 libfmt-dev libfmt9)
rm -rf "$out"; mkdir -p "$out/debs" "$out/logdebs" "$out/root" "$out/logroot"
(cd "$out/debs" && apt-get download "${pkgs[@]}" 2>/dev/null)
(cd "$out/logdebs" && apt-get download "${logpkgs[@]}" 2>/dev/null)
for f in "$out"/debs/*.deb; do dpkg -x "$f" "$out/root"; done
for f in "$out"/logdebs/*.deb; do dpkg -x "$f" "$out/logroot"; done
rm -rf "$out/debs" "$out/logdebs" "$out"/*/usr/share/doc "$out"/*/usr/share/man
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
