// trainer/report.h: what a run tells people and scripts while and after it trains.
//
// Owns: opening the run's outputs (run.dir's config.toml, metrics.jsonl and TensorBoard through
// RunMetrics, the profiler's traces, the start-up log lines and MFU's peak), each step's record
// (its scalars, each once: metrics.jsonl key and TensorBoard tag; Callbacks::on_step), the last
// evaluation, the control traffic and steps counted from the loop's start, and summary.json's
// content (Summary) at the end.
// Does not own: the per-line writers (trainer/metrics.h), when to evaluate or stop (the loop).
#pragma once

#include <memory>
#include <optional>

#include "keel/dist/collectives.h"
#include "keel/trainer/trainer.h"
#include "trainer/checkpoints.h"
#include "trainer/metrics.h"
#include "trainer/profiler.h"
#include "trainer/run.h"
#include "trainer/step/step.h"

namespace keel {

class RunReport {
 public:
  /// Rank 0 writes run.dir/config.toml; every rank opens its outputs and logs the run's shape.
  RunReport(const JobParts& job, const ModelParts& net, const DataParts& data, const UpdateParts& update,
            const Progress& progress, const GraphCounts& counts, const std::optional<int64_t>& resumed_from);
  RunReport(const RunReport&) = delete;
  RunReport& operator=(const RunReport&) = delete;

  /// Marks the loop's start: the steps and the control traffic before it (set-up, resume) are
  /// not the loop's.
  void loop_begins();
  int64_t steps_at_loop() const { return steps_at_loop_; }
  /// The step's record to metrics.jsonl, TensorBoard, the progress and log lines, on_step.
  void log_step(const StepResult& r, const std::optional<EvalResult>& eval);
  /// An evaluation: kept for the summary, logged, and given to Callbacks::on_eval.
  const EvalResult& evaluated(EvalResult e, bool log);
  RunMetrics& metrics() { return metrics_; }
  StepProfiler* profiler() { return profiler_.get(); }
  /// summary.json's content; `stop_signal`: the signal that stopped the run (0: none).
  Summary summary(const RunCheckpoints& ckpts, int stop_signal) const;

 private:
  StepRecord step_record(const StepResult& r, const std::optional<EvalResult>& eval) const;
  void watch_gradients(const StepResult& r);

  const JobParts& job_;
  const ModelParts& net_;
  const DataParts& data_;
  const UpdateParts& update_;
  const Progress& progress_;
  const GraphCounts& counts_;
  RunMetrics metrics_;                      // metrics.jsonl, TensorBoard, the log line, step times
  std::unique_ptr<StepProfiler> profiler_;  // run.profile_steps
  std::optional<EvalResult> last_eval_;
  dist::TrafficStats traffic_at_loop_;  // the control traffic before the loop (setup, resume)
  int64_t steps_at_loop_ = 0;
  int64_t zero_gradient_steps_ = 0;  // steps with lr > 0 whose gradients were all exactly 0
};

}  // namespace keel
