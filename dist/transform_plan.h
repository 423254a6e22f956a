// dist/transform_plan.h: the fixed order in which a model's parts are transformed for training,
// and the record of one model's way through it.
//
//   stages -> tensor parallel -> recompute -> compile -> data parallel
//
// (torchtitan's order, with pipeline stages first: each stage is then sharded, wrapped, compiled
// and replicated on its own.) The types of trainer/compile/pipeline.h enforce the order:
// place() runs the first three (dist/stages.h, dist/tensor_parallel.h, dist/recompute.h), compile()
// the fourth, distribute() the fifth (dist/ddp.h). TransformPlan checks it a second time at run
// time and says what each transform did, for the log and for tests.
// Owns: the order, the record, what the transforms ask to run after each backward. Does not own: the transforms
// themselves.
#pragma once

#include <torch/torch.h>

#include <array>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "dist/sharded_parameters.h"

namespace keel::dist {

enum class Transform { Stages, TensorParallel, Recompute, Compile, DataParallel };
inline constexpr std::array<Transform, 5> kTransformOrder{
    Transform::Stages, Transform::TensorParallel, Transform::Recompute, Transform::Compile, Transform::DataParallel};
/// "stages", "tensor parallel", "recompute", "compile", "data parallel".
const char* transform_name(Transform t);

/// train.activation_checkpointing: none, or every block's activations recomputed in backward.
enum class Recompute { None, Blocks };

/// What the config asks of the transforms before compile: parallel.sequence_parallel (with tp >
/// 1) and train.activation_checkpointing.
struct TransformOptions {
  bool sequence_parallel = false;
  Recompute recompute = Recompute::None;
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

  /// What a transform leaves for every step: `f` runs once a step's backward is complete, before
  /// anything reads the gradients (sequence parallelism sums its replicated parameters'
  /// gradients over tp). DistributedModel::backward calls backward_complete() on a step's last
  /// micro-batch.
  void on_backward_complete(std::function<void()> f) { after_backward_.push_back(std::move(f)); }
  void backward_complete() const {
    for (const auto& f : after_backward_) f();
  }
  /// A transform that splits parameters over ranks outside data parallelism (tensor parallelism)
  /// supplies how the global gradient norm is clipped over them (each split part counted once,
  /// replicated parameters once); DistributedModel::clip_grad_norm uses it when set.
  using GradientClip = std::function<torch::Tensor(double max_norm)>;
  void set_gradient_clip(GradientClip f) { clip_ = std::move(f); }
  const GradientClip& gradient_clip() const { return clip_; }
  /// A transform that splits parameters outside data parallelism supplies how a checkpoint holds
  /// them whole (dist/sharded_parameters.h); DistributedModel's checkpoint components use it.
  void set_sharded_parameters(std::shared_ptr<ShardedParameters> s) { sharded_ = std::move(s); }
  ShardedParameters* sharded_parameters() const { return sharded_.get(); }

 private:
  std::vector<std::pair<Transform, std::string>> steps_;
  std::vector<std::function<void()>> after_backward_;
  GradientClip clip_;
  std::shared_ptr<ShardedParameters> sharded_;
};

}  // namespace keel::dist
