// trainer/app/export.h: `keel export STEP OUT`: a checkpoint step's model as one safetensors file
// (or shards with an index); with --hf, a step of a gpt2 or llama run (models/hf.h) as a
// directory transformers' `AutoModelForCausalLM.from_pretrained` loads.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <string>
#include <vector>

namespace keel {

/// Bytes of a size as transformers' max_shard_size writes it: a number and a unit, B, KB, MB,
/// GB (powers of 1000) or KiB, MiB, GiB (of 1024). Throws InputError naming --max-shard-size.
uint64_t parse_shard_size(const std::string& text);

/// --dtype: "float32" (what the checkpoint holds), "bfloat16" or "float16"; InputError naming
/// --dtype otherwise.
c10::ScalarType parse_export_dtype(const std::string& text);

/// Writes the step's model tensors as OUT/model.safetensors, or shards of at most
/// `max_shard_bytes` (whole tensors) with OUT/model.safetensors.index.json: one file PyTorch's
/// safetensors.torch.load_file reads, for any model, under keel's names. With `hf` (--hf), under
/// transformers' names with OUT/config.json (the model component's hf_config, its dtype
/// `dtype`'s), as
/// transformers' `AutoModelForCausalLM.from_pretrained` loads. The step must verify (every
/// checksum) and may come from any world size and dist.zero (its model files hold the whole
/// model; at dist.zero = 3 each rank wrote its own share). OUT must not exist or be an empty
/// directory; it appears whole or not at all (written beside it, then renamed). `dtype`: the
/// floating-point tensors are written in it (rounded to nearest; integer tensors keep theirs).
/// Returns the files
/// written. Throws InputError for a step that is not a committed step (with `hf`: of a gpt2 or
/// llama run), or an OUT that holds files; std::runtime_error for a step that does not verify or a
/// write that fails.
std::vector<std::string> export_model(const std::string& step_dir, const std::string& out_dir, uint64_t max_shard_bytes,
                                      bool hf, c10::ScalarType dtype = c10::ScalarType::Float);

}  // namespace keel
