// dist/fsdp.h: dist.zero = 3, parameters sharded at rest (as PyTorch's FSDP2 fully_shard and
// DeepSpeed's ZeRO-3; docs/zero.md); and dist.zero = 2, the same layout with the parameters kept
// whole (DeepSpeed's ZeRO-2; FSDP2's SHARD_GRAD_OP): only the gradients and optimizer state are
// sharded.
//
// Owns, for one model: the tensors of a Placement's units (dist/placement.h: one flat buffer per
// block and a root unit, cut into W equal shards, rank r holding elements [r S, (r + 1) S), a
// shard possibly splitting a parameter); gathering a unit's parameters before it runs and freeing
// them after; reduce-scattering its gradients after its backward; the pieces of each parameter
// this rank owns (Placement::pieces), on which the optimizer, clipping and the non-finite check
// work. Does not own: the layout (dist/placement.h), the optimizer (trainer/), the collectives
// (dist/collectives.h, through which every gather and reduce-scatter goes: validated one by one,
// or as a schedule, below).
//
// One micro-batch:
//   before_forward()  gathers the root unit (kept until after_backward, or reshard() after an
//                     evaluation's forwards) and starts block 0's
//   enter(i)          waits for block i's gather and starts block i + 1's (the prefetch)
//   leave(i)          frees block i's parameters (their memory; autograd's saved tensors keep
//                     pointing at it, and it is gathered again before they are read); the last
//                     block's stay while training, for the backward that begins with them
//   backward of leave(i)   gathers block i again (and starts block i - 1's)
//   backward of enter(i)   the block's gradients are complete: reduce-scattered (pre-divided by
//                          the world size, as DDP averages), the full gradients and parameters freed
//   after_backward()  the root unit's reduce-scatter; waits for every reduce-scatter and adds
//                     each rank's sums into its gradient shard (so micro-batches accumulate)
// Between steps a rank holds its parameter and gradient shards only; the model's parameter
// tensors are empty (0 elements) then; hold() makes them whole until reshard().
//
// Stage 2 (the placement does not shard parameters): each unit's flat buffer is always whole, the model's
// parameters are views of it and this rank's shard is its own range of it (so the optimizer's
// update of a piece is the model's parameter); nothing is gathered or freed around a block.
// Micro-batches that do not sync accumulate full gradients locally (as DDP's no_sync); on the
// step's last one each block's summed gradients are reduce-scattered as its backward completes
// and freed, so between steps a rank holds its gradient shard only. After the optimizer step
// sync_parameters() all-gathers every unit's shards into the whole buffers.
#pragma once

#include <torch/torch.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "dist/placement.h"
#include "dist/sharded_parameters.h"
#include "keel/dist/collectives.h"
#include "keel/models/model.h"
#include "models/deferred_init.h"

namespace keel::dist {

class FullyShard final : public models::BlockHooks, public ShardedParameters {
 public:
  /// Collective in that every rank must make it from the same (already broadcast) parameters.
  /// `placement`: stage 2 or 3 over this model and world. `reduce_in_order` (dist.find_unused_parameters):
  /// every unit is reduce-scattered after the backward, in unit order, whether or not this rank
  /// produced gradients for it (so ranks that skip different blocks still pair their
  /// collectives), instead of each block as its backward completes. Parameters on another device
  /// than the process group's (Gloo with CUDA tensors: two ranks sharing a GPU) are gathered and
  /// reduce-scattered through copies on the group's device.
  /// `deferred` (sharded initialisation, stage 3): parameters not made yet; this rank makes only
  /// the elements of its shards (models/deferred_init.h), and no rank holds a whole unit.
  FullyShard(std::shared_ptr<models::Model> model, std::shared_ptr<Collectives> coll, Placement placement,
             bool reduce_in_order = false, models::DeferredInit* deferred = nullptr);
  ~FullyShard() override;

  torch::Tensor enter(size_t block, const torch::Tensor& input) override;
  torch::Tensor leave(size_t block, const torch::Tensor& output) override;
  /// Before each forward (training or evaluation). `sync`: the step's last micro-batch (stage 3
  /// reduce-scatters every micro-batch's gradients; stage 2 only the last's, summed). `step`: a
  /// training micro-batch of the trainer's loop, whose forward, loss, loss.backward() and
  /// after_backward() issue no collective but this class's: its collectives may be validated as
  /// a schedule (below) instead of one by one.
  void before_forward(bool sync = true, bool step = false);
  /// After each micro-batch's loss.backward().
  void after_backward();
  /// Stage 2, after the optimizer step (collective; a no-op at stage 3): every rank's updated
  /// shard into every rank's whole parameters.
  void sync_parameters();
  /// Gathers every unit into the model's parameters and keeps them there (the end of training,
  /// for Callbacks::on_end) until reshard(), which frees them again (at stage 3 what was written
  /// into them meanwhile is lost: a resume loads the pieces, load_pieces()).
  void hold();
  void reshard();
  /// A pipeline stage's step (dist.zero >= 2 at parallel.pp > 1: micro-batches interleave forwards
  /// and backwards, so no block's gradients are complete before the schedule ends): hold() for the
  /// schedule (every unit gathered, the hooks idle: the micro-batches' gradients accumulate whole,
  /// as PyTorch's pipelining runs FSDP with its sync off), then this (collective): every unit's
  /// accumulated gradients reduce-scattered (pre-divided by the world size, as DDP averages) and
  /// added into this rank's gradient shard, the whole gradients freed; then reshard().
  void reduce_accumulated();

  /// Checkpoints (collective). `piece_state`: the optimizer state of this rank's pieces
  /// ("<parameter>.<field>"; `fields` maps each field to "param", shaped like the piece, or
  /// "scalar", an int64 count); returns the whole-parameter state of the parameters this rank
  /// owns (Placement::owner), one all-gather per unit and field, and one all-reduce of the
  /// scalars.
  models::NamedTensors whole_state(const models::NamedTensors& piece_state,
                                   const std::map<std::string, std::string>& fields) override;
  /// The reverse, local: whole-parameter state -> this rank's pieces of it (a tensor whose size
  /// is not its parameter's is passed on as it is, for the loader to name).
  models::NamedTensors piece_state(const models::NamedTensors& whole_state) const override;
  /// Stage 3 checkpoints (collective): host copies of the whole parameters this rank owns
  /// (Placement::owner), gathered one unit at a time and freed again, so that each rank writes
  /// its own share of the model's files and its device holds at most one unit whole.
  models::NamedTensors whole_owned_parameters() override;
  /// The reverse, local, at stage 3 with no unit gathered (std::logic_error otherwise): this
  /// rank's pieces from whole parameters (by name; a parameter it has no piece of, or another
  /// tensor, is ignored).
  void load_pieces(const models::NamedTensors& whole) override;
  /// Every parameter as a tensor of its dtype and shape on the meta device (at stage 3 the
  /// model's own are empty between steps), for checking a checkpoint against them.
  models::NamedTensors parameter_shapes() const override;

  /// The elements of each parameter this rank owns (model order; parameters without any left
  /// out): 1-D leaves over this rank's shard, each with its gradient over the gradient shard.
  const models::NamedTensors& pieces() const { return pieces_; }
  /// Bytes this rank holds at rest: its parameter shards (stage 2: the whole parameters), its
  /// gradient shards.
  int64_t parameter_bytes() const;
  int64_t gradient_bytes() const;
  const Placement& placement() const { return placement_; }
  size_t num_units() const { return units_.size(); }

  // The autograd hooks (public for the autograd functions in fsdp.cpp).
  void pre_backward(size_t unit);
  void post_backward(size_t unit);
  /// Before a micro-batch issues anything: a training micro-batch whose schedule is still open
  /// (no after_backward()) ends here; if this rank replayed only part of it, CollectiveMismatch
  /// naming the collectives it never issued.
  void end_open_schedule();

 private:
  struct Unit;
  void start_gather(Unit& u);
  void gather(Unit& u);
  void free(Unit& u);
  void reduce(Unit& u);
  void finish_reduce(Unit& u);  // waits for its reduce-scatter and adds the sums into its shard
  bool keeps_whole() const { return !placement_.shards_parameters(); }  // stage 2: parameters stay whole
  torch::Tensor shard_of(const Placement::Unit& unit, int64_t rank, const torch::TensorOptions& opts,
                         models::DeferredInit* deferred) const;

  // Validation by schedule (whenever coll_ validates: dist.validate = always, and the first
  // step's micro-batches at first_step; the trainer's training micro-batches; per `sync` value):
  // the first such micro-batch's gathers and reduce-scatters are each validated
  // across ranks (through coll_, as every other collective) and recorded in order. Each later one
  // starts with one validated all-reduce in which every rank confirms it is about to replay the
  // same recorded schedule; its collectives then go through the replay lane (Collectives::replay_lane) without a probe,
  // each checked first against the schedule on its own rank: a rank that would leave it (another unit, another kind,
  // one too many, or one too few at the end) throws CollectiveMismatch before issuing anything, so collectives that
  // differ never meet (the other ranks' next one fails when its process exits, a CollectiveError naming it; on NCCL the
  // peer waits until dist.timeout_s at its next host wait). 14 probes per gpt micro-batch become one; a recorded
  // schedule with no collectives (stage 2's accumulating micro-batches) is not replayed at all.
  struct Schedule {
    std::vector<uint64_t> ops;  // (kind << 32) | unit, in the order issued
    bool recorded = false;
  };
  Collectives& via(char kind, size_t unit);  // the instance the next collective goes through
  void open_schedule(bool sync);
  void close_schedule();  // at after_backward: recorded, or checked complete
  std::string describe_op(uint64_t op) const;
  std::string mismatch_at() const;  // "collective mismatch at step N on rank R (ZeRO stage S): "
  size_t index_of(const Unit& u) const;

  std::shared_ptr<models::Model> model_;
  std::shared_ptr<Collectives> coll_;  // and its replay lane: declared before units_, so that both
                                       // outlive their pending collectives
  Placement placement_;
  models::NamedTensors params_;
  std::vector<std::unique_ptr<Unit>> units_;  // units_[i] = block i; the last = the root
  models::NamedTensors pieces_;
  std::vector<Placement::Piece> piece_at_;  // parallel to pieces_
  bool held_ = false;                       // hold(): every unit gathered, the hooks do nothing
  bool sync_ = true;                        // this micro-batch's gradients are reduced
  bool in_order_ = false;                   // every unit reduced after the backward, in order
  Schedule schedules_[2];                   // by `sync`
  Schedule* open_ = nullptr;                // this training micro-batch's, while it runs (replayed
                                            // if it was recorded before)
  size_t next_ = 0;                         // the replayed schedule's next collective
};

}  // namespace keel::dist
