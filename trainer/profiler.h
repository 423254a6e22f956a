// trainer/profiler.h: run.profile_steps = "A-B", LibTorch's (Kineto) profiler over steps A to
// B on every rank, saved as a Chrome trace, <run.dir>/trace.rank<R>.json, that Perfetto and
// chrome://tracing open.
//
// Owns: parsing the step range, starting the profiler before step A and stopping and saving
// it after step B (or when the run ends first). The loop marks its regions with user scopes
// (keel::forward, keel::backward, keel::consensus, keel::optimizer); c10d names its
// collectives (gloo:all_reduce, ...). Off (""), it costs one comparison per step.
// A trace that cannot be written (a directory in the way, a read-only or full run.dir) is a
// warning naming the file and why, never reported as written; training goes on. The trace
// is saved to a temporary file beside it, checked, and renamed onto the name.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>

#include "keel/trainer/config/config.h"  // parse_profile_steps

namespace keel {

class StepProfiler {
 public:
  /// `range` from parse_profile_steps (nullopt: off); the trace goes to `path`.
  StepProfiler(std::optional<std::pair<int64_t, int64_t>> range, std::string path, const torch::Device& device);
  ~StepProfiler();
  StepProfiler(const StepProfiler&) = delete;
  StepProfiler& operator=(const StepProfiler&) = delete;

  void before_step(int64_t step) {
    if (range_ && step == range_->first && !active_) start();
  }
  void after_step(int64_t step) {
    if (active_ && step >= range_->second) stop();
  }
  /// Stops and saves a trace still being recorded (the run ended before step B).
  void finish() {
    if (active_) stop();
  }

 private:
  void start();
  void stop();
  std::optional<std::pair<int64_t, int64_t>> range_;
  std::string path_;
  bool cuda_ = false;
  bool active_ = false;
};

}  // namespace keel
