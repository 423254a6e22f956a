#!/usr/bin/env bash
# README command 1: set up the machine (scripts/setup.sh), build, and train the default
# experiment, configs/fashion_mnist_cnn.toml. Extra arguments are passed to `keel train`
# (e.g. --train.epochs=1). Results: runs/fashion_mnist_cnn/{summary.json,metrics.jsonl}.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec build/keel train --config configs/fashion_mnist_cnn.toml "$@"
