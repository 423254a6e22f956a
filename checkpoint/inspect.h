// checkpoint/inspect.h: `keel inspect DIR`, a report on checkpoints for people and scripts.
//
// DIR is a checkpoint root (checkpoint.dir) or one step directory. For every step: whether it
// is committed, whether every file matches the size and SHA-256 in meta.json, its world size,
// and each tensor with its dtype, shape, size and file.
#pragma once

#include <nlohmann/json.hpp>

#include <string>

namespace keel::checkpoint {

/// The report as JSON: {"dir", "steps": [{"step", "path", "committed", "verified", "problems",
/// "world_size", "created_utc", "bytes", "tensors": [{"name", "dtype", "shape", "bytes", "file"}]}]}.
/// Throws std::runtime_error when DIR is neither a checkpoint root nor a step directory.
nlohmann::json inspect(const std::string& dir);

/// Human-readable rendering of inspect().
std::string format_inspect(const nlohmann::json& report);

}  // namespace keel::checkpoint
