// dist/pipeline/schedule.h: pipeline schedules as values (issue 66 item 3): which rank runs which
// stage's forward, backward (or, in the zero-bubble family, input and weight gradients) for which
// micro-batch, in which order, and the sends and receives between the ranks that this implies;
// checked without a model by a simulator that runs every rank's list tick by tick with a FIFO
// per pair of ranks (as Gloo and NCCL match point-to-point messages), so that a schedule that
// would deadlock, or whose receives a peer sends in another order, is found before anything runs.
//
// Owns: the generators (PyTorch 2.11's torch.distributed.pipelining schedules, ported one for one:
// GPipe, 1F1B, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble, DualPipeV), the
// lowering that adds the
// sends and receives (PyTorch's _add_send_recv: receives are placed by their sender, so every pair
// of ranks has one order), the checks of a schedule (each stage on one rank; every micro-batch's
// forward once, its backward once, input before weight gradients), the simulator and the table
// `keel train --print-schedule` will print. No torch: plain data.
// Does not own: running a schedule (the pipelined step), point-to-point itself (dist/).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace keel::dist::pipeline {

/// F forward; B full backward; I the backward's input gradient and W its weight gradients (the
/// zero-bubble split); the point-to-point that carries an activation forward (F) or its gradient
/// back (B).
enum class Op : uint8_t { F, B, I, W, SendF, RecvF, SendB, RecvB };

struct Action {
  int32_t stage = 0;
  Op op = Op::F;
  int32_t mb = 0;  // micro-batch
  bool operator==(const Action& o) const { return stage == o.stage && op == o.op && mb == o.mb; }
  bool operator!=(const Action& o) const { return !(*this == o); }
  /// PyTorch's text form: "2F0" (stage 2's forward of micro-batch 0), "1SEND_B3".
  std::string str() const;
};

struct Schedule {
  std::string name;
  int pp = 1;                                // ranks of the pp axis
  int stages = 1;                            // pp x virtual stages per rank
  int microbatches = 1;                      // per step (train.grad_accum)
  std::vector<int> stage_rank;               // stage -> the rank that holds it
  std::vector<std::vector<Action>> compute;  // per rank, its compute actions in order
  std::vector<std::vector<Action>> lowered;  // per rank, with the sends and receives
  /// One line per rank: "rank 0: 0F0 0SEND_F0 0F1 ..." (the lowered lists).
  std::string table() const;
};

/// The schedules make_schedule knows, in the order keel lists them.
const std::vector<std::string>& schedule_names();

/// The schedule `name` for `pp` ranks, `microbatches` per step and `virtual_stages` stages per rank
/// (gpipe and 1f1b: 1), lowered. Throws std::invalid_argument naming what does not fit (an unknown
/// name, fewer micro-batches than 1f1b needs, virtual stages a schedule does not take, micro-batches
/// the interleaved schedules cannot split into rounds), for the caller to name its config keys.
Schedule make_schedule(const std::string& name, int pp, int microbatches, int virtual_stages = 1);

/// Throws std::logic_error naming the rank and action where `s` breaks a rule: a stage on another
/// rank than its own; a micro-batch's forward missing or twice; its backward (B, or I) missing or
/// twice, or before its forward; a W without its I before it.
void validate(const Schedule& s);

/// What running `s.lowered` tick by tick gave: one action per rank per tick; a compute action when
/// what it reads is there (its forward's input: stage 0, the previous stage on this rank, or its
/// receive; its backward's: its forward and the next stage's backward, or its receive); a send at
/// once (asynchronous); a receive when the message at the head of the FIFO from its peer is the one
/// it expects (another message first: it waits, and if nothing moves, that is the deadlock).
struct SimResult {
  bool deadlock = false;
  std::string blocked;  // on a deadlock: each rank's next action and what it waits for
  int ticks = 0;        // until every rank finished
  /// Per rank: the largest number of micro-batches whose forward ran and whose backward (B or I)
  /// had not yet (the activations it holds at once).
  std::vector<int> peak_in_flight;
  /// Idle ticks of compute over all ranks' ticks (sends and receives count as idle).
  double bubble = 0;
};
SimResult simulate(const Schedule& s);

}  // namespace keel::dist::pipeline
