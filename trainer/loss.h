// trainer/loss.h: the registry of losses (train.loss): cross_entropy built in, users' by
// register_loss (keel/trainer/trainer.h); keel's cross-entropy with train.ignore_index, and the
// check of a batch's targets against the classes.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <string>

#include "common/registry.h"
#include "keel/trainer/trainer.h"

namespace keel {

/// The registry train.loss names from (its cross_entropy ignores PyTorch's -100).
Registry<LossFn>& losses();

/// keel's cross-entropy over the last dimension: logits (..., C), target (...) int64. The mean over
/// the targets that are not `ignore_index`: PyTorch's cross_entropy(ignore_index) bit for bit
/// wherever one is left (its sum over them divided by their count, as its mean is), and 0 with a
/// zero gradient for a batch with none (where PyTorch gives NaN). Under tensor parallelism
/// dist/tp_ops.h's vocabulary-parallel loss does the same over the tp ranks' columns.
torch::Tensor cross_entropy(const torch::Tensor& logits, const torch::Tensor& target, int64_t ignore_index);

/// The default loss's input check (train.loss = "cross_entropy"): every target of `target` (int64,
/// on the CPU; another device is not read) is in [0, classes) or equal to `ignore_index`, else
/// InputError (exit 2) naming the value, its position, `where` ("training batch of step 3 on rank
/// 1") and train.ignore_index. A target out of range would otherwise index out of bounds in the
/// loss (a device-side assert on a GPU).
void check_targets(const torch::Tensor& target, int64_t classes, int64_t ignore_index, const std::string& where);

/// check_targets without the throw, for a step whose ranks must fail together: "" when every
/// target is fine; otherwise check_targets' message, and `target` replaced by a copy whose
/// out-of-range targets are `ignore_index`, so that the step runs on to the ranks' agreement
/// (Trainer: the consensus flag, then every rank throws the first rank's message). A dtype that
/// is not an index type still throws: it is the dataset's, the same on every rank.
std::string screen_targets(torch::Tensor& target, int64_t classes, int64_t ignore_index, const std::string& where);

}  // namespace keel
