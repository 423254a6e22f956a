#include "trainer/compile/transforms.h"

#include "common/log.h"
#include "dist/fsdp.h"
#include "dist/recompute.h"
#include "dist/stages.h"
#include "dist/tensor_parallel.h"
#include "keel/common/error.h"
#include "trainer/compile/inductor_block.h"
#include "trainer/optim.h"
#include "trainer/state.h"

namespace keel {

PlacedModel place(std::shared_ptr<models::Model> model, const torch::Device& device, const dist::Mesh& mesh,
                  const dist::TransformOptions& options) {
  dist::TransformPlan plan;
  model = dist::split_into_stages(std::move(model), mesh, options.pipeline, plan);
  models::DeferredInit* deferred = options.deferred && !options.deferred->empty() ? options.deferred.get() : nullptr;
  dist::shard_tensor_parallel(*model, mesh, options.sequence_parallel, plan, deferred);
  dist::wrap_recompute(*model, options.recompute, plan);
  if (deferred && options.deferred_to_data_parallel) {
    deferred->to(device);  // placeholders: Module::to would make them whole
    plan.set_deferred(options.deferred);
  } else if (deferred) {
    deferred->make_all(model->named_parameters());  // this rank's tp parts (of its pipeline stages' parameters)
    deferred->to(device);  // the other stages' (never made: StageModel::release_others frees them)
  }
  model->to(device);
  auto check = [&](const models::NamedTensors& tensors, const char* kind) {
    for (const auto& [name, t] : tensors)
      if (t.device() != device)
        throw std::runtime_error(std::string("place: ") + kind + " '" + name + "' of model " + model->name() +
                                 " is on " + t.device().str() + ", not on " + device.str() +
                                 " (a tensor the model holds outside its registered parameters and buffers?)");
  };
  check(model->named_parameters(), "parameter");
  check(model->named_buffers(), "buffer");
  return PlacedModel(std::move(model), device, std::move(plan));
}

CompiledModel PlacedModel::compile(const CompileConfig& cfg, const torch::Tensor& example, const std::string& identity,
                                   const InductorRequest* inductor) && {
  auto report = std::make_shared<CompileReport>();
  if (cfg.mode == CompileMode::Inductor) {
    if (!inductor) throw std::logic_error("PlacedModel::compile: compile.mode = \"inductor\" needs its request");
    std::shared_ptr<InductorStep> step;
    std::shared_ptr<InductorBlock> block;
    try {
      if (inductor->granularity == "blocks") {
        InductorRequest req = *inductor;  // the units traced from this very model, on the example batch
        req.example_input = example.to(device_);
        // A pipeline stage's model is the whole one's, run a stage at a time: the units are traced
        // from the whole model's forward, and every block runs the package (a stage calls its own).
        auto* stages = dynamic_cast<dist::StageModel*>(model_.get());
        block = compile_blocks(stages ? stages->whole() : *model_, req, report, cfg.max_recompiles);
      } else if (inductor->traces_step()) {  // the step as this very model computes it, traced here
        InductorRequest req = *inductor;
        req.graph = std::make_shared<const GraphFile>(trace_step(*model_, example.to(device_), req));
        step = InductorStep::load_or_compile(req, *report);
      } else {
        step = InductorStep::load_or_compile(*inductor, *report);
      }
    } catch (const GraphRefusal&) {
      throw;  // what a package would compute otherwise than the model: never a silent fallback
    } catch (const CompileError& e) {
      // The request's fullgraph: compile.fullgraph, or a Python module (no eager C++ code to fall back to).
      if (inductor->cfg.fullgraph) throw;
      report->mode = "eager-fallback";
      report->warnings.push_back(e.what());
      logging::warn("{}; training the eager model instead (compile.fullgraph = true makes this an error)", e.what());
    }
    plan_.applied(
        dist::Transform::Compile,
        report->mode +
            (inductor->granularity == "blocks" && !step && report->mode == "inductor" ? " (each block)" : ""));
    CompiledModel m(std::move(model_), device_, std::move(report), std::move(plan_), std::move(step));
    m.block_ = std::move(block);
    m.max_recompiles = cfg.max_recompiles;
    return m;
  }
  auto compiled = compile_model(std::move(model_), cfg, example.to(device_), *report, identity);
  plan_.applied(dist::Transform::Compile, report->mode);
  return CompiledModel(std::move(compiled), device_, std::move(report), std::move(plan_));
}

DistributedModel CompiledModel::distribute(std::shared_ptr<dist::Collectives> coll, const DistConfig& cfg) && {
  const int64_t ranks = coll->size();
  auto ddp = std::make_unique<dist::DataParallel>(model_, std::move(coll), cfg, plan_.split_gradients(),
                                                  plan_.deferred().get());
  plan_.set_deferred(nullptr);
  // A split outside data parallelism (tensor parallelism) writes whole tensors from ZeRO's owners.
  if (dist::ShardedParameters* split = plan_.sharded_parameters())
    split->over_data_parallel(ddp->placement(), ddp->fully_shard());
  plan_.applied(dist::Transform::DataParallel, "zero " + std::to_string(ddp->placement().stage()) + " over " +
                                                   std::to_string(ranks) + (ranks == 1 ? " rank" : " ranks"));
  DistributedModel dm(std::move(model_), std::move(report_), std::move(ddp), std::move(step_), max_recompiles,
                      std::move(plan_));
  if (block_) {  // ranks agree on the block package as on a step's (the per-step consensus)
    dm.package_fingerprint_ = std::stoull(block_->sha256().substr(0, 15), nullptr, 16);
    dm.block_ = std::move(block_);
  }
  return dm;
}

std::optional<PackageFiles> DistributedModel::package_files() const {
  if (step_) return PackageFiles{step_->path(), step_->sha256(), step_->manifest_for_checkpoint(), "the training step"};
  if (block_)
    return PackageFiles{block_->path(), block_->sha256(), block_->manifest_for_checkpoint(), "the transformer block"};
  return std::nullopt;
}

DistributedModel::DistributedModel(std::shared_ptr<models::Model> m, std::shared_ptr<CompileReport> r,
                                   std::unique_ptr<dist::DataParallel> ddp, std::shared_ptr<InductorStep> step,
                                   int64_t max_recompiles, dist::TransformPlan plan)
    : model_(std::move(m)),
      report_(std::move(r)),
      ddp_(std::move(ddp)),
      step_(std::move(step)),
      max_recompiles_(max_recompiles),
      plan_(std::move(plan)) {
  if (step_) {
    params_ = model_->parameters();
    for (const auto& [name, b] : model_->named_buffers()) buffers_.push_back(b);
    const std::string& sha = step_->sha256();
    package_fingerprint_ = std::stoull(sha.substr(0, 15), nullptr, 16);
  }
}

std::optional<torch::Tensor> DistributedModel::compiled_loss(const torch::Tensor& input, const torch::Tensor& target,
                                                             bool sync, const torch::Tensor& grad_scale) {
  if (!step_) return std::nullopt;
  if (!step_->fits(input, target)) {
    if (eager_shapes_.insert(input.sizes().vec()).second) {
      ++report_->recompiles;
      // The batch shapes are the config's (data.drop_last, the data's size): exit 2, naming the key.
      if (report_->recompiles > max_recompiles_)
        throw InputError("compile: a batch of shape " + c10::str(input.sizes()) + " makes " +
                         std::to_string(report_->recompiles) +
                         " batch shapes the inductor package does not take, more than compile.max_recompiles = " +
                         std::to_string(max_recompiles_) +
                         " (a recompilation storm); keep batch shapes static (data.drop_last = true)");
      logging::warn(
          "compile: a batch of shape {} is not the package's {}: it runs eager (re-specialisation {} of at "
          "most compile.max_recompiles = {})",
          c10::str(input.sizes()), step_->path(), report_->recompiles, max_recompiles_);
    }
    return std::nullopt;
  }
  ddp_->before_forward(sync);
  return step_->loss(params_, buffers_, input, target, grad_scale);
}

void DistributedModel::zero_gradient_shards() {
  if (!ddp_->placement().shards_gradients()) return;
  if (owned_.empty())
    for (const auto& [n, t] : ddp_->owned_parameters()) owned_.push_back(t);
  zero_grads(owned_);
}

torch::Tensor DistributedModel::evaluation_forward(const torch::Tensor& input, models::Model& eager) {
  return ddp_->placement().shards_parameters() ? forward(input, /*sync=*/true) : eager.forward(input);
}

std::unique_ptr<OptimizerState> DistributedModel::optimizer_state(torch::optim::Optimizer& opt,
                                                                  const OptimizerCodec& codec) const {
  // dist.zero >= 2 steps pieces, tensor parallelism slices: a checkpoint holds whole parameters' state.
  PieceResharding resharding;
  dist::ShardedParameters* split = plan_.sharded_parameters();
  if (!split) split = ddp_->fully_shard();
  if (split)
    resharding = {[split](const NamedTensorList& s, const std::map<std::string, std::string>& fields) {
                    return split->whole_state(s, fields);
                  },
                  [split](const NamedTensorList& s) { return split->piece_state(s); }, split->optimizer_parameters()};
  return std::make_unique<OptimizerState>(opt, ddp_->owned_parameters(), ddp_->placement(), codec, resharding);
}

std::unique_ptr<checkpoint::Stateful> DistributedModel::model_state(std::shared_ptr<models::Model> eager,
                                                                    nlohmann::json hf_config) const {
  dist::ShardedParameters* split = plan_.sharded_parameters();
  if (!split && ddp_->placement().shards_parameters()) split = ddp_->fully_shard();
  return std::make_unique<ModelState>(std::move(eager), std::move(hf_config), split);
}

DistributedModel::Residency DistributedModel::residency(const models::Model& eager) const {
  Residency r;
  r.zero = ddp_->placement().stage();
  std::set<const void*> grad_storages;
  for (const auto& [n, p] : eager.named_parameters()) {
    r.parameter_bytes += static_cast<int64_t>(p.nbytes());
    const auto& g = p.grad();
    if (g.defined() && grad_storages.insert(g.storage().data()).second)
      r.gradient_bytes += static_cast<int64_t>(g.storage().nbytes());
  }
  if (ddp_->fully_shard()) {  // dist.zero >= 2: what a rank holds between steps (its shards)
    r.parameter_bytes = ddp_->sharded_parameter_bytes();
    r.gradient_bytes = ddp_->sharded_gradient_bytes();
  }
  return r;
}

}  // namespace keel
