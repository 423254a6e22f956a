// dist/ddp.h: data-parallel gradients on c10d's Reducer (the engine PyTorch's DDP runs on).
//
// Owns, for one model: checking that every rank has the same parameters (names the first
// parameter that differs and each rank's shape), broadcasting rank 0's parameters and buffers,
// the gradient bucket plan (dist.bucket_cap_mb with a small first bucket of
// dist.first_bucket_mb, as PyTorch), gradients as bucket views, dist.find_unused_parameters,
// the comm hook (dist.comm_hook: allreduce, or bf16/fp16 compression), and gradient
// accumulation that all-reduces only on the last micro-batch of a step.
// Does not own: the model (models/), the step loop (trainer/), or talking to the group other
// than through the Reducer and dist/collectives.h.
//
// Per optimizer step with k micro-batches:
//   for i in 0..k-1: { ddp.forward_pre(sync = i == k-1); model->forward; ddp.backward(loss, sync) }
// With sync = false the Reducer's hooks stay idle and gradients accumulate locally.
#pragma once

#include <torch/torch.h>

#include <memory>
#include <string>

#include "keel/dist/collectives.h"
#include "keel/models/model.h"
#include "keel/dist/config.h"

namespace c10d {
class Reducer;
}

namespace keel::dist {

class DataParallel {
 public:
  /// Collective: every rank must construct it at the same point with the same model shape.
  DataParallel(std::shared_ptr<models::Model> model, std::shared_ptr<Collectives> coll, const DistConfig& cfg);
  ~DataParallel();

  /// Call before each micro-batch's forward (broadcasts the buffers with dist.broadcast_buffers).
  void before_forward(bool sync);
  /// Collective with dist.broadcast_buffers (else a no-op): rank 0's buffers to every rank, one
  /// coalesced broadcast. The trainer also calls it before evaluating and saving, so that what
  /// is evaluated and checkpointed is rank 0's.
  void sync_buffers();
  /// Runs loss.backward(); when `sync`, the Reducer all-reduces the gradient buckets as they
  /// become ready and averages them over the ranks.
  void backward(const torch::Tensor& loss, bool sync);
  /// A fingerprint of the parameter and bucket layout, compared across ranks every step.
  uint64_t plan() const { return plan_; }
  int64_t num_buckets() const { return num_buckets_; }

 private:
  std::shared_ptr<models::Model> model_;
  std::shared_ptr<Collectives> coll_;
  std::unique_ptr<c10d::Reducer> reducer_;
  std::vector<torch::Tensor> buffers_;  // empty unless dist.broadcast_buffers and world > 1
  uint64_t plan_ = 0;
  int64_t num_buckets_ = 0;
};

/// Checks that every rank holds parameters of the same count, names, dtypes and shapes.
/// Throws CollectiveMismatch naming the first parameter that differs and each rank's shape.
void verify_parameters_across_ranks(const models::NamedTensors& params, Collectives& coll);

}  // namespace keel::dist
