#!/usr/bin/env bash
# Sets up a Debian 12 machine for keel and builds it. Idempotent: installs only what is missing.
#  1. Debian packages (build tools, Gloo headers, MPI, CLI11, spdlog, toml++, ...).
#  2. LibTorch: PyTorch 2.11.0's, from PyPI's torch wheel (and tensorboard and safetensors,
#     the real clients the tests read keel's outputs with), pip-installed into a virtual
#     environment OUTSIDE the clone, ${KEEL_VENV:-$HOME/.cache/keel/venv}, shared by every clone
#     and CI run on the machine (a second clone does not download torch again). Its bin/python
#     and bin/torchrun are the PyTorch reference of tests, golden files and benchmarks.
#     A user with a LibTorch of their own sets Torch_DIR (its share/cmake/Torch folder): the
#     pip step is skipped (tests that need Python then want KEEL_PYTHON=<python with torch>).
#  3. Configures (CMake, C++20; a CUDA build when the LibTorch has CUDA) and builds into build/.
#
#   scripts/setup.sh            # as root, or as a user with sudo; builds everything
#   scripts/setup.sh keel       # builds only the given targets (scripts/train.sh does this)
#   KEEL_BUILD_DIR=out scripts/setup.sh
#
# Environment: KEEL_BUILD_DIR (default build), KEEL_BUILD_TYPE (default Release), KEEL_VENV,
# Torch_DIR, KEEL_PYTHON, KEEL_SKIP_APT=1 to skip the package step (packages from elsewhere).
set -euo pipefail
cd "$(dirname "$0")/.."

BUILD_DIR="${KEEL_BUILD_DIR:-build}"
BUILD_TYPE="${KEEL_BUILD_TYPE:-Release}"

# Everything keel builds, tests and benchmarks with (see ../shared/notes/environment.md).
PACKAGES=(
  g++ cmake ninja-build ccache pkg-config
  libgloo-dev
  libopenmpi-dev openmpi-bin
  libcli11-dev libspdlog-dev libfmt-dev libtomlplusplus-dev nlohmann-json3-dev
  libssl-dev zlib1g-dev libgtest-dev
  dataset-fashion-mnist
  python3-venv
  gnuplot-nox
  clang libclang-rt-dev
  libprotobuf-dev protobuf-compiler libboost-dev
  iproute2
  slurmd slurmctld slurm-client munge
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
fi

TORCH_VERSION_WANTED=2.11.0
cmake_torch=()
if [ -n "${Torch_DIR:-}" ]; then
  log "using the LibTorch at Torch_DIR=$Torch_DIR (no pip step)"
  cmake_torch=(-DTorch_DIR="$Torch_DIR")
  [ -n "${KEEL_PYTHON:-}" ] && cmake_torch+=(-DKEEL_PYTHON="$KEEL_PYTHON")
else
  venv="${KEEL_VENV:-$HOME/.cache/keel/venv}"
  py="$venv/bin/python"
  mkdir -p "$(dirname "$venv")"
  # One installer at a time per venv (two clones set up at once share it).
  exec 9>"$venv.lock"
  flock 9
  if ! "$py" -c "import torch, numpy, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION_WANTED')" 2>/dev/null; then
    log "installing torch==$TORCH_VERSION_WANTED (PyPI wheel, CUDA 13.0 build, ~4.5 GB) into $venv"
    [ -x "$py" ] || python3 -m venv "$venv"
    "$py" -m pip install -q --disable-pip-version-check "torch==$TORCH_VERSION_WANTED" numpy >&2
  else
    log "torch $TORCH_VERSION_WANTED present in $venv"
  fi
  # The real clients the tests read keel's outputs with: TensorBoard's event reader and the
  # safetensors library.
  if ! "$py" -c "import tensorboard, safetensors" 2>/dev/null; then
    log "installing tensorboard and safetensors (PyPI) into $venv"
    "$py" -m pip install -q --disable-pip-version-check tensorboard safetensors >&2
  fi
  # `keel tokenize` (trainer/data/tokenize.py): Hugging Face's tokenizers, pinned.
  if ! "$py" -c "import tokenizers, sys; sys.exit(tokenizers.__version__ != '0.23.3')" 2>/dev/null; then
    log "installing tokenizers 0.23.3 (PyPI) into $venv"
    "$py" -m pip install -q --disable-pip-version-check tokenizers==0.23.3 >&2
  fi
  # The gpt2 and llama families' other side (tests/hf_roundtrip.py): transformers, pinned.
  if ! "$py" -c "import transformers, sys; sys.exit(transformers.__version__ != '5.24.0')" 2>/dev/null; then
    log "installing transformers 5.24.0 (PyPI) into $venv"
    "$py" -m pip install -q --disable-pip-version-check transformers==5.24.0 tokenizers==0.23.3 >&2
  fi
  # The formatter the tree is checked with (scripts/format.sh): one pinned version, whatever the
  # distribution ships.
  if ! "$venv/bin/clang-format" --version 2>/dev/null | grep -q "version 14\."; then
    log "installing clang-format 14.0.6 (PyPI) into $venv"
    "$py" -m pip install -q --disable-pip-version-check clang-format==14.0.6 >&2 ||
      log "clang-format 14.0.6 could not be installed: the format check needs clang-format 14 on PATH"
  fi
  flock -u 9
  prefix=$("$py" -c 'import torch; print(torch.utils.cmake_prefix_path)')
  cmake_torch=(-DTorch_DIR="$prefix/Torch" -DKEEL_PYTHON="$py")
fi

launcher=()
if command -v ccache >/dev/null; then
  launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
  # Paths relative to the tree in ccache's keys: other clones and build folders (the build half
  # of scripts/gpu_check.sh in ctest) reuse the objects.
  export CCACHE_BASEDIR="$PWD"
fi
generator=()
command -v ninja >/dev/null && [ ! -f "$BUILD_DIR/CMakeCache.txt" ] && generator=(-G Ninja)
log "configuring $BUILD_DIR ($BUILD_TYPE)"
cmake -S . -B "$BUILD_DIR" "${generator[@]}" -DCMAKE_BUILD_TYPE="$BUILD_TYPE" "${launcher[@]}" "${cmake_torch[@]}" >&2
log "building (this takes a few minutes the first time: LibTorch headers are heavy)"
targets=()
for t in "$@"; do targets+=(--target "$t"); done
cmake --build "$BUILD_DIR" -j "$(nproc)" "${targets[@]}" >&2
log "built $BUILD_DIR/keel"
