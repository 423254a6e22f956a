// checkpoint/meta.h: a step's meta.json and its Hugging Face index, parsed and checked.
//
// Owns: every check of the two JSON files a load trusts before it reads a tensor: the format
// and its version, each integer's type and range (a world size sizes the loader's loops), the
// step against its directory's name, file entries that stay inside the step directory; the
// index's weight_map against the shards of the saved world and the tensors they hold. Failures
// are FormatError naming the file and the field. No LibTorch here, so that libFuzzer drives
// these functions alone (tests/fuzz/fuzz_checkpoint_meta.cpp).
// Does not own: reading the files or checking their checksums (checkpoint/checkpoint.cpp).
#pragma once

#include <nlohmann/json.hpp>

#include <map>
#include <set>
#include <string>

#include "checkpoint/safetensors_header.h"

namespace keel::checkpoint {

/// A file name that stays inside its directory (no '/', not "." or "..", no NUL).
bool plain_name(const std::string& name);

/// meta.json's text, checked: format "keel-checkpoint" version 1; "step" an integer >= 0 that
/// equals N when `dir_name` is "step_<N>"; "world_size" in [1, min(2^18, files / 2)]; "files"
/// an object of plain names, each with a string "sha256" and an unsigned "bytes"; "optimizer",
/// when present, an object with "zero" in [0, 3] and "owners" mapping names to ranks < world. `path` names
/// the file in messages. Throws FormatError.
nlohmann::json parse_meta(const std::string& text, const std::string& path, const std::string& dir_name);

/// optimizer.safetensors.index.json's text, checked: a "weight_map" object whose every value
/// is one of `shard_names` (the step's optimizer files). Returns the map. Throws FormatError.
std::map<std::string, std::string> parse_optimizer_index(const std::string& text, const std::string& path,
                                                         const std::set<std::string>& shard_names);

/// The index's text, checked: a "weight_map" object whose every value is one of `shard_names`
/// (a plain name) and whose keys are exactly `model_tensors`. Throws FormatError.
void check_index(const std::string& text, const std::string& path, const std::set<std::string>& shard_names,
                 const std::set<std::string>& model_tensors);

}  // namespace keel::checkpoint
