// keel/trainer/trainer.h: the training loop, and keel's main public entry point.
//
// Owns: turning a validated Config into a run: seeding, threads, model and data from their
// registries, the sampler, optimizer and schedule, the step loop (micro-batches, gradient
// accumulation, clipping), evaluation, metrics.jsonl / summary.json / config.toml under
// run.dir, the progress line, and a clean stop on SIGINT/SIGTERM after the current step.
// Does not own: what the model or the data are (models/, trainer/data/), talking to other
// ranks (dist/), precision (amp/), persistence (checkpoint/), or faults (trainer/fault/).
//
//   #include <keel/trainer/trainer.h>
//   keel::Config cfg;  ...  keel::validate(cfg);
//   keel::Summary s = keel::Trainer(cfg, keel::dist::detect_world(keel::dist::current_env())).run();
#pragma once

#include <torch/torch.h>

#include <nlohmann/json.hpp>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "keel/checkpoint/checkpoint.h"
#include "keel/dist/world.h"
#include "keel/models/model.h"
#include "keel/trainer/config/config.h"

namespace keel {

struct StepInfo {
  int64_t step = 0;  // optimizer steps done (1-based after the first step)
  double loss = 0;   // mean training loss over the step's micro-batches and ranks
  double lr = 0;
  double step_ms = 0;
  double samples_per_s = 0;  // global samples per second for this step
};

struct EvalResult {
  int64_t step = 0;
  double loss = 0;      // mean per-sample (per-token for language models) loss
  double accuracy = 0;  // top-1 accuracy (per token for language models); NaN with a custom loss
  int64_t count = 0;    // samples (tokens) evaluated
};

/// What run() returns and rank 0 writes to <run.dir>/summary.json (to_json() is that file's
/// content; its field names are a contract: docs/getting-started.md).
struct Summary {
  std::string keel_version, torch_version;
  std::string run_name, model, data, device;
  int64_t num_parameters = 0;
  int64_t world_size = 1;
  std::string launcher;            // torchrun | mpirun | srun | single
  std::string backend;             // gloo | nccl | none (one rank)
  int64_t restart_count = 0;       // torchrun restarts before this run
  int64_t metrics_lines_lost = 0;  // metrics.jsonl lines that could not be written
  int64_t threads_per_rank = 0;
  int64_t batch_size = 0, grad_accum = 0, global_batch = 0;
  int64_t steps = 0;  // optimizer steps done
  int64_t planned_steps = 0;
  bool completed = false;              // every planned step done and no stop signal
  std::optional<int> stop_signal;      // SIGINT/SIGTERM that stopped the run
  double median_step_ms = 0;           // over the steps after the first 5 (warm-up)
  double samples_per_s = 0;            // global samples per second at the median step time
  std::optional<double> tokens_per_s;  // language models
  double final_loss = 0;               // NaN when no step ran
  double wall_s = 0;                   // run() from start to end, seconds
  std::string compile_mode;            // off | trace | eager-fallback
  double compile_ms = 0;
  std::string compile_cache;  // off | hit | miss | checkpoint (inductor: the package stored with the checkpoint)
  int64_t recompiles = 0;
  std::string amp_dtype;             // off | bf16 | fp16
  std::string consensus;             // step | late: when the host read the per-step consensus (dist.consensus)
  std::optional<double> loss_scale;  // GradScaler's scale at the end (dynamic loss scaling)
  int64_t skipped_steps = 0;         // steps skipped on every rank for inf/NaN
  std::optional<int64_t> resumed_from_step;
  std::optional<int64_t> checkpoint_step;          // the newest committed checkpoint
  double checkpoint_stall_ms = 0;                  // time saves blocked the loop
  std::optional<double> test_accuracy, test_loss;  // the last evaluation
  double rendezvous_ms = 0;                        // process group creation and the cross-rank config check
  double eta_s = 0;                                // at the last log line: steps left x the recent median step time
  std::optional<double> mfu;                       // at the last log line (models that report FLOPs), 0..1
  std::optional<double> peak_tflops;               // MFU's denominator per rank (run.peak_tflops or measured)
  int64_t zero = 0;                                // dist.zero
  int64_t optimizer_state_bytes = 0;  // the optimizer state this rank holds (its partition with dist.zero >= 1)
  double peak_rss_mb = 0;             // this process's peak resident set (getrusage), MiB
  /// keel's control traffic per step on this rank over this run's loop (the consensus,
  /// validation probes, checkpoint coordination, evaluation totals; not DDP's gradients).
  struct Control {
    double collectives = 0, probes = 0, bytes_sent = 0, bytes_received = 0, wait_ms = 0;
    int64_t steps = 0;  // the steps averaged over
  } control_per_step;

  nlohmann::json to_json() const;
};

/// The training loss of one micro-batch: (model output, target) -> scalar tensor, the mean over
/// the batch. Called under autocast when amp.dtype is set.
using LossFn = std::function<torch::Tensor(const torch::Tensor& output, const torch::Tensor& target)>;

/// Registers a loss under `name` (train.loss in the config), as models are registered
/// (models/model.h): thread-safe, each name once (std::invalid_argument otherwise, built-ins
/// included). Built in: cross_entropy (over the last dimension; evaluation also reports top-1
/// accuracy). With any other loss, evaluation reports its mean over the test split and no accuracy.
void register_loss(const std::string& name, LossFn loss);
std::vector<std::string> registered_losses();

/// A learning-rate schedule: the rate of optimizer step `step` (0-based: the rate used by the step
/// that brings the count from `step` to `step + 1`) of `total`, from the [train] section (lr,
/// min_lr, warmup_steps are yours to use). A pure function of the step, so a resume needs no
/// schedule state.
/// An optimizer of your own, or one of torch::optim's, chosen by `train.optimizer = "<name>"` as
/// adamw and sgd are: `make` builds it over `params` (this rank's; with dist.zero >= 1 only the
/// parameters it owns) from [train]'s keys. keel sets its learning rate every step through
/// `OptimizerOptions::set_lr` (the schedule), steps it when no rank saw an inf/NaN, and
/// checkpoints its per-parameter state through the state's own `serialize()`: each field
/// becomes "<parameter>.<field>" in the optimizer files, sharded and re-partitioned with
/// dist.zero like AdamW's. A field must be a tensor shaped like its parameter or an integer
/// step count (what torch::optim's states hold); another kind is refused at start, naming it.
/// `make_state` makes an empty per-parameter state to load into: register with
/// `register_optimizer<torch::optim::AdagradParamState>(name, make)`.
using OptimizerFn = std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<torch::Tensor> params,
                                                                           const TrainConfig& train)>;
using OptimizerStateFn = std::function<std::unique_ptr<torch::optim::OptimizerParamState>()>;
void register_optimizer(const std::string& name, OptimizerFn make, OptimizerStateFn make_state);
template <class ParamState>
void register_optimizer(const std::string& name, OptimizerFn make) {
  register_optimizer(name, std::move(make), [] { return std::make_unique<ParamState>(); });
}
std::vector<std::string> registered_optimizers();

using ScheduleFn = std::function<double(int64_t step, int64_t total, const TrainConfig& train)>;
/// Registers a schedule under `name` (train.schedule), as register_loss. Built in: cosine
/// (linear warmup, then cosine from lr to min_lr) and constant (linear warmup, then lr).
void register_schedule(const std::string& name, ScheduleFn schedule);
std::vector<std::string> registered_schedules();

/// Hooks called on every rank, on the training thread, between steps. They must not throw.
struct Callbacks {
  std::function<void(const StepInfo&)> on_step;
  std::function<void(const EvalResult&)> on_eval;
  /// After the last step (or a stop signal), with the trained model.
  std::function<void(models::Model&)> on_end;
  /// After a checkpoint is committed on every rank: its step and directory.
  std::function<void(int64_t step, const std::string& dir)> on_checkpoint;
  /// Your own state in the trainer's checkpoints. save_state is called when a checkpoint is
  /// taken: add replicated tensors to `state.extra`, small values under
  /// `state.shared["user"]`, and this rank's own tensors to `state.rank_tensors` (names not
  /// starting with "rng."). load_state is called on resume with what was saved (`extra`,
  /// `shared`, and this rank's `rank_tensors` when the saved job had this rank).
  std::function<void(checkpoint::State& state)> save_state;
  std::function<void(const checkpoint::State& state)> load_state;
  /// The training and evaluation loss, overriding train.loss. Empty: train.loss's (default
  /// cross-entropy over the last dimension: logits (..., C), target (...) int64, with top-1
  /// accuracy reported). With your own loss, evaluation reports the mean of it over the test
  /// split and no accuracy (NaN / null). register_loss lets a config file choose it by name.
  LossFn loss;
};

class Trainer {
 public:
  /// `cfg` must have passed keel::validate().
  Trainer(Config cfg, dist::World world, Callbacks callbacks = {});
  ~Trainer();
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;
  /// Runs to the end (or to a stop signal) and returns the summary that rank 0 also writes to
  /// <run.dir>/summary.json. Throws keel::InputError for bad input (data, model files) and
  /// std::exception for failures while training. Call once.
  Summary run();

 private:
  class Loop;
  Config cfg_;
  dist::World world_;
  Callbacks callbacks_;
};

/// Asks a running Trainer to stop after its current step (what SIGINT/SIGTERM do).
void request_stop(int signo);

/// The `keel` command line (keel train, inspect, compile, ...; docs/getting-started.md) in your
/// own binary, with the models, datasets, losses and schedules you registered:
/// `int main(int argc, char** argv) { return keel::run_cli(argc, argv); }`. Returns the exit
/// code: 0 success, 2 bad usage or input (config, data, model files), 1 a failure while
/// running, 128+N stopped by signal N.
int run_cli(int argc, char** argv);

}  // namespace keel
