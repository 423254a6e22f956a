// trainer/compile/transforms.h: the only way to get a trainable distributed model:
//
//   auto dm = keel::place(model, device, mesh) // PlacedModel:   this rank's stage, its tp shard,
//                                              //   recompute wrapped, every tensor on `device`
//                 .compile(cfg.compile)        // CompiledModel: the static-graph stage
//                 .distribute(coll, cfg.dist); // DistributedModel: DDP / ZeRO over the dp axis
//
// These are dist/transform_plan.h's five transforms in their fixed order (stages, tensor
// parallel, recompute, compile, data parallel); each stage's model carries the plan's record
// (DistributedModel::transforms()).
//
// Each stage is a distinct type that offers only the next step, and each step consumes its
// stage (&&-qualified), so compiling after DDP, distributing before placement or compiling
// twice do not compile (tests/test_transforms.cpp proves it with type traits). The compile stage
// sees one model on one device and no ranks, so a package is built once and shared by every
// rank, and no collective is ever inside a compiled graph (docs/concepts.md).
//
// Runtime checks: place() verifies that every parameter and buffer is on the target device
// and names the first one that is not.
#pragma once

#include <torch/torch.h>

#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <set>
#include <vector>

#include "dist/ddp.h"
#include "dist/mesh.h"
#include "dist/transform_plan.h"
#include "keel/dist/collectives.h"
#include "keel/models/model.h"
#include "keel/trainer/config/config.h"
#include "trainer/compile/compile.h"
#include "trainer/compile/inductor.h"
#include "trainer/compile/inductor_block.h"
#include "trainer/optim.h"

namespace keel {

class CompiledModel;
class DistributedModel;

/// Stage 1: the model's tensors are on one device.
class PlacedModel {
 public:
  PlacedModel(PlacedModel&&) = default;
  PlacedModel& operator=(PlacedModel&&) = default;
  PlacedModel(const PlacedModel&) = delete;  // one model, one pipeline
  PlacedModel& operator=(const PlacedModel&) = delete;
  /// `example`: an input of the training shape and dtype (compile.mode = trace traces it).
  /// `identity`: the model and its config, for the compile cache (see trainer/compile/compile.h).
  /// `inductor`: what compile.mode = "inductor" packages (required in that mode).
  CompiledModel compile(const CompileConfig& cfg, const torch::Tensor& example, const std::string& identity = "",
                        const InductorRequest* inductor = nullptr) &&;
  models::Model& model() { return *model_; }
  const dist::TransformPlan& transforms() const { return plan_; }

 private:
  friend PlacedModel place(std::shared_ptr<models::Model>, const torch::Device&, const dist::Mesh&,
                           const dist::TransformOptions&);
  PlacedModel(std::shared_ptr<models::Model> m, torch::Device d, dist::TransformPlan plan)
      : model_(std::move(m)), device_(d), plan_(std::move(plan)) {}
  std::shared_ptr<models::Model> model_;
  torch::Device device_;
  dist::TransformPlan plan_;
};

/// Stage 2: the model as it will run (compile.mode = off: the eager module).
class CompiledModel {
 public:
  CompiledModel(CompiledModel&&) = default;
  CompiledModel& operator=(CompiledModel&&) = default;
  CompiledModel(const CompiledModel&) = delete;  // one model, one pipeline
  CompiledModel& operator=(const CompiledModel&) = delete;
  /// The data-parallel transform over `coll`'s ranks (the mesh's dp axis).
  DistributedModel distribute(std::shared_ptr<dist::Collectives> coll, const DistConfig& cfg) &&;
  const CompileReport& report() const { return *report_; }
  const dist::TransformPlan& transforms() const { return plan_; }
  /// compile.max_recompiles, for the batches of other shapes (set by compile()).
  int64_t max_recompiles = 8;

 private:
  friend class PlacedModel;
  CompiledModel(std::shared_ptr<models::Model> m, torch::Device d, std::shared_ptr<CompileReport> r,
                dist::TransformPlan plan, std::shared_ptr<InductorStep> step = nullptr)
      : model_(std::move(m)), device_(d), report_(std::move(r)), plan_(std::move(plan)), step_(std::move(step)) {}
  std::shared_ptr<models::Model> model_;
  torch::Device device_;
  std::shared_ptr<CompileReport> report_;
  dist::TransformPlan plan_;
  std::shared_ptr<InductorStep> step_;    // compile.mode = "inductor"
  std::shared_ptr<InductorBlock> block_;  // compile.granularity = "blocks"
};

/// Stage 3: trainable across ranks. Per micro-batch: forward(input, sync) then
/// backward(loss, sync); sync = true on the last micro-batch of an optimizer step.
class DistributedModel {
 public:
  DistributedModel(DistributedModel&&) = default;
  DistributedModel& operator=(DistributedModel&&) = default;
  DistributedModel(const DistributedModel&) = delete;  // one model, one pipeline
  DistributedModel& operator=(const DistributedModel&) = delete;
  /// `step`: a training micro-batch of the trainer's loop (forward, loss, backward and nothing
  /// else collective between; dist/fsdp.h validates its collectives as a schedule).
  torch::Tensor forward(const torch::Tensor& input, bool sync, bool step = false) {
    ddp_->before_forward(sync, step);
    return model_->forward(input);
  }
  /// compile.mode = "inductor": the micro-batch's loss from the compiled step (forward, loss
  /// and backward in one package; backward() then hands autograd its gradients), or nullopt
  /// when this batch runs eager (no package, or a batch of another shape: counted against
  /// compile.max_recompiles, warned once per shape). `grad_scale`: the GradScaler's scale, for a
  /// package that scales its gradients inside (amp.dtype = fp16; InductorStep::loss).
  std::optional<torch::Tensor> compiled_loss(const torch::Tensor& input, const torch::Tensor& target, bool sync,
                                             const torch::Tensor& grad_scale = torch::Tensor());
  /// On the last micro-batch (`sync`), the gradients are reduced over dp and, for a model split
  /// over tp, complete over it too (DataParallel::backward).
  void backward(const torch::Tensor& loss, bool sync) { ddp_->backward(loss, sync); }
  /// Collective: rank 0's buffers to every rank (dist.broadcast_buffers; else a no-op).
  void sync_buffers() { ddp_->sync_buffers(); }
  models::Model& model() { return *model_; }
  /// The gradient plan and the compiled package, compared across ranks every step.
  uint64_t plan() const { return ddp_->plan() ^ package_fingerprint_; }
  /// Under dist.zero (dist/placement.h): the parameters or pieces this rank's optimizer owns (all
  /// with stage 0), the global-norm clip over the owners' gradients, and (collective) the owners'
  /// updated parameters to every rank after the optimizer step (dist/ddp.h).
  models::NamedTensors owned_parameters() const { return ddp_->owned_parameters(); }
  torch::Tensor clip_grad_norm(double max_norm) { return norm_ ? norm_(max_norm) : ddp_->clip_grad_norm(max_norm); }
  /// The same global norm, measured only (collective as clip_grad_norm; no gradient is written).
  torch::Tensor grad_norm() { return clip_grad_norm(std::numeric_limits<double>::infinity()); }
  /// Pipeline parallelism: the global norm (and clip) over every stage's gradients, which the
  /// pipelined step sets (trainer/step/pipelined.h); clip_grad_norm and grad_norm then take it.
  using GlobalNorm = std::function<torch::Tensor(double max_norm)>;
  void set_global_norm(GlobalNorm norm) { norm_ = std::move(norm); }
  void sync_parameters() { ddp_->sync_parameters(); }
  /// The gradients are the data-parallel engine's buffers (DDP's bucket views, ZeRO's), zeroed
  /// rather than freed between steps.
  bool gradients_are_buffers() const { return ddp_->gradients_are_buffers(); }
  /// The gradient shards this rank keeps (dist.zero >= 2; the full gradients are freed), zeroed
  /// before a step's micro-batches, after the model's own.
  void zero_gradient_shards();
  /// Evaluation: the forwards this rank runs for its `batches` (collective at dist.zero = 3, see
  /// DataParallel::evaluation_rounds), each one's logits (the eager model's, or at dist.zero = 3
  /// the model run block by block as it gathers them), and the end (dist.zero = 3 frees the root
  /// unit the first forward gathered; local).
  int64_t evaluation_rounds(int64_t batches) { return ddp_->evaluation_rounds(batches); }
  torch::Tensor evaluation_forward(const torch::Tensor& input, models::Model& eager);
  void end_evaluation() { ddp_->release_parameters(); }
  /// Collective at dist.zero = 3: the whole model in its parameters for Callbacks::on_end when
  /// `wanted` on some rank (DataParallel::hold_whole_model).
  void hold_whole_model(bool wanted) { ddp_->hold_whole_model(wanted); }
  /// dist.zero >= 2: the ZeRO-2/3 layout (dist/fsdp.h); null otherwise.
  dist::FullyShard* fully_shard() const { return ddp_->fully_shard(); }
  /// The optimizer's part of a checkpoint: `opt`'s state over the parameters this rank's
  /// optimizer steps (owned_parameters()), with the owner map and, at dist.zero >= 2, the
  /// resharding between this rank's pieces and whole parameters' state (dist/fsdp.h).
  std::unique_ptr<OptimizerState> optimizer_state(torch::optim::Optimizer& opt, const OptimizerCodec& codec) const;
  /// The model's part: `eager`'s tensors (at dist.zero = 3 read and written through the shards).
  std::unique_ptr<checkpoint::Stateful> model_state(std::shared_ptr<models::Model> eager,
                                                    nlohmann::json hf_config) const;
  /// What this rank holds at rest, for the summary: dist.zero, and the bytes of parameters and
  /// gradients (the eager model's, distinct gradient storages once; its shards at dist.zero >= 2).
  struct Residency {
    int64_t zero = 0, parameter_bytes = 0, gradient_bytes = 0;
  };
  Residency residency(const models::Model& eager) const;
  /// compile.mode = "inductor": the loaded package (null when the step runs eager).
  const std::shared_ptr<InductorStep>& inductor_step() const { return step_; }
  /// compile.granularity = "blocks": the block package the model's blocks run (null otherwise).
  const std::shared_ptr<InductorBlock>& inductor_block() const { return block_; }
  /// The package checkpoint.save_graph stores (the step's or the blocks'); nullopt when none runs.
  std::optional<PackageFiles> package_files() const;
  /// Compile results; recompiles keep counting while training.
  const CompileReport& compile_report() const { return *report_; }
  /// What each of the five transforms did to this model, in order.
  const dist::TransformPlan& transforms() const { return plan_; }

 private:
  friend class CompiledModel;
  DistributedModel(std::shared_ptr<models::Model> m, std::shared_ptr<CompileReport> r,
                   std::unique_ptr<dist::DataParallel> ddp, std::shared_ptr<InductorStep> step, int64_t max_recompiles,
                   dist::TransformPlan plan);
  std::shared_ptr<models::Model> model_;
  std::shared_ptr<CompileReport> report_;
  std::unique_ptr<dist::DataParallel> ddp_;
  std::shared_ptr<InductorStep> step_;
  std::shared_ptr<InductorBlock> block_;
  std::vector<torch::Tensor> params_, buffers_;  // the model's, in the package's order
  std::vector<torch::Tensor> owned_;             // zero_gradient_shards(): this rank's pieces
  std::set<std::vector<int64_t>> eager_shapes_;  // batch shapes seen that the package does not take
  int64_t max_recompiles_ = 0;
  uint64_t package_fingerprint_ = 0;
  dist::TransformPlan plan_;
  GlobalNorm norm_;  // set_global_norm()
};

/// Stage 0 -> 1: the transforms before compile, on `mesh` (default: one rank), in their order:
/// this rank's pipeline stage (dist/stages.h), its tensor-parallel shard (dist/tensor_parallel.h),
/// the recompute wrapping (dist/recompute.h); then moves the model to `device` and checks that
/// every parameter and buffer is there. Throws std::runtime_error naming the first tensor that is not.
PlacedModel place(std::shared_ptr<models::Model> model, const torch::Device& device,
                  const dist::Mesh& mesh = dist::Mesh(), const dist::TransformOptions& options = {});

}  // namespace keel
