#!/usr/bin/env bash
# Issue 65: the compile stage compiles the very model keel trains, never a second one. Nothing
# under trainer/ may build or name a Python twin of a model: the PyTorch references of
# tests/golden/reference_models.py or transformers' model classes (they stay test references:
# the golden tests, the Hugging Face interop tests, bench/torch_ref.py).
#   tests/twin_check.sh [ROOT]
set -euo pipefail
root=${1:-.}
if grep -rnE 'reference_models|GPT2LMHeadModel|LlamaForCausalLM|GPT2Block|LlamaDecoderLayer|(from|import) transformers' \
  "$root/trainer"; then
  echo "twin_check: the lines above build or name a Python twin of a model under trainer/ (issue 65)" >&2
  exit 1
fi
echo "ok: no Python twin of a model under trainer/"
