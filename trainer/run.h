// trainer/run.h: the set-up of one training run, from the config to a model ready to step.
//
// Owns: building a run's components in their fixed order (threads, device, the rendezvous and
// the config's agreement, the mesh, the directory locks, the memory estimate, the model, the
// data and the GradScaler, place -> compile -> distribute, the optimizer and its schedule), each
// step a named function below, each agreed across ranks where a rank alone could fail; what it
// builds, held in parts (the job, the model, the data, the update, the progress, the graph
// counts), each component taking the parts it uses. Does not own: checkpointing and resume (trainer/checkpoints.h), the
// outputs (trainer/report.h), what a step does (trainer/step/step.h), the loop (trainer/trainer.cpp).
#pragma once

#include <torch/torch.h>

#include <memory>
#include <optional>
#include <vector>

#include "amp/grad_scaler.h"
#include "common/clock.h"
#include "common/file.h"
#include "dist/flight.h"
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

// What the components of a run read of it, passed explicitly (issue 66 item 1): each of the loop,
// the step, the checkpoints and the report takes the parts it uses, not the whole run.

/// Where the run runs: the config, the ranks, the device, the groups, the fault plan.
struct JobParts {
  JobParts(const Config& c, const dist::World& w, const Callbacks& b) : cfg(c), world(w), cb(b) {}
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
  dist::FlightRecorder* flight = nullptr;  // dist.flight_recorder (Trainer::run owns it; null: off)
  /// The default loss, whose evaluation also counts top-1 accuracy.
  bool classifier() const { return !cb.loss && cfg.train.loss == "cross_entropy"; }
};

/// The model as it trains: eager, placed, compiled and distributed, and its loss.
struct ModelParts {
  AmpContext amp;
  std::shared_ptr<models::Model> model;  // the eager model (evaluation, checkpoints)
  std::shared_ptr<PythonModel> python;   // model.name = "python": model's core, evaluated through the package
  int64_t num_parameters = 0;            // the model's, as built (dist.zero = 3 empties its own)
  models::InputSpec spec;
  std::optional<DistributedModel> dmodel;
  std::vector<torch::Tensor> params;  // the model's
  std::vector<torch::Tensor> owned;   // the parameters this rank's optimizer updates (dist.zero)
  LossFn loss;
  /// parallel.tp > 1: this rank's vocabulary columns of the logits.
  dist::tp::VocabRange vocab_range(const dist::Mesh& mesh) const;
};

/// The data: the splits and the sampler that deals the training one to the ranks.
struct DataParts {
  data::Splits splits;
  std::unique_ptr<data::DistributedSampler> sampler;
};

/// The update: the optimizer, its checkpoint part, the learning-rate schedule, the GradScaler.
struct UpdateParts {
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  FusedOptimizer* fused = nullptr;                  // optimizer, when fused (the update can skip on the device)
  std::unique_ptr<OptimizerState> optimizer_state;  // its checkpoint part (partitioned with dist.zero)
  std::optional<LrSchedule> schedule;
  std::unique_ptr<amp::GradScaler> scaler;
  bool late = false;  // dist.consensus resolved: the consensus is read one step late
};

/// compile.cuda_graphs (trainer/step/graphs.h): graphs captured (forward-backward per batch shape,
/// the update) and replayed, for the summary.
struct GraphCounts {
  int64_t captures = 0, replays = 0;
};

/// The components of one run, built by the constructor in the order above; the loop owns it and
/// hands each component its parts. Collective: every rank constructs its Run together.
struct Run {
  Run(const Config& cfg, const dist::World& world, const Callbacks& cb, dist::FlightRecorder* flight = nullptr);
  Run(const Run&) = delete;
  Run& operator=(const Run&) = delete;

  JobParts job;
  ModelParts net;
  DataParts data;
  UpdateParts update;
  Progress progress;
  GraphCounts graphs;

 private:
  /// model.sharded_init: the model's parameters not made yet (models/deferred_init.h), until
  /// place() or, at dist.zero = 3, distribute() makes this rank's shards of them; else null.
  std::shared_ptr<models::DeferredInit> deferred;
  double rss_before_model_mib = 0;                  // the process's peak resident memory before the model was built
  std::optional<OptimizerChoice> optimizer_choice;  // train.optimizer, resolved at start
  DirLock run_dir_lock, checkpoint_dir_lock;        // rank 0 holds them for the job

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
