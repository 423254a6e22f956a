// checkpoint/meta.h: a step's meta.json and its Hugging Face index, parsed and checked.
//
// Owns: every check of the two JSON files a load trusts before it reads a tensor: the format
// and its version, each integer's type and range (a world size sizes the loader's loops), the
// step against its directory's name, file entries that stay inside the step directory, the
// form of each component's record; an index's weight_map against the shards of the saved world. Failures
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

/// "" when `name` can name a component ([a-z0-9_], 1 to 64 characters), else why not.
std::string component_name_problem(const std::string& name);

/// meta.json's text, checked: format "keel-checkpoint" version 1 or 2; "step" an integer >= 0
/// that equals N when `dir_name` is "step_<N>"; "world_size" in [1, min(2^18, files)] (each
/// rank wrote at least its rank file); "files" an object of plain names, each with a string
/// "sha256" and an unsigned "bytes". Version 2: "components" an object of component names
/// ([a-z0-9_]{1,64}), each an object whose "values" (if any) is an object, "tensors" (if any)
/// maps names to {"dtype": string, "shape": [integers >= 0]}, "owned" (if any) lists names of
/// "tensors", and "files" (if any) lists plain names that "files" lists. Version 1: "state",
/// when present, is an object. `path` names the file in messages. Throws FormatError.
nlohmann::json parse_meta(const std::string& text, const std::string& path, const std::string& dir_name);

/// A <component>.safetensors.index.json's text, checked: a "weight_map" object whose every
/// value is one of `shard_names` (the component's files in the step). Returns the map. Throws
/// FormatError.
std::map<std::string, std::string> parse_index(const std::string& text, const std::string& path,
                                               const std::set<std::string>& shard_names);

}  // namespace keel::checkpoint
