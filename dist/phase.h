// dist/phase.h: where this rank is in its step (forward of block 3 of stage 1's
// micro-batch 2, the optimizer, a checkpoint commit, an evaluation), for the flight recorder
// (every operation through the collectives' door is stamped with it) and the fault injector (a
// fault can strike on entering a phase).
//
// One rank per process: the phase is the process's, one lock-free 64-bit word (any thread reads
// it: DDP's buckets complete on the backend's threads), written by the thread that drives the
// step. A PhaseScope sets it and puts back the one before; set_block() moves within it. Cost: a
// relaxed store per scope, and a null check for the hook.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

namespace keel::dist {

enum class Phase : uint8_t {
  Idle = 0,          // between the parts below (or before the loop)
  Setup,             // building the run: the initial broadcast, agreements, the compile stage
  Forward,           // a micro-batch's forward (block, stage and micro-batch when known)
  Backward,          // its backward (block as ZeRO-3's units run it; DDP's buckets carry their own)
  Consensus,         // the per-step agreement (loss, inf/NaN verdict, step and plan)
  Optimizer,         // the update and what follows it (ZeRO's parameter gathers)
  Eval,              // evaluation
  CheckpointSave,    // writing a checkpoint
  CheckpointCommit,  // agreeing on it and committing it
  Finish,            // the end of the run (the last agreement, on_end)
};
/// "forward", "checkpoint commit", ... (the flight record's and `keel doctor`'s words).
const char* phase_name(Phase p);
/// The fault injector's `at=` words, which are phase_name's with '_' for ' ' ("checkpoint_commit");
/// Idle when `name` is none of them.
Phase phase_of(const std::string& name);

/// The phase and where in it: -1 where it does not apply.
struct PhaseState {
  Phase phase = Phase::Idle;
  int32_t block = -1;   // the model's block (ZeRO-3's unit, the pipeline's stage block)
  int32_t stage = -1;   // the pipeline stage (its index over the whole pipeline)
  int32_t micro = -1;   // the micro-batch
  int32_t bucket = -1;  // DDP's gradient bucket (an operation's own, set by the door)
  int64_t step = 0;     // the optimizer step

  uint64_t pack() const;  // without the step (a word of its own)
  static PhaseState unpack(uint64_t word, int64_t step);
  /// "backward of block 3 (stage 1, micro-batch 2)"; "forward"; "checkpoint commit".
  std::string describe() const;
};

/// The process's phase now.
PhaseState current_phase();
/// The step the phase belongs to (Mesh::set_step sets it with the collectives').
void set_phase_step(int64_t step);
/// Within the current phase: the block now running (-1: none).
void set_block(int32_t block);

/// Enters `phase` (stage and micro-batch when known; the block is cleared) and calls the hook;
/// the destructor puts back the phase before, unless an exception is unwinding (the phase the run
/// failed in stays for the flight record's dump).
class PhaseScope {
 public:
  explicit PhaseScope(Phase phase, int32_t stage = -1, int32_t micro = -1);
  ~PhaseScope();
  PhaseScope(const PhaseScope&) = delete;
  PhaseScope& operator=(const PhaseScope&) = delete;

 private:
  uint64_t before_;
  int unwinding_;
};

/// Called on the driving thread each time a PhaseScope enters a phase (null: none, the
/// default). The fault injector's seam: it may sleep, throw or end the process.
void set_phase_hook(std::function<void(const PhaseState&)> hook);

}  // namespace keel::dist
