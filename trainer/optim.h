// trainer/optim.h: optimizers and the learning-rate schedule.
//
// Owns: building the optimizer from [train] (keel's fused AdamW / SGD, one ATen kernel for all
// parameters, or torch::optim's per-parameter loop with train.fused_optimizer = false), its
// state in checkpoints (the same names and format for both), and the warmup + cosine / constant
// schedule as a pure function of the step (so resume needs no schedule state beyond the step).
#pragma once

#include <torch/torch.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include "checkpoint/stateful.h"
#include "dist/placement.h"
#include "keel/trainer/config/config.h"
#include "keel/trainer/trainer.h"  // OptimizerStateFn

namespace keel {

/// An optimizer of train.optimizer over `params` (resolve_optimizer(cfg).make(params)).
std::unique_ptr<torch::optim::Optimizer> make_optimizer(const TrainConfig& cfg,
                                                        const std::vector<torch::Tensor>& params);

/// An optimizer whose whole update is one fused ATen kernel per parameter group and device
/// (PyTorch's `fused=True`): it takes the agreed inf/NaN verdict as a device tensor, so that a
/// step to be skipped is skipped by the kernel itself, without the host reading the verdict.
class FusedOptimizer : public torch::optim::Optimizer {
 public:
  using torch::optim::Optimizer::Optimizer;
  /// Updates every parameter that has a gradient, unless `found_inf` (undefined, or a float32
  /// tensor of one element on the parameters' device) is non-zero: then the parameters and the
  /// state are left as they were (the step counts too).
  virtual void step_unless(const torch::Tensor& found_inf) = 0;
  torch::Tensor step(LossClosure closure = nullptr) override;
  /// compile.cuda_graphs: the kernels read the learning rate from `lr` (one element on the
  /// parameters' device, every group's, which the step fills before the update) instead of the
  /// options' value, which a captured kernel would keep for ever. Undefined: the options' value.
  void read_lr_from(torch::Tensor lr) { lr_ = std::move(lr); }

 protected:
  torch::Tensor lr_;
};

/// AdamW through at::_fused_adamw_ (CPU and CUDA): torch.optim.AdamW(fused=True)'s arithmetic.
/// Per parameter: a float32 step count on the parameter's device (as PyTorch keeps it for the
/// fused kernel; exact to 2^24 steps), exp_avg and exp_avg_sq (and max_exp_avg_sq with amsgrad).
class FusedAdamW : public FusedOptimizer {
 public:
  struct ParamState : torch::optim::OptimizerCloneableParamState<ParamState> {
    torch::Tensor step, exp_avg, exp_avg_sq, max_exp_avg_sq;
  };
  FusedAdamW(std::vector<torch::Tensor> params, const torch::optim::AdamWOptions& o);
  void step_unless(const torch::Tensor& found_inf) override;
};

/// SGD (momentum, L2 weight decay, no dampening, no Nesterov) through at::_fused_sgd_:
/// torch.optim.SGD(fused=True)'s arithmetic. Per parameter: momentum_buffer (with momentum > 0).
class FusedSgd : public FusedOptimizer {
 public:
  struct ParamState : torch::optim::OptimizerCloneableParamState<ParamState> {
    torch::Tensor momentum_buffer;
  };
  FusedSgd(std::vector<torch::Tensor> params, const torch::optim::SGDOptions& o);
  void step_unless(const torch::Tensor& found_inf) override;
};

/// Learning rate for optimizer step `step` (0-based: the rate used by the step that brings the
/// count from `step` to `step + 1`). Linear warmup: lr * (step + 1) / warmup_steps for
/// step < warmup_steps; then constant, or cosine from lr to min_lr over the remaining steps.
/// train.schedule, from the schedule registry (trainer/trainer.h register_schedule); throws
/// InputError naming train.schedule and the registered names for an unknown one.
class LrSchedule {
 public:
  LrSchedule(const TrainConfig& cfg, int64_t total_steps);
  double at(int64_t step) const { return fn_(step, total_, cfg_); }

 private:
  TrainConfig cfg_;
  int64_t total_;
  std::function<double(int64_t, int64_t, const TrainConfig&)> fn_;
};

/// Zeroes gradients in place (torch::optim::Optimizer::zero_grad() would detach or drop them,
/// unlinking DDP's gradients-as-bucket-views from their buckets).
void zero_grads(const std::vector<torch::Tensor>& params);
/// Every gradient of `params` undefined (its memory freed; the backward makes it anew).
void free_grads(const std::vector<torch::Tensor>& params);

/// Sets the learning rate of every parameter group.
void set_lr(torch::optim::Optimizer& opt, double lr);

using NamedTensorList = std::vector<std::pair<std::string, torch::Tensor>>;

/// The optimizer's per-parameter state as named tensors, for checkpoints: "<param>.<field>"
/// with AdamW's step (an int64 scalar), exp_avg, exp_avg_sq (and max_exp_avg_sq with amsgrad)
/// and SGD's momentum_buffer. `params` are the optimizer's parameters with their names.
/// The tensors are the live state (not copies), except the step count and a registered
/// optimizer's state (host copies, read through its serialize()). Fused and loop
/// optimizers write the same names and formats, so either loads the other's checkpoints.
NamedTensorList optimizer_state(torch::optim::Optimizer& opt, const NamedTensorList& params);

/// How keel checkpoints the state of a registered optimizer (keel::register_optimizer): its
/// empty-state factory and the fields of its per-parameter state with their kinds ("param": a
/// tensor shaped like the parameter; "scalar": an integer step count), probed once by one step
/// of the optimizer on a 2-element parameter. Empty for the built-ins (adamw, sgd), whose
/// states keel knows by type.
struct OptimizerCodec {
  std::string name;  // train.optimizer, every optimizer's (recorded in meta.json, checked on resume)
  OptimizerStateFn make_state;
  std::map<std::string, std::string> fields;
  explicit operator bool() const { return static_cast<bool>(make_state); }
};
/// train.optimizer resolved once, at start: its registered function and its codec.
class OptimizerChoice {
 public:
  OptimizerChoice(TrainConfig cfg, OptimizerFn make, OptimizerCodec codec)
      : cfg_(std::move(cfg)), make_(std::move(make)), codec_(std::move(codec)) {}
  /// A new optimizer over `params`; InputError when the registered function made none.
  std::unique_ptr<torch::optim::Optimizer> make(const std::vector<torch::Tensor>& params) const;
  const OptimizerCodec& codec() const { return codec_; }

 private:
  TrainConfig cfg_;
  OptimizerFn make_;
  OptimizerCodec codec_;
};
/// One registry lookup and, for a registered optimizer, the probe of its codec. Throws
/// InputError naming train.optimizer for an unknown name, or a state field keel cannot
/// checkpoint.
OptimizerChoice resolve_optimizer(const TrainConfig& cfg);

/// Restores what optimizer_state() returned (copies onto each parameter's device); `codec`
/// for a registered optimizer. Throws std::runtime_error listing the parameters whose state is
/// partial or mis-shaped.
void load_optimizer_state(torch::optim::Optimizer& opt, const NamedTensorList& params, const NamedTensorList& state,
                          const OptimizerCodec& codec = {});

/// The fields of `opt`'s per-parameter state and their kinds (recorded in its checkpoint values):
/// AdamW's step ("scalar"), exp_avg, exp_avg_sq ("param"; max_exp_avg_sq with amsgrad), SGD's
/// momentum_buffer; a registered optimizer's from its codec.
std::map<std::string, std::string> optimizer_fields(torch::optim::Optimizer& opt, const OptimizerCodec& codec = {});

/// dist.zero >= 2: the optimizer steps this rank's pieces of the parameters (1-D, a parameter's
/// elements split between ranks), tensor parallelism its slices of them; a checkpoint holds whole
/// parameters' state, each written by one rank (dist/sharded_parameters.h).
struct PieceResharding {
  /// Collective: the pieces' state -> the whole state of the parameters this rank writes.
  std::function<NamedTensorList(const NamedTensorList&, const std::map<std::string, std::string>& fields)> whole;
  /// Local: whole parameters' state -> this rank's pieces of it.
  std::function<NamedTensorList(const NamedTensorList&)> pieces;
  /// Every parameter the step's optimizer state records, where this rank's optimizer updates only
  /// some of them (pipeline stages: ShardedParameters::optimizer_parameters); empty: its own.
  std::vector<std::string> parameters;
  explicit operator bool() const { return static_cast<bool>(whole); }
};

/// The optimizer's part of a checkpoint (the component "optimizer"): one tensor per parameter
/// and field ("<parameter>.<field>"), replicated, or with a placement that shards the optimizer
/// state (dist.zero >= 1) owned by the rank that writes the parameter's state
/// (dist::Placement::owner); its values record the optimizer's name, the placement (its stage as
/// "zero", and describe()), the fields and their kinds, every parameter it updates and
/// (partitioned) each one's owner rank.
class OptimizerState : public checkpoint::Stateful {
 public:
  /// `opt` must outlive this object; `params` are its parameters with their names: with a
  /// `placement` that shards the optimizer state, this rank's own (whole parameters at stage 1;
  /// at stages 2 and 3 pieces, which `resharding` converts to and from whole parameters' state).
  OptimizerState(torch::optim::Optimizer& opt, NamedTensorList params, dist::Placement placement = dist::Placement(),
                 OptimizerCodec codec = {}, PieceResharding resharding = {})
      : opt_(&opt),
        params_(std::move(params)),
        placement_(std::move(placement)),
        codec_(std::move(codec)),
        resharding_(std::move(resharding)) {
    for (const auto& [n, p] : params_) names_.insert(n);
  }
  void save(checkpoint::Component& mine) const override;
  /// Whether this rank loads the optimizer state tensor `name` ("<parameter>.<field>"): the
  /// state of its own parameters (checkpoint::Options::wants).
  bool wants(const std::string& name) const;
  /// Bytes of the optimizer state this rank holds.
  int64_t state_bytes() const;
  /// Whether each rank holds (and loads) only its own parameters' state (dist.zero >= 1).
  bool partitioned() const { return placement_.shards_optimizer_state(); }
  /// A saved state that does not fit this optimizer (another train.optimizer, other
  /// parameters) is the user's choice of checkpoint: InputError, like a model that does not bind.
  void load(const checkpoint::Loaded& loaded, const checkpoint::LoadedComponent& mine) override;
  /// Its values' form (dist.zero, the fields and their kinds, owner ranks within the saved
  /// world), the index against them (every tensor a "<parameter>.<field>" of a recorded field,
  /// every parameter with all fields or none), and this rank's tensors (a step count is one
  /// integer in [0, step]; the other fields have their parameter's shape and dtype in the
  /// step), before any rank accepts the step, so that every rank falls back alike instead of
  /// failing in load().
  std::string check(const checkpoint::Loaded& loaded, const checkpoint::LoadedComponent& mine) const override;

 private:
  torch::optim::Optimizer* opt_;
  NamedTensorList params_;
  dist::Placement placement_;
  std::unordered_set<std::string> names_;
  OptimizerCodec codec_;
  PieceResharding resharding_;
};

}  // namespace keel
