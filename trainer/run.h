// trainer/run.h: the set-up of one training run, from the config to a model ready to step.
//
// Owns: building a run's components in their fixed order (threads, device, the rendezvous and
// the config's agreement, the mesh, the directory locks, the memory estimate, the model, the
// data and the GradScaler, place -> compile -> distribute, the optimizer and its schedule), each
// step a named function below, each agreed across ranks where a rank alone could fail.
// Does not own: checkpointing and resume (trainer/checkpoints.h), the outputs
// (trainer/report.h), what a step does (trainer/step/step.h), the loop (trainer/trainer.cpp).
#pragma once

#include <torch/torch.h>

#include <memory>
#include <optional>
#include <vector>

#include "amp/grad_scaler.h"
#include "common/clock.h"
#include "common/file.h"
#include "dist/mesh.h"
#include "dist/tp_ops.h"
#include "keel/dist/collectives.h"
#include "keel/dist/process_group.h"
#include "keel/trainer/data/data.h"
#include "keel/trainer/trainer.h"
#include "trainer/compile/python_model.h"
#include "trainer/compile/transforms.h"
#include "trainer/data/sampler.h"
#include "trainer/fault/injector.h"
#include "trainer/loss.h"
#include "trainer/optim.h"
#include "trainer/progress.h"
#include "trainer/setup.h"

namespace keel {

/// The components of one run, built by the constructor in the order above; the loop, the step,
/// the checkpoints and the report read them. Collective: every rank constructs its Run together.
struct Run {
  Run(const Config& cfg, const dist::World& world, const Callbacks& cb);
  Run(const Run&) = delete;
  Run& operator=(const Run&) = delete;

  const Clock::time_point t_start = Clock::now();
  const Config& cfg;
  const dist::World& world;
  const Callbacks& cb;

  int64_t threads = 1;
  torch::Device device{torch::kCPU};
  double rendezvous_ms = 0;
  std::shared_ptr<dist::Group> group;
  std::shared_ptr<dist::Collectives> coll;  // the world's
  dist::Mesh mesh;                          // the parallel axes: who is a data-parallel peer
  std::unique_ptr<FaultInjector> faults;
  AmpContext amp;
  std::shared_ptr<models::Model> model;  // the eager model (evaluation, checkpoints)
  std::shared_ptr<PythonModel> python;   // model.name = "python": model's core, evaluated through the package
  int64_t num_parameters = 0;            // the model's, as built (dist.zero = 3 empties its own)
  /// model.sharded_init: the model's parameters not made yet (models/deferred_init.h), until
  /// place() or, at dist.zero = 3, distribute() makes this rank's shards of them; else null.
  std::shared_ptr<models::DeferredInit> deferred;
  double rss_before_model_mib = 0;  // the process's peak resident memory before the model was built
  models::InputSpec spec;
  data::Splits splits;
  std::optional<DistributedModel> dmodel;
  std::unique_ptr<data::DistributedSampler> sampler;
  std::vector<torch::Tensor> params;                // the model's
  std::vector<torch::Tensor> owned;                 // the parameters this rank's optimizer updates (dist.zero)
  std::optional<OptimizerChoice> optimizer_choice;  // train.optimizer, resolved at start
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  FusedOptimizer* fused = nullptr;                  // optimizer, when fused (the update can skip on the device)
  std::unique_ptr<OptimizerState> optimizer_state;  // its checkpoint part (partitioned with dist.zero)
  std::optional<LrSchedule> schedule;
  std::unique_ptr<amp::GradScaler> scaler;
  LossFn loss;
  bool late = false;  // dist.consensus resolved: the consensus is read one step late
  // compile.cuda_graphs (trainer/step/graphs.h): graphs captured (forward-backward per batch shape,
  // the update) and replayed, for the summary.
  int64_t cuda_graph_captures = 0, cuda_graph_replays = 0;
  Progress progress;
  DirLock run_dir_lock, checkpoint_dir_lock;  // rank 0 holds them for the job

  /// The default loss, whose evaluation also counts top-1 accuracy.
  bool classifier() const { return !cb.loss && cfg.train.loss == "cross_entropy"; }
  /// parallel.tp > 1: this rank's vocabulary columns of the logits.
  dist::tp::VocabRange vocab_range() const;

 private:
  void build_mesh();
  void refuse_what_pipelines_do_not_serve_yet() const;
  void lock_directories();
  void check_memory_needs();
  std::shared_ptr<models::Model> build_model_on_every_rank(std::optional<models::InputKind> data_kind);
  void build_model_and_data();
  void compile_and_distribute();
  void use_compiled_loss();  // compile.granularity = "blocks": the root's loss from the package
  void check_generators_agree();
  void log_build_memory();
  void build_optimizer();
};

}  // namespace keel
