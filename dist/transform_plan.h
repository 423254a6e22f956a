// dist/transform_plan.h: the fixed order in which a model's parts are transformed for training,
// and the record of one model's way through it.
//
//   stages -> tensor parallel -> recompute -> compile -> data parallel
//
// (torchtitan's order, with pipeline stages first: each stage is then sharded, wrapped, compiled
// and replicated on its own.) The types of trainer/compile/transforms.h enforce the order:
// place() runs the first three (dist/stages.h, dist/tensor_parallel.h, dist/recompute.h), compile()
// the fourth, distribute() the fifth (dist/ddp.h). TransformPlan checks it a second time at run
// time and says what each transform did, for the log and for tests.
// Owns: the order, the record, what the transforms leave for the later ones (split gradients,
// whole-tensor checkpoints). Does not own: the transforms themselves.
#pragma once

#include <torch/torch.h>

#include <array>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "dist/sharded_parameters.h"
#include "keel/dist/collectives.h"
#include "models/deferred_init.h"

namespace keel::dist {

enum class Transform { Stages, TensorParallel, Recompute, Compile, DataParallel };
inline constexpr std::array<Transform, 5> kTransformOrder{
    Transform::Stages, Transform::TensorParallel, Transform::Recompute, Transform::Compile, Transform::DataParallel};
/// "stages", "tensor parallel", "recompute", "compile", "data parallel".
const char* transform_name(Transform t);

/// train.activation_checkpointing: none, every block's activations recomputed in backward, or
/// all of them but its dense products (dist/recompute.h).
enum class Recompute { None, Blocks, Selective };

/// What the config asks of the transforms before compile: parallel.sequence_parallel (with tp >
/// 1) and train.activation_checkpointing.
struct TransformOptions {
  bool sequence_parallel = false;
  Recompute recompute = Recompute::None;
  /// Sharded initialisation (model.sharded_init, models/deferred_init.h): the model's parameters
  /// not made yet, or null. place() makes each rank's tensor-parallel part of them, unless
  /// `deferred_to_data_parallel` (dist.zero = 3), when FullyShard makes each rank's flat shards.
  std::shared_ptr<models::DeferredInit> deferred;
  bool deferred_to_data_parallel = false;
  /// parallel.pp > 1: the stages (pp x virtual stages) and which pp rank holds each (the
  /// schedule's), and parallel.pp_split's boundaries (empty: "even").
  struct Pipeline {
    std::vector<int> stage_rank;
    std::vector<int64_t> split_points;
  };
  Pipeline pipeline;
};

/// The gradients of a model whose parameters are split over `group` outside data parallelism,
/// per parameter in model order: `replicated` ones are whole on every rank of the group (counted
/// once in the global norm: on the group's rank 0), the others split (each rank's part counted);
/// `partial` ones hold, after a step's backward, this rank's part of a sum over the group
/// (sequence parallelism's replicated parameters), to be summed over it before anything reads
/// them. `group` must outlive the model (the mesh's).
struct SplitGradients {
  Collectives* group = nullptr;
  std::vector<bool> replicated, partial;
};

class TransformPlan {
 public:
  /// Records that `t` was applied, with what it did ("none (tp 1)", "inductor", ...). Throws
  /// std::logic_error naming both transforms when `t` is not the next in kTransformOrder (one
  /// skipped, repeated, or out of order): a programming error, never the user's.
  void applied(Transform t, std::string what);
  /// Whether every transform has been applied.
  bool complete() const { return steps_.size() == kTransformOrder.size(); }
  const std::vector<std::pair<Transform, std::string>>& steps() const { return steps_; }
  /// "stages: whole model (pp 1) -> tensor parallel: none (tp 1) -> ...".
  std::string describe() const;

  /// A transform that splits parameters over a group outside data parallelism (tensor
  /// parallelism) says what that means for their gradients (SplitGradients); the data-parallel
  /// transform, which knows where a rank keeps them (whole parameters, or ZeRO's pieces), sums
  /// the partial ones and clips over the mesh (dist/ddp.h).
  void set_split_gradients(SplitGradients s) { split_gradients_ = std::move(s); }
  const std::optional<SplitGradients>& split_gradients() const { return split_gradients_; }
  /// A transform that splits parameters outside data parallelism supplies how a checkpoint holds
  /// them whole (dist/sharded_parameters.h); DistributedModel's checkpoint components use it.
  void set_sharded_parameters(std::shared_ptr<ShardedParameters> s) { sharded_ = std::move(s); }
  ShardedParameters* sharded_parameters() const { return sharded_.get(); }
  /// Parameters left for the data-parallel transform to make (TransformOptions::deferred).
  void set_deferred(std::shared_ptr<models::DeferredInit> d) { deferred_ = std::move(d); }
  const std::shared_ptr<models::DeferredInit>& deferred() const { return deferred_; }

 private:
  std::vector<std::pair<Transform, std::string>> steps_;
  std::optional<SplitGradients> split_gradients_;
  std::shared_ptr<ShardedParameters> sharded_;
  std::shared_ptr<models::DeferredInit> deferred_;
};

}  // namespace keel::dist
