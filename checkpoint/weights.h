// checkpoint/weights.h: load_weights (keel/checkpoint/checkpoint.h) with the file's tensor names
// mapped first, for files written under other names (the Hugging Face families: models/hf.h).
#pragma once

#include <functional>
#include <map>
#include <optional>
#include <string>
#include <utility>

#include "keel/checkpoint/checkpoint.h"
#include "models/deferred_init.h"

namespace keel::checkpoint {

/// The model's name of a file's tensor; nullopt = the tensor is not wanted (skipped).
using TensorRename = std::function<std::optional<std::string>(const std::string&)>;

/// The tensors at `path` (a .safetensors file, an index, or a directory holding either), each
/// with the file it came from, their names passed through `rename` (may be empty). Throws
/// InputError starting with `what` (the key or command reading them) for anything unreadable.
std::map<std::string, std::pair<torch::Tensor, std::string>> read_weights(const std::string& path,
                                                                          const TensorRename& rename,
                                                                          const std::string& what);

/// load_weights, each file's tensor names passed through `rename` (may be empty: the names as
/// they are) before they are matched, as strictly, against the model's. A parameter that
/// `deferred` holds (sharded initialisation, models/deferred_init.h) is not loaded: it comes
/// from the file's tensor (a view of its mapping) when its part is made, so a rank reads only
/// the bytes of its slices.
int64_t load_weights(models::Model& model, const std::string& path, const TensorRename& rename,
                     models::DeferredInit* deferred = nullptr);

}  // namespace keel::checkpoint
