#!/usr/bin/env bash
# README command 1: set up the machine (scripts/setup.sh), build, and train the default
# experiment, configs/fashion_mnist_cnn.toml, on 2 ranks launched by torchrun (KEEL_RANKS=N
# for another count; KEEL_RANKS=1 runs a single process). Extra arguments go to `keel train`
# (e.g. --train.epochs=1). Results: runs/fashion_mnist_cnn/{summary.json,metrics.jsonl}.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh keel
ranks="${KEEL_RANKS:-2}"
config=configs/fashion_mnist_cnn.toml
if [ "$ranks" = 1 ]; then
  exec build/keel train --config "$config" "$@"
fi
# Debian's torchrun (python3-torch 1.13 on Python 3.11) needs --redirects/--tee/--log_dir.
exec torchrun --standalone --nproc_per_node "$ranks" --no_python \
  --redirects 1 --tee 1 --log_dir runs/torchrun_logs \
  build/keel train --config "$config" "$@"
