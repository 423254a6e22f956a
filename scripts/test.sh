#!/usr/bin/env bash
# README command 2: set up the machine (scripts/setup.sh), build, and run every test with
# ctest. .ci/run calls this. Extra arguments are passed to ctest (e.g. -R Config).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
cd "${KEEL_BUILD_DIR:-build}"
exec ctest --output-on-failure -j "$(nproc)" "$@"
