// trainer/fault/fault.h: the fault injector (fault.inject).
//
// Owns: parsing `TYPE@step=S,rank=R[,always][,restart=K][,ms=M][,crash][,phase=P][,sig=N][,twice][,at=A]` entries into
// a plan and answering "does a fault of this type fire on this rank at this step?". A fault fires once per job: not
// again after a torchrun restart (TORCHELASTIC_RESTART_COUNT > 0) unless the entry says `always`; `restart=K` makes it
// fire only in the K-th restart (the chaos test kills a rank once per restart that way). With no entries every query is
// a false on an empty vector: nothing to pay when off. What each type does and the outcome it must have:
// docs/faults.md.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "dist/phase.h"
#include "keel/common/choices.h"

namespace keel {

/// The fault types (docs/faults.md), compared as values; an entry naming another is refused at
/// start with these names.
enum class FaultType {
  CollectiveHang,
  Crash,
  Oom,
  NonfiniteGrad,
  ShapeMismatch,
  CheckpointWriteFailure,
  CheckpointCorruption,
  GraphBreak,
  Straggler,
  Signal
};
inline constexpr Choices<FaultType, 10> kFaultTypes{{{"collective_hang", FaultType::CollectiveHang},
                                                     {"crash", FaultType::Crash},
                                                     {"oom", FaultType::Oom},
                                                     {"nonfinite_grad", FaultType::NonfiniteGrad},
                                                     {"shape_mismatch", FaultType::ShapeMismatch},
                                                     {"checkpoint_write_failure", FaultType::CheckpointWriteFailure},
                                                     {"checkpoint_corruption", FaultType::CheckpointCorruption},
                                                     {"graph_break", FaultType::GraphBreak},
                                                     {"straggler", FaultType::Straggler},
                                                     {"signal", FaultType::Signal}}};

/// Where a `signal` fault is sent.
enum class FaultPhase { Start, Compile, Step, Eval, Save };
inline constexpr Choices<FaultPhase, 5> kFaultPhases{{{"start", FaultPhase::Start},
                                                      {"compile", FaultPhase::Compile},
                                                      {"step", FaultPhase::Step},
                                                      {"eval", FaultPhase::Eval},
                                                      {"save", FaultPhase::Save}}};

struct FaultEntry {
  FaultType type = FaultType::Crash;
  int64_t step = -1;     // optimizer step (1-based) at which it fires
  int64_t rank = -1;     // the rank it fires on
  bool always = false;   // fire again after a restart
  int64_t restart = -1;  // fire only when TORCHELASTIC_RESTART_COUNT == restart (-1: see `always`)
  int64_t ms = 100;      // straggler: milliseconds of sleep per step
  bool crash = false;    // checkpoint_write_failure: SIGKILL halfway through the write, not ENOSPC
  // signal: where it is sent (start, compile, step, eval, save), which signal (SIGTERM, SIGINT,
  // or SIGUSR1: the flight record's dump), and whether a second one follows the first at once.
  FaultPhase phase = FaultPhase::Step;
  int64_t sig = 15;
  bool twice = false;
  // collective_hang, crash, straggler: the phase of the step they strike on entering it (at=forward,
  // backward, consensus, optimizer, eval, checkpoint_save, checkpoint_commit; dist/phase.h);
  // Idle: before the step's consensus, after the backward.
  dist::Phase at = dist::Phase::Idle;
};

class FaultPlan {
 public:
  /// Throws InputError naming the entry for a malformed or unknown entry.
  FaultPlan(const std::vector<std::string>& entries, int64_t world_size);
  /// The entry of `type` for (step, rank) that fires in this restart, or nullptr.
  const FaultEntry* find(FaultType type, int64_t step, int64_t rank, int64_t restart_count) const;
  bool fires(FaultType type, int64_t step, int64_t rank, int64_t restart_count) const {
    return find(type, step, rank, restart_count) != nullptr;
  }
  /// The `signal` entry for (phase, step, rank) in this restart, or nullptr (start and compile
  /// happen once: their entries match any step).
  const FaultEntry* signal(FaultPhase phase, int64_t step, int64_t rank, int64_t restart_count) const;
  /// An entry of `type` active on `rank` at `step` (its step <= step), firing in this restart:
  /// for faults that last (straggler).
  const FaultEntry* active(FaultType type, int64_t step, int64_t rank, int64_t restart_count) const;
  /// Some rank has an entry of `type` at `step` in this restart (for faults every rank must
  /// take part in, such as shape_mismatch's collective).
  const FaultEntry* any_rank(FaultType type, int64_t step, int64_t restart_count) const;
  /// The entry of `type` with at=`phase` for (step, rank) in this restart (straggler: active from
  /// its step on), or nullptr. find() and active() answer for the entries without `at`.
  const FaultEntry* at_phase(FaultType type, dist::Phase phase, int64_t step, int64_t rank,
                             int64_t restart_count) const;
  /// Whether some entry names a phase (at=).
  bool strikes_at_phases() const;
  const std::vector<FaultEntry>& entries() const { return entries_; }
  bool empty() const { return entries_.empty(); }

 private:
  static bool in_restart(const FaultEntry& e, int64_t restart_count);
  std::vector<FaultEntry> entries_;
};

}  // namespace keel
