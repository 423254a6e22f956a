// checkpoint/weights.h: a model's weights from safetensors files written by anyone
// (model.init_from): PyTorch's `safetensors.torch.save_file`, a Hugging Face sharded export
// (model.safetensors.index.json), or a keel checkpoint step (which has that index).
//
// Owns: finding the files (a .safetensors file, an index file, or a directory holding the
// index or a single model.safetensors), and the strict match of names and shapes against the
// model, as torch.nn.Module.load_state_dict(strict=True): every parameter and buffer must be
// there with its shape; a tensor the model lacks is an error too. Floating dtypes convert (as
// load_state_dict's copy does).
// Does not own: resuming a run (checkpoint/checkpoint.h restores the optimizer, data position
// and RNG as well).
#pragma once

#include <string>

#include "keel/models/model.h"

namespace keel::checkpoint {

/// Copies the weights at `path` into `model`'s parameters and buffers (on their device).
/// Returns the number of tensors loaded. Throws InputError naming the file and the tensor
/// for anything that does not match or cannot be read.
int64_t load_weights(models::Model& model, const std::string& path);

}  // namespace keel::checkpoint
