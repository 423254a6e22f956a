// dist/stages.h: the first transform of dist/transform_plan.h: the model split into pipeline
// stages over the mesh's pp axis (issue 66). The blocks are split into pp x virtual stages,
// contiguous, in forward order: "even" (parallel.pp_split) balances the parameters per stage (the
// root's counted half on the first stage, half on the last), or the config names the first block
// of each stage after the first. The first stage runs the root's embedding, the last its head (and
// the loss). A rank keeps a StageModel: the whole model, whose forward it runs one stage at a time
// (BlockStructure::stage), and whose parameters it trains only where its stages hold them; the
// others' are freed once the run is built (release_others). The
// root's parameters (outside every block: the embedding, the final norm, the output projection,
// tied or not) are held by the first and the last stage alike; their gradients are summed between
// the two every step, so that both copies take the same update and stay equal, as a tied embedding
// must (Megatron's embedding group).
// Owns: the split, the stage's forward, which parameters a rank holds.
// Does not own: the schedule (dist/pipeline/schedule.h), running it (trainer/step/pipelined.h).
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "dist/mesh.h"
#include "dist/transform_plan.h"
#include "keel/models/model.h"

namespace keel::dist {

/// A rank's pipeline stages of a model with blocks.
class StageModel : public models::Model {
 public:
  /// `ranges`: every stage's part of forward, in order; `mine`: the stages this rank runs.
  StageModel(std::shared_ptr<models::Model> whole, std::vector<models::BlockStructure::Stage> ranges,
             std::vector<int> mine);

  /// Stage `s`'s forward (one of mine()): token ids, or the previous stage's output -> its output
  /// (the logits on the last stage).
  torch::Tensor forward_stage(int s, const torch::Tensor& x);
  const std::vector<int>& mine() const { return mine_; }
  int stages() const { return static_cast<int>(ranges_.size()); }
  const std::vector<models::BlockStructure::Stage>& ranges() const { return ranges_; }
  /// The root's parameters, which the first and the last stage both hold (empty elsewhere).
  const models::NamedTensors& root_parameters() const { return root_; }
  /// This rank holds the first stage, the last one.
  bool holds_first() const;
  bool holds_last() const;
  models::Model& whole() { return *whole_; }
  /// Frees the parameters of the stages other ranks hold (each made an empty tensor of its dtype
  /// and device; the same tensor objects), once the model is built, compiled and distributed: a
  /// rank then holds its stages' parameters only. remake_others() gives them back their shapes
  /// (uninitialised: the caller fills them, as PipelinedStep::hold_whole_model broadcasts them).
  void release_others();
  void remake_others();
  /// Every parameter of the whole model on the meta device, with its shape as the model was built
  /// (before tensor parallelism sliced it; released or not): a checkpoint's tensors.
  models::NamedTensors whole_parameter_shapes() const;
  /// "blocks 0-1 | 2-3" style: each stage's blocks, for the transform plan and the log.
  std::string describe() const;

  std::string name() const override { return whole_->name(); }
  models::InputSpec input_spec() const override { return whole_->input_spec(); }
  /// A stage runs forward_stage(); the model's forward is the whole pipeline's.
  torch::Tensor forward(const torch::Tensor& input) override;
  /// Those of this rank's stages: their blocks', and the root's on the first and last stage.
  models::NamedTensors named_parameters() const override;
  models::NamedTensors named_buffers() const override { return whole_->named_buffers(); }
  void to(const torch::Device& device) override { whole_->to(device); }
  void train(bool on) override { whole_->train(on); }
  double train_flops_per_sample() const override { return whole_->train_flops_per_sample(); }
  std::vector<std::string> block_prefixes() const override { return whole_->block_prefixes(); }
  void set_block_hooks(models::BlockHooks* hooks) override { whole_->set_block_hooks(hooks); }
  void set_block_runner(models::BlockStructure::BlockRun run) override { whole_->set_block_runner(std::move(run)); }
  bool set_block_compiled(models::BlockStructure::BlockCompiled run) override {
    return whole_->set_block_compiled(std::move(run));
  }
  bool set_region_compiled(models::BlockStructure::RegionCompiled run) override {
    return whole_->set_region_compiled(std::move(run));
  }
  bool set_root_compiled(models::BlockStructure::RootCompiled run) override {
    return whole_->set_root_compiled(std::move(run));
  }
  models::BlockStructure* block_structure() override { return whole_->block_structure(); }

 private:
  std::shared_ptr<models::Model> whole_;
  std::vector<models::BlockStructure::Stage> ranges_;
  std::vector<int> mine_;
  models::NamedTensors root_;
  models::NamedTensors held_;                             // named_parameters()
  std::map<std::string, std::vector<int64_t>> released_;  // release_others(): each one's shape
  std::map<std::string, std::vector<int64_t>> built_;     // each parameter's shape at construction
};

/// The blocks' split into `stages` contiguous ranges: `points` (the first block of each stage after
/// the first), or, empty, the one that minimises the largest stage's parameters (`block_params`:
/// each block's; `root_params`: counted half on the first stage, half on the last). Each stage
/// gets at least one block. Throws InputError naming parallel.pp / parallel.pp_split.
std::vector<models::BlockStructure::Stage> split_blocks(const std::vector<int64_t>& block_params, int64_t root_params,
                                                        int stages, const std::vector<int64_t>& points);

/// This rank's stages of `model` (pp = 1: `model` itself), recorded in `plan`.
std::shared_ptr<models::Model> split_into_stages(std::shared_ptr<models::Model> model, const Mesh& mesh,
                                                 const TransformOptions::Pipeline& pipeline, TransformPlan& plan);

}  // namespace keel::dist
