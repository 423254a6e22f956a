// trainer/trainer.h: the training loop.
//
// Owns: turning a validated Config into a run: seeding, threads, model and data from their
// registries, the sampler, optimizer and schedule, the step loop (micro-batches, gradient
// accumulation, clipping), evaluation, metrics.jsonl / summary.json / config.toml under
// run.dir, the progress line, and a clean stop on SIGINT/SIGTERM after the current step.
// Does not own: what the model or the data are (models/, trainer/data.h), talking to other
// ranks (dist/), precision (amp/), or persistence (checkpoint/).
#pragma once

#include <nlohmann/json.hpp>

#include <functional>
#include <memory>
#include <string>

#include "checkpoint/checkpoint.h"
#include "dist/world.h"
#include "models/model.h"
#include "trainer/config.h"

namespace keel {

struct StepInfo {
  int64_t step = 0;          // optimizer steps done (1-based after the first step)
  double loss = 0;           // mean training loss over the step's micro-batches
  double lr = 0;
  double step_ms = 0;
  double samples_per_s = 0;  // global samples per second for this step
};

struct EvalResult {
  int64_t step = 0;
  double loss = 0;           // mean per-sample (per-token for language models) loss
  double accuracy = 0;       // top-1 accuracy (per token for language models)
  int64_t count = 0;         // samples (tokens) evaluated
};

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
};

class Trainer {
 public:
  /// `cfg` must have passed keel::validate().
  Trainer(Config cfg, dist::World world, Callbacks callbacks = {});
  ~Trainer();
  /// Runs to the end (or to a stop signal) and returns the summary that rank 0 also writes to
  /// <run.dir>/summary.json. Throws keel::InputError for bad input (data, model files) and
  /// std::exception for failures while training.
  nlohmann::json run();

 private:
  struct State;
  std::unique_ptr<State> s_;
};

/// Asks a running Trainer to stop after its current step (what SIGINT/SIGTERM do).
void request_stop(int signo);

}  // namespace keel
