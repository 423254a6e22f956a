// trainer/checkpoints.h: a run's checkpoints, as the loop uses them.
//
// Owns: registering every component's part of a checkpoint (model, optimizer, progress, grad
// scaler, RNG, user state, graph, sampler), the Checkpointer's options, the resume at start, the
// saves the loop asks for, the commit of an async save, the time the loop stood still for them
// and Callbacks::on_checkpoint (once per newly committed step).
// Does not own: when to save (the loop), the format and its atomicity (checkpoint/), what a
// component stores (its Stateful).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "checkpoint/checkpointer.h"
#include "checkpoint/stateful.h"
#include "trainer/run.h"

namespace keel {

class RunCheckpoints {
 public:
  /// Registers the run's components and, when checkpoint.dir is set, resumes from the newest
  /// committed step (or checkpoint.resume_from). Collective.
  RunCheckpoints(const JobParts& job, ModelParts& net, DataParts& data, UpdateParts& update, Progress& progress);
  RunCheckpoints(const RunCheckpoints&) = delete;
  RunCheckpoints& operator=(const RunCheckpoints&) = delete;

  /// Whether checkpoint.dir is set.
  bool enabled() const { return ckpt_ != nullptr; }
  /// checkpoint.interval: whether `step` (before the last) saves.
  bool due(int64_t step) const;
  /// The step this run resumed from.
  const std::optional<int64_t>& resumed_from() const { return resumed_from_; }
  /// The newest committed step, or -1 (also without checkpointing).
  int64_t last_committed() const { return ckpt_ ? ckpt_->last_committed() : -1; }
  /// An async save whose write this rank has finished, waiting for its commit.
  bool written_uncommitted() const { return ckpt_ && ckpt_->pending() && ckpt_->write_finished(); }
  /// An async save waits for its commit (every rank has written: commit()).
  bool pending() const { return ckpt_ && ckpt_->pending(); }
  /// Collective: commits the pending save, then Callbacks::on_checkpoint.
  void commit();
  /// Collective: saves `step` (rank 0's buffers, each rank its share).
  void save(int64_t step);
  /// Collective, at the end: the final save of `done` steps unless committed, and its commit.
  void finish(int64_t done);
  /// The time the loop stood still for saves (async: the snapshot only).
  double stall_ms() const { return stall_ms_; }

 private:
  void build();
  void resume();
  void notify();

  const JobParts& job_;
  ModelParts& net_;
  DataParts& data_;
  UpdateParts& update_;
  Progress& progress_;
  std::unique_ptr<checkpoint::Checkpointer> ckpt_;
  checkpoint::StateRegistry state_;
  std::vector<std::unique_ptr<checkpoint::Stateful>> owned_state_;
  std::optional<int64_t> resumed_from_;
  int64_t notified_step_ = -1;
  double stall_ms_ = 0;
};

}  // namespace keel
