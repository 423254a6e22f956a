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

// summary.json's fields, declared once: each X(type, name, initial value, absent, doc) is a
// member of Summary and the key of summary.json that holds it (its name is a contract: scripts
// read it); docs/summary.md (`keel summary-reference`) is made from the same list. `absent` is
// how an empty optional is written: `null`, or `omit` (the key is left out).
#define KEEL_SUMMARY_FIELDS(X)                                                                                         \
  X(std::string, keel_version, , null, "keel's version")                                                               \
  X(std::string, torch_version, , null, "the LibTorch version keel was built with")                                    \
  X(std::string, run_name, , null, "run.name")                                                                         \
  X(std::string, model, , null, "model.name")                                                                          \
  X(int64_t, num_parameters, 0, null, "the model's parameters (elements)")                                             \
  X(std::string, data, , null, "data.name")                                                                            \
  X(std::string, device, , null, "the device rank 0 trained on (cpu, cuda:0)")                                         \
  X(int64_t, world_size, 1, null, "ranks in the job")                                                                  \
  X(std::string, launcher, , null, "torchrun, mpirun, srun or single")                                                 \
  X(std::string, backend, , null, "gloo, nccl, or none (one rank without a process group)")                            \
  X(int64_t, restart_count, 0, null, "torchrun restarts before this run")                                              \
  X(int64_t, metrics_lines_lost, 0, null, "metrics.jsonl lines that could not be written (a full disk)")               \
  X(int64_t, threads_per_rank, 0, null, "intra-op threads of each rank")                                               \
  X(int64_t, batch_size, 0, null, "train.batch_size: samples per micro-batch and rank")                                \
  X(int64_t, grad_accum, 0, null, "train.grad_accum: micro-batches per optimizer step")                                \
  X(int64_t, global_batch, 0, null, "samples per optimizer step over all ranks")                                       \
  X(int64_t, steps, 0, null, "optimizer steps done, resumed ones included")                                            \
  X(int64_t, planned_steps, 0, null, "the steps train.steps or train.epochs asked for")                                \
  X(bool, completed, false, null, "every planned step done and no stop signal")                                        \
  X(std::optional<int>, stop_signal, , null, "the signal (SIGINT 2, SIGTERM 15) that stopped the run, else null")      \
  X(double, median_step_ms, 0, null, "median step time over the steps after the first 5 (warm-up)")                    \
  X(double, samples_per_s, 0, null, "global samples per second at the median step time")                               \
  X(std::optional<double>, tokens_per_s, , omit, "global tokens per second at the median step time (language models)") \
  X(double, final_loss, 0, null,                                                                                       \
    "the training loss of the last step (NaN in Summary, null in the file, when no step ran)")                         \
  X(double, wall_s, 0, null, "run() from start to end, seconds")                                                       \
  X(std::string, compile_mode, , null, "off, trace, inductor or eager-fallback")                                       \
  X(double, compile_ms, 0, null, "time spent compiling (or loading a compiled package)")                               \
  X(std::string, compile_cache, , null,                                                                                \
    "off, hit, miss, waited (another process packaged it, or took it from a checkpoint, while this one waited), or "   \
    "checkpoint (the package stored with the checkpoint)")                                                             \
  X(int64_t, recompiles, 0, null, "recompilations after the first compile")                                            \
  X(std::optional<int64_t>, cuda_graph_captures, , null,                                                               \
    "compile.cuda_graphs: graphs captured (a forward-backward per batch shape, the update), else null")                \
  X(std::optional<int64_t>, cuda_graph_replays, , null, "compile.cuda_graphs: graph replays, else null")               \
  X(std::string, amp_dtype, , null, "off, bf16 or fp16")                                                               \
  X(std::string, consensus, , null, "step or late: when the host read the per-step consensus (dist.consensus)")        \
  X(std::optional<double>, loss_scale, , null, "the GradScaler's scale at the end (fp16), else null")                  \
  X(int64_t, skipped_steps, 0, null, "steps skipped on every rank for an inf/NaN gradient")                            \
  X(std::optional<int64_t>, resumed_from_step, , null, "the checkpoint step this run resumed from, else null")         \
  X(std::optional<int64_t>, checkpoint_step, , null, "the newest committed checkpoint step, else null")                \
  X(double, checkpoint_stall_ms, 0, null, "time checkpoint saves blocked the loop")                                    \
  X(std::optional<double>, test_accuracy, , omit, "top-1 accuracy of the last evaluation (NaN with a custom loss)")    \
  X(std::optional<double>, test_loss, , omit, "the loss of the last evaluation")                                       \
  X(double, rendezvous_ms, 0, null, "process group creation and the cross-rank config agreement")                      \
  X(double, eta_s, 0, null, "at the last log line: steps left x the recent median step time")                          \
  X(std::optional<double>, mfu, , null,                                                                                \
    "model FLOPs utilisation at the last log line, 0..1 (models that count FLOPs)")                                    \
  X(std::optional<double>, peak_tflops, , null, "MFU's denominator per rank (run.peak_tflops or measured)")            \
  X(int64_t, zero, 0, null, "dist.zero")                                                                               \
  X(int64_t, parameter_bytes, 0, null, "the model parameters this rank holds")                                         \
  X(int64_t, gradient_bytes, 0, null,                                                                                  \
    "the gradient memory this rank holds after the last step: the distinct storages of the parameters' gradients "     \
    "(DDP's buckets, which the gradients are views of)")                                                               \
  X(int64_t, optimizer_state_bytes, 0, null, "the optimizer state this rank holds (its partition with dist.zero)")     \
  X(double, peak_rss_mb, 0, null, "this process's peak resident set (getrusage), MiB")                                 \
  X(std::optional<double>, peak_device_memory_mb, , null,                                                              \
    "CUDA: the peak memory allocated on this rank's device (the caching allocator's peak), MiB; null on the CPU")      \
  X(std::optional<double>, cpu_tensor_peak_mb, , null,                                                                 \
    "run.count_tensor_memory: the most bytes of CPU tensors alive at once in this process since the count began "      \
    "(the first run with the key on), MiB; else null")                                                                 \
  X(std::optional<double>, cpu_tensor_end_mb, , null,                                                                  \
    "run.count_tensor_memory: the bytes of CPU tensors alive on this rank at the end (model, gradients, optimizer "    \
    "state, data), MiB; else null")                                                                                    \
  X(ControlTraffic, control_per_step, , null,                                                                          \
    "keel's collectives per step on this rank over the loop, on every mesh axis (the consensus, validation probes, "   \
    "checkpoint coordination, evaluation totals, ZeRO's gathers and reduce-scatters, tensor parallelism's "            \
    "collectives; not DDP's gradient buckets)")

// summary.json's control_per_step, as KEEL_SUMMARY_FIELDS.
#define KEEL_CONTROL_TRAFFIC_FIELDS(X)                                                           \
  X(double, collectives, 0, null, "keel's collectives per step")                                 \
  X(double, validation_probes, 0, null, "of them, collective validation probes (dist.validate)") \
  X(double, bytes_sent, 0, null, "bytes this rank sent per step")                                \
  X(double, bytes_received, 0, null, "bytes this rank received per step")                        \
  X(double, wait_ms, 0, null, "time per step waiting on them")                                   \
  X(int64_t, steps, 0, null, "the steps averaged over")

#define KEEL_SUMMARY_MEMBER(type, name, init, absent, doc) type name{init};

struct ControlTraffic {
  KEEL_CONTROL_TRAFFIC_FIELDS(KEEL_SUMMARY_MEMBER)
};

/// What run() returns and rank 0 writes to <run.dir>/summary.json: one member per key, each
/// described in KEEL_SUMMARY_FIELDS above and docs/summary.md.
struct Summary {
  KEEL_SUMMARY_FIELDS(KEEL_SUMMARY_MEMBER)
  /// summary.json's content.
  nlohmann::json to_json() const;
  /// Every key of summary.json as Markdown (docs/summary.md).
  static std::string reference_markdown();
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
  /// After the last step (or a stop signal), with the trained model. With dist.zero = 3 the
  /// whole model is gathered for it (on every rank when any rank sets on_end: the gathers are
  /// collective); without one, the ranks end with their shards only.
  std::function<void(models::Model&)> on_end;
  /// After a checkpoint is committed on every rank: its step and directory.
  std::function<void(int64_t step, const std::string& dir)> on_checkpoint;
  /// Your own state in the trainer's checkpoints: the component "user" of every step. save_state
  /// is called when a checkpoint is taken: add tensors (Placement::Replicated: the same on
  /// every rank; Owned: this rank's alone; PerRank: each rank its own, restored to the same
  /// rank) and small values (`values`, the same on every rank; `rank_values`, this rank's).
  /// load_state is called on resume with what was saved (this rank's per-rank part when the
  /// saved job had this rank). A step written by keel 0.1 (format 1) hands you all of its
  /// shared values (yours under the key you used) and its "extra" tensors. With dist.zero = 3
  /// the model's parameters are sharded (empty tensors) while save_state and load_state run.
  std::function<void(checkpoint::Component& mine)> save_state;
  std::function<void(const checkpoint::LoadedComponent& mine)> load_state;
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
