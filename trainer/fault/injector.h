// trainer/fault/injector.h: the one seam through which fault.inject reaches a run.
//
// Owns: what each fault does at its named point of a step (docs/faults.md has the outcome each
// must have): wrapping the model (graph_break), after backward (nonfinite_grad), before the
// step's consensus, around the collectives (straggler, crash, oom, collective_hang,
// shape_mismatch), while a checkpoint is written (checkpoint_write_failure) and after it is
// committed (checkpoint_corruption). The production classes it reaches (Checkpointer,
// Collectives, models) expose only generic seams (checkpoint::Hooks, peer_failure()); none
// carries a fault API. With no entries every hook is a no-op.
// Does not own: parsing the entries (trainer/fault/fault.h), the run's reaction to a fault
// (that is what the faults test).
#pragma once

#include <torch/torch.h>

#include <chrono>
#include <memory>
#include <vector>

#include "checkpoint/checkpointer.h"
#include "keel/dist/collectives.h"
#include "keel/dist/world.h"
#include "keel/models/model.h"
#include "keel/trainer/config/config.h"
#include "trainer/fault/fault.h"

namespace keel {

class FaultInjector {
 public:
  /// `collective_timeout`: dist.timeout_s (a hung rank waits about twice that for its peers to
  /// give up). Throws InputError for entries naming a rank outside the world.
  FaultInjector(const FaultConfig& cfg, const dist::World& world, torch::Device device,
                std::chrono::milliseconds collective_timeout);

  bool empty() const { return plan_.empty(); }
  /// Whether any fault is configured: the loop then checks gradients for inf/NaN even without
  /// a loss scaler, so that an injected one is seen.
  bool watches_gradients() const { return !plan_.empty(); }

  /// Wrapping the model, before place -> compile -> distribute (graph_break).
  std::shared_ptr<models::Model> wrap_model(std::shared_ptr<models::Model> model) const;
  /// After backward of optimizer step `step` (1-based), before unscaling (nonfinite_grad).
  void after_backward(int64_t step, const std::vector<torch::Tensor>& params) const;
  /// After backward, before the step's consensus: the faults that strike the collectives
  /// (straggler, crash, oom, collective_hang, shape_mismatch).
  void before_consensus(int64_t step, dist::Collectives& coll) const;
  /// The entries with at=PHASE strike when this rank enters that phase (dist/phase.h's hook,
  /// kept until this injector goes): collective_hang waits there for `coll`'s peers to give up.
  void strike_at_phases(dist::Collectives& coll);
  ~FaultInjector();
  FaultInjector(const FaultInjector&) = delete;
  FaultInjector& operator=(const FaultInjector&) = delete;
  /// Pipeline parallelism: shape_mismatch strikes a send instead of a collective (the pipelined
  /// step asks sends_another_shape(); the probe collective is not issued).
  void strike_sends_with_shape_mismatch() { shape_mismatch_on_sends_ = true; }
  /// shape_mismatch at `step` on this rank, under strike_sends_with_shape_mismatch(): this rank's
  /// first activation sent that step goes with another shape of the same bytes.
  bool sends_another_shape(int64_t step) const {
    return shape_mismatch_on_sends_ && plan_.fires(FaultType::ShapeMismatch, step, rank_, restart_count_);
  }
  /// signal: sends this process SIGTERM (or SIGINT), once or twice, when an entry names this
  /// phase (start, compile, step, eval; save is sent from the checkpoint hooks) and step.
  void signal(FaultPhase phase, int64_t step) const;
  /// The checkpointer's hooks (checkpoint_write_failure, checkpoint_corruption, signal at save).
  checkpoint::Hooks checkpoint_hooks() const;

 private:
  FaultPlan plan_;
  int64_t rank_, world_size_, restart_count_;
  torch::Device device_;
  std::chrono::milliseconds collective_timeout_;
  bool shape_mismatch_on_sends_ = false;
  bool hooked_ = false;  // strike_at_phases() set the phase hook
  // collective_hang at step `s`: stops taking part until `coll`'s peers give up, then throws.
  [[noreturn]] void hang(int64_t s, dist::Collectives& coll) const;
  [[noreturn]] void crash(int64_t s) const;
};

}  // namespace keel
