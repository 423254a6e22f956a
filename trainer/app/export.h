// trainer/app/export.h: `keel export --hf STEP OUT`: a checkpoint step of a gpt2 or llama run
// (models/hf.h) as a directory transformers' `AutoModelForCausalLM.from_pretrained` loads.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace keel {

/// Bytes of a size as transformers' max_shard_size writes it: a number and a unit, B, KB, MB,
/// GB (powers of 1000) or KiB, MiB, GiB (of 1024). Throws InputError naming --max-shard-size.
uint64_t parse_shard_size(const std::string& text);

/// Writes OUT/config.json (the model component's hf_config, dtype float32) and the step's model
/// tensors under transformers' names: OUT/model.safetensors, or shards of at most
/// `max_shard_bytes` (whole tensors) with OUT/model.safetensors.index.json. The step must
/// verify (every checksum) and may come from any world size and dist.zero (its model files hold
/// the whole model). OUT must not exist or be an empty directory; it appears whole or not at
/// all (written beside it, then renamed). Returns the files written. Throws InputError for a
/// step that is not a committed step of a gpt2 or llama run, or an OUT that holds files;
/// std::runtime_error for a step that does not verify or a write that fails.
std::vector<std::string> export_hf(const std::string& step_dir, const std::string& out_dir, uint64_t max_shard_bytes);

}  // namespace keel
