#!/usr/bin/env bash
# Sets up a Debian 12 machine for keel and builds it. Idempotent: installs only the packages
# that are missing, makes sure LibTorch uses OpenBLAS, then configures and builds into build/.
#
#   scripts/setup.sh            # as root, or as a user with sudo; builds everything
#   scripts/setup.sh keel       # builds only the given targets (scripts/train.sh does this)
#   KEEL_BUILD_DIR=out scripts/setup.sh
#
# Environment: KEEL_BUILD_DIR (default build), KEEL_BUILD_TYPE (default Release),
# KEEL_SKIP_APT=1 to skip the package step (e.g. when packages come from elsewhere).
set -euo pipefail
cd "$(dirname "$0")/.."

BUILD_DIR="${KEEL_BUILD_DIR:-build}"
BUILD_TYPE="${KEEL_BUILD_TYPE:-Release}"

# Everything keel builds, tests and benchmarks with (see ../shared/notes/environment.md).
PACKAGES=(
  g++ cmake ninja-build ccache pkg-config
  libtorch-dev libgloo-dev libopenblas0-openmp
  libopenmpi-dev openmpi-bin
  libcli11-dev libspdlog-dev libfmt-dev libtomlplusplus-dev nlohmann-json3-dev
  libssl-dev zlib1g-dev libgtest-dev
  dataset-fashion-mnist
  python3-torch python3-numpy
  gnuplot-nox
  clang libclang-rt-dev
)

log() { printf '[setup] %s\n' "$*" >&2; }

as_root() {
  if [ "$(id -u)" -eq 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else
    log "need root (or sudo) to run: $*"; exit 1; fi
}

if [ "${KEEL_SKIP_APT:-0}" != 1 ]; then
  missing=()
  for p in "${PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    log "installing ${#missing[@]} missing packages: ${missing[*]}"
    as_root apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
  else
    log "all ${#PACKAGES[@]} packages present"
  fi
  # LibTorch links the generic libblas.so.3; without OpenBLAS selected it gets the reference
  # BLAS and matmul is ~7x slower. Installing libopenblas0-openmp normally selects it.
  alt=libblas.so.3-x86_64-linux-gnu
  openblas=/usr/lib/x86_64-linux-gnu/openblas-openmp/libblas.so.3
  if [ -e "$openblas" ] && [ "$(readlink -f /etc/alternatives/$alt 2>/dev/null)" != "$(readlink -f $openblas)" ]; then
    log "selecting OpenBLAS for $alt"
    as_root update-alternatives --set "$alt" "$openblas" >&2
  fi
fi

launcher=()
command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
generator=()
command -v ninja >/dev/null && [ ! -f "$BUILD_DIR/CMakeCache.txt" ] && generator=(-G Ninja)
log "configuring $BUILD_DIR ($BUILD_TYPE)"
cmake -S . -B "$BUILD_DIR" "${generator[@]}" -DCMAKE_BUILD_TYPE="$BUILD_TYPE" "${launcher[@]}" >&2
log "building (this takes a few minutes the first time: LibTorch headers are heavy)"
targets=()
for t in "$@"; do targets+=(--target "$t"); done
cmake --build "$BUILD_DIR" -j "$(nproc)" "${targets[@]}" >&2
log "built $BUILD_DIR/keel"
