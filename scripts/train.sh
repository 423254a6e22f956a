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
# torchrun of the venv that holds keel's LibTorch (scripts/setup.sh), unless Torch_DIR chose
# another LibTorch: then the torchrun on PATH.
torchrun="${KEEL_VENV:-$HOME/.cache/keel/venv}/bin/torchrun"
[ -z "${Torch_DIR:-}" ] && [ -x "$torchrun" ] || torchrun=torchrun
exec "$torchrun" --standalone --nproc_per_node "$ranks" --no_python build/keel train --config "$config" "$@"
