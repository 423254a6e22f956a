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
//
// ZeRO (dist.zero, docs/zero.md) is a dist::Placement (dist/placement.h), made here once from
// dist.zero and the model: which rank owns which elements of which parameter. Stage 1: the
// optimizer holds only owned_parameters() (whole parameters, contiguous ranges balanced by
// bytes); after its step, sync_parameters() sends each owner's updated parameters to every rank
// (dist.bucket_cap_mb buckets, one validated broadcast_coalesced per owner). Stages 2 and 3 have
// no Reducer: dist/fsdp.h holds the placement's flat units, reduce-scatters the gradients (each
// rank keeps only its shard of them), and owned_parameters() are this rank's pieces of the
// parameters (1-D, a parameter may be split between ranks); stage 3 shards the parameters too.
// Placement::owner names who writes each parameter's optimizer state in a checkpoint at stages
// 1-3 (and, at stage 3, the parameter).
#pragma once

#include <torch/torch.h>

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "dist/placement.h"
#include "dist/transform_plan.h"
#include "keel/dist/collectives.h"
#include "keel/dist/config.h"
#include "keel/models/model.h"

namespace c10d {
class Reducer;
}

namespace keel::dist {

class FullyShard;

class DataParallel {
 public:
  /// Collective: every rank must construct it at the same point with the same model shape.
  /// `split`: the model's parameters are also split over a group outside data parallelism (tensor
  /// parallelism, dist/transform_plan.h): its partial gradients are summed over that group on a
  /// step's last micro-batch, and the clip counts each part once over the whole mesh. The
  /// placement must then be the same on every rank of that group (checked: one agreement).
  /// `deferred` (sharded initialisation, dist.zero = 3 only): parameters not made yet, which
  /// FullyShard makes as this rank's shards only (every rank draws the same from the same
  /// run.seed: they are not broadcast).
  DataParallel(std::shared_ptr<models::Model> model, std::shared_ptr<Collectives> coll, const DistConfig& cfg,
               const std::optional<SplitGradients>& split = std::nullopt, models::DeferredInit* deferred = nullptr);
  ~DataParallel();

  /// Call before each micro-batch's forward (broadcasts the buffers with dist.broadcast_buffers).
  /// `step`: a training micro-batch of the trainer's loop (FullyShard::before_forward).
  void before_forward(bool sync, bool step = false);
  /// Collective with dist.broadcast_buffers (else a no-op): rank 0's buffers to every rank, one
  /// coalesced broadcast. The trainer also calls it before evaluating and saving, so that what
  /// is evaluated and checkpointed is rank 0's.
  void sync_buffers();
  /// Runs loss.backward(); when `sync`, the Reducer all-reduces the gradient buckets as they
  /// become ready and averages them over the ranks (ZeRO 2-3: FullyShard reduce-scatters them),
  /// and a split model's partial gradients are then summed over their group, where this rank
  /// keeps them (whole parameters, or its pieces).
  void backward(const torch::Tensor& loss, bool sync);
  /// A fingerprint of the parameter and bucket layout, compared across ranks every step.
  uint64_t plan() const { return plan_; }
  int64_t num_buckets() const { return num_buckets_; }

  /// dist.zero as what it shards and who owns what (dist/placement.h).
  const Placement& placement() const { return placement_; }
  /// The parameters (stages 0 and 1; all at stage 0) or pieces of them (stages 2 and 3) whose
  /// optimizer state and update this rank owns: Placement::pieces of this rank.
  models::NamedTensors owned_parameters() const;
  /// Collective with zero = 1 or 2 (else a no-op): after the optimizer step, every owner's
  /// parameters reach every rank (stage 1: one broadcast per owner, dist/zero.h; stage 2: an
  /// all-gather of each block's shards).
  void sync_parameters();
  /// dist.zero = 3 (dist/fsdp.h; else no-ops, stage 2's parameters being whole): every parameter
  /// gathered into the model and kept there until release_parameters() (collective), and the
  /// bytes this rank holds at rest (dist.zero >= 2).
  void hold_parameters();
  void release_parameters();
  /// Evaluation's forwards for this rank's `batches`: as many at stages 0-2; at stage 3 as many as
  /// the rank with the most (collective: one all-reduce), each block being gathered around its call.
  int64_t evaluation_rounds(int64_t batches);
  /// The whole model in its parameters for Callbacks::on_end, when `wanted` on this rank, or at
  /// stage 3 on any rank (collective: one all-reduce; every rank gathers).
  void hold_whole_model(bool wanted);
  /// dist.zero >= 2: FullyShard's conversions of optimizer state between this rank's pieces and
  /// whole parameters (null otherwise; see dist/fsdp.h).
  FullyShard* fully_shard() const { return fsdp_.get(); }
  /// Whether the parameters' gradients are buffers a reduction writes (DDP's buckets, whose views
  /// they are, or FullyShard's), which must stay allocated between steps (zeroed, not freed).
  bool gradients_are_buffers() const { return reducer_ != nullptr || fsdp_ != nullptr; }
  int64_t sharded_parameter_bytes() const;
  int64_t sharded_gradient_bytes() const;
  /// Clips the owned gradients to a global L2 norm of `max_norm` and returns the norm before
  /// clipping (0-dim, on the device: the host reads it only if it wants), with the foreach
  /// arithmetic of torch.nn.utils.clip_grad_norm_ (dist::clip_grad_norm): with zero >= 1 the
  /// per-parameter norms of the owners are exchanged in one all-reduce, so the result is
  /// bit-identical to zero = 0's. A split model (tensor parallelism): the norm over the whole mesh,
  /// each part counted once (dist/tensor_parallel.h's clip_grad_norm_tensor_parallel). A
  /// `max_norm` of infinity measures the norm only.
  torch::Tensor clip_grad_norm(double max_norm);

 private:
  void reduce_gradients(const torch::Tensor& loss, bool sync);
  /// The tensors whose gradients this rank keeps (owned_parameters()), each with its parameter's
  /// entry of `per_param` (model order).
  std::vector<std::pair<torch::Tensor, bool>> held_with(const std::vector<bool>& per_param) const;
  void sum_partial_gradients();
  std::shared_ptr<models::Model> model_;
  std::shared_ptr<Collectives> coll_;
  std::unique_ptr<c10d::Reducer> reducer_;
  bool find_unused_ = false;  // dist.find_unused_parameters (the Reducer's used-parameter map)
  bool rebuild_due_ = false;  // the Reducer's bucket rebuild is next (after its first synced backward)
  bool rebuilt_ = false;
  std::vector<torch::Tensor> buffers_;  // empty unless dist.broadcast_buffers and world > 1
  uint64_t plan_ = 0;
  int64_t num_buckets_ = 0;
  Placement placement_;
  size_t bucket_bytes_ = 0;  // dist.bucket_cap_mb, for the parameter broadcasts
  models::NamedTensors params_;
  std::unique_ptr<FullyShard> fsdp_;  // dist.zero >= 2
  std::optional<SplitGradients> split_;
};

/// Checks that every rank holds parameters of the same count, names, dtypes and shapes.
/// Throws CollectiveMismatch naming the first parameter that differs and each rank's shape.
void verify_parameters_across_ranks(const models::NamedTensors& params, Collectives& coll);

}  // namespace keel::dist
