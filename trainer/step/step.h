// trainer/step/step.h: what the loop calls to train and to evaluate: one optimizer step over the
// step's micro-batches, in two halves around the cross-rank consensus, and an evaluation.
//
//   Launched l = step.launch(r);        // lr, forward + backward per micro-batch, this rank's verdict
//   ... the loop exchanges the consensus (one all-gather: loss, verdict, plan, flags) ...
//   step.update(f);                     // clip and step, or skip on every rank
//   EvalResult e = step.evaluate(n);    // the test split over the dp axis
//
// Owns: the micro-batch loop (gradients synchronised on the last one), moving batches to the
// device, the local inf/NaN verdict (after unscaling), the update (host-decided, or with
// dist.consensus = late decided on the device) and evaluation. Its implementations differ in how a
// micro-batch's loss is computed: EagerStep runs the model's module (eager or TorchScript) and the
// loss under autocast (trainer/step/eager.h); CompiledStep runs compile.mode = "inductor"'s
// package, forward, loss and backward in one (trainer/step/compiled.h). A pipelined step will
// override launch() with its schedule.
// Does not own: the consensus, stop flags, the logs and checkpoints (the loop), the model's
// placement (DistributedModel), the set-up (trainer/run.h).
#pragma once

#include <torch/torch.h>

#include <cmath>
#include <cstdint>
#include <memory>
#include <vector>

#include "common/clock.h"
#include "common/host_copy.h"
#include "keel/dist/collectives.h"
#include "keel/trainer/data/data.h"
#include "keel/trainer/trainer.h"

namespace keel {

struct Run;
// The run's parts a step reads (trainer/run.h).
struct JobParts;
struct ModelParts;
struct DataParts;
struct UpdateParts;
struct Progress;
struct GraphCounts;

/// What one optimizer step produced.
struct StepResult {
  int64_t step = 0;       // optimizer steps done after it
  double loss = 0;        // mean over micro-batches and ranks
  double local_loss = 0;  // this rank's
  double lr = 0;
  double step_ms = 0;
  double grad_norm = std::nan("");   // before clipping (train.grad_clip > 0; else on the steps measures_norm says)
  double loss_scale = std::nan("");  // after the step's update (with a GradScaler)
  double loss_scale_before = std::nan("");
  int64_t epoch = 0;     // the sampler's epoch after the step's batches
  bool skipped = false;  // inf/NaN on some rank: no rank applied the update
  bool stop = false;     // some rank was asked to stop: every rank stops after this step
  dist::StepConsensus consensus;
};

/// A step on its way: launched (forward, backward, the consensus exchanged, the update issued)
/// and, with dist.consensus = late, not yet read by the host.
struct InFlight {
  StepResult r;
  Clock::time_point t0;
  dist::PendingStep record;
  bool resolved = false;  // r holds the consensus
  HostCopy extras;        // float64 [grad norm, loss scale before the update, after it]
};

/// A launched step's local outcome: this rank's contribution to the consensus, which the step (not
/// the loop) decides. With dist.consensus = late the loss and verdict are tensors on the device
/// (nothing read by the host); otherwise they are `loss_now` and `nonfinite_now`. `share`: the
/// loss's weight in the step's mean over ranks (1 on a rank that computed the step's loss, 0 on
/// one that computed none: a pipeline stage before the last) and the step's point-to-point
/// balance (dist::StepShare).
struct Launched {
  torch::Tensor loss;       // late: this rank's mean loss, float64, one element
  torch::Tensor nonfinite;  // late: float32, one element, 1 = inf/NaN in the loss or gradients
  double loss_now = 0;      // not late: this rank's mean loss, read by the host
  bool nonfinite_now = false;
  dist::StepShare share;
};

class StepGraphs;

class Step {
 public:
  /// With compile.cuda_graphs, the step's forward-backward and update run as graphs
  /// (trainer/step/graphs.h).
  /// The run's parts a step reads and updates (trainer/run.h).
  Step(const JobParts& job, ModelParts& net, DataParts& data, UpdateParts& update, const Progress& progress,
       GraphCounts& counts);
  virtual ~Step();
  Step(const Step&) = delete;
  Step& operator=(const Step&) = delete;

  /// The step's first half: its learning rate, forward and backward over its micro-batches,
  /// the epoch, the fault hook on the gradients, and this rank's loss and verdict. Fills r.lr
  /// and r.epoch.
  virtual Launched launch(StepResult& r);
  /// The second half, once the consensus is exchanged: clip and step, or skip on every rank.
  void update(InFlight& f);
  /// Loss (and, with the default loss, top-1 accuracy) over the test split, each data-parallel
  /// rank taking every dp-th sample; totals are summed over the dp axis. Collective.
  virtual EvalResult evaluate(int64_t step);
  /// The gradient plan every rank must agree on at each step's consensus (the model's; a
  /// pipelined step's combines every stage's).
  virtual uint64_t plan() const;
  /// The end of training: the whole model in run.model's parameters for Callbacks::on_end when
  /// `wanted` on some rank (collective: ZeRO-3 gathers it, a pipeline sends each stage's).
  virtual void hold_whole_model(bool wanted);
  /// The first bad input this rank's batches held ("" none): a target out of range, replaced by
  /// train.ignore_index so that the step ran on to the consensus, whose flag makes every rank
  /// throw it (Trainer; the same for evaluation inside evaluate()).
  const std::string& bad_input() const { return bad_input_; }

 protected:
  /// One micro-batch's loss (float32), on the device; `sync`: its gradients synchronise.
  virtual torch::Tensor micro_batch_loss(const torch::Tensor& input, const torch::Tensor& target, bool sync) = 0;
  /// The module's forward under autocast, then the loss.
  torch::Tensor eager_loss(const torch::Tensor& input, const torch::Tensor& target, bool sync);
  // What an override of launch() or evaluate() (a pipelined step) shares with this one.
  /// The step's micro-batches on the device (their targets screened: bad_input()).
  std::vector<data::Batch> next_batches(int64_t step);
  /// Tensor parallelism's collectives in the step's forwards and backwards, validated call by call
  /// on the first step of each batch shape and after that replayed with one probe a step
  /// (dist::Collectives::sequence); nothing at parallel.tp = 1. end() it once they are done.
  dist::Collectives::Sequence tensor_parallel_calls(const std::vector<data::Batch>& batches) const;
  /// Before a step's first micro-batch: the gradients zeroed or freed (train.grads_to_none).
  void clear_gradients();
  torch::Tensor to_device(const torch::Tensor& t) const;
  /// This rank's verdict on its loss and gradients: on the device (late), or read by the host.
  torch::Tensor local_nonfinite(const torch::Tensor& local_loss);
  bool local_nonfinite_now(double local_loss);
  /// One evaluation batch's sums (loss, top-1 hits, counted targets) into the totals.
  void evaluate_batch(const torch::Tensor& out, const torch::Tensor& target, double& loss_sum, double& correct,
                      double& count);
  /// The evaluation's totals, summed over the ranks (float64 [loss, hits, counted, ...]), as a result.
  EvalResult evaluation_result(int64_t step, const torch::Tensor& totals) const;
  /// The parameters whose gradients the verdict reads and the GradScaler unscales: those this
  /// rank's optimizer steps (run.owned). A pipeline stage's are every one it holds (its norm reads
  /// them all, whatever ZeRO-1 owns).
  virtual const std::vector<torch::Tensor>& verdict_parameters() const;
  const JobParts& job_;
  ModelParts& net_;
  DataParts& data_;
  UpdateParts& update_;
  std::string bad_input_;  // bad_input()

 private:
  torch::Tensor forward_backward(const std::vector<data::Batch>& batches, double* loss_now);
  torch::Tensor device_update(const torch::Tensor& found, bool measure_norm);
  bool measures_norm(int64_t step) const;
  torch::Tensor grad_verdict();
  void host_decided_update(StepResult& r);
  void device_decided_update(InFlight& f);
  std::unique_ptr<StepGraphs> graphs_;  // compile.cuda_graphs
  int64_t first_step_ = 1;              // the loop's first (after a resume, the step after it)
};

/// The step the run's model takes: PipelinedStep at parallel.pp > 1, CompiledStep with an Inductor
/// package, else EagerStep.
std::unique_ptr<Step> make_step(Run& run);

}  // namespace keel
