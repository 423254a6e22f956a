// trainer/step/pipelined.h: the step at parallel.pp > 1 (issue 66): the run's schedule
// (dist/pipeline/schedule.h) run on this rank's stages (dist/stages.h), micro-batch by
// micro-batch: each forward on its input (the batch's tokens on the first stage, else the
// activation received or handed over by this rank's previous stage), each backward on its output's
// gradient (the loss, divided by the micro-batches and scaled by the GradScaler, on the last stage),
// every activation and gradient between ranks through the pp axis's door (Collectives::start_p2p:
// the first step's messages validated pair by pair, later ones by the step consensus's balance).
// Receives are posted at their place in the schedule and waited for where the compute needs them;
// sends are waited for at the end of the step. The zero-bubble schedules' input-gradient action
// (I) computes the stage input's gradient only, keeping the graph; their weight-gradient action
// (W) computes the weights' later (trainer/step/split_backward.h).
// Then sequence parallelism's partial gradients are summed over the stage's tp group (parallel.tp >
// 1: each stage's blocks are tp-sharded, and its activations go to the neighbour of the same tp
// rank), every gradient is averaged over dp (at dist.zero >= 2 the stage's units are held whole for
// the schedule and reduce-scattered after it, the root's summed first), the root's are summed between the first and the
// last stage, and the step's share of the consensus is the last stage's loss (weight 1; the others weigh 0). The update
// (the global norm over every stage and tp rank), the verdict and the fault hook are Step's. Does not own: the
// schedule, the split, the consensus (the loop).
#pragma once

#include <map>
#include <memory>
#include <optional>
#include <set>
#include <tuple>
#include <vector>

#include "dist/fsdp.h"
#include "dist/pipeline/schedule.h"
#include "dist/stages.h"
#include "dist/transform_plan.h"
#include "trainer/step/step.h"

namespace keel {

class PipelinedStep : public Step {
 public:
  PipelinedStep(const JobParts& job, ModelParts& net, DataParts& data, UpdateParts& update, const Progress& progress,
                GraphCounts& counts);
  ~PipelinedStep() override;
  Launched launch(StepResult& r) override;
  /// A forward-only pipeline over the test split, batch by batch; the last stage's totals are
  /// broadcast over the pp axis, then summed over dp.
  EvalResult evaluate(int64_t step) override;
  uint64_t plan() const override { return plan_; }
  /// Every stage's parameters broadcast from its rank over pp (the root's from the first stage's).
  void hold_whole_model(bool wanted) override;

 protected:
  torch::Tensor micro_batch_loss(const torch::Tensor&, const torch::Tensor&, bool) override;
  /// Every parameter this rank's stages hold: at ZeRO-1 the GradScaler unscales the gradients the
  /// stage's norm reads, not only those the rank's optimizer owns.
  /// dist.zero >= 2: the pieces the optimizer steps (their gradients are the stage's, reduced).
  const std::vector<torch::Tensor>& verdict_parameters() const override {
    return fsdp_ ? Step::verdict_parameters() : held_;
  }

 private:
  struct Slot;  // one (stage, micro-batch)'s tensors in flight
  torch::Tensor run_schedule(const std::vector<data::Batch>& batches);
  torch::Tensor stage_input(Slot& slot, int stage, int mb, const std::vector<data::Batch>& batches);
  void forward(int stage, int mb, const std::vector<data::Batch>& batches);
  /// B, or with `split` I (the input's gradient; W runs the weights' from the slot).
  void backward(int stage, int mb, bool split);
  void post_receive(const dist::pipeline::Action& a, const std::vector<data::Batch>& batches);
  void send(const dist::pipeline::Action& a, const std::vector<data::Batch>& batches);
  std::pair<int, std::vector<int64_t>> shape_key(int stage, const torch::Tensor& input) const;
  torch::Tensor activation_buffer(int stage, const torch::Tensor& input);
  void sum_partial_over_tensor_parallel();
  void hold_stage();
  void reduce_stage();
  torch::Tensor summed_squares_norm(double max_norm);
  void average_over_data_parallel();
  void sum_root_gradients();
  torch::Tensor global_norm(double max_norm);
  Slot& slot(int stage, int mb);

  dist::StageModel* stages_ = nullptr;
  dist::Collectives* pp_ = nullptr;
  dist::pipeline::Schedule schedule_;
  int rank_ = 0;  // on the pp axis
  uint64_t plan_ = 0;
  std::map<std::pair<int, int>, std::unique_ptr<Slot>> slots_;
  std::vector<dist::Collectives::Started> sends_;
  torch::Tensor loss_sum_;   // the last stage's, this step
  bool split_ = true;        // the zero-bubble schedules' I and W split (not with compiled blocks)
  bool fault_send_ = false;  // fault.inject shape_mismatch on this step's first activation sent
  // Each stage's input shape and dtype, by the shape of the batch's input (the sender says it
  // once per new batch shape: a message both ends know to expect, as both read the same batches).
  std::map<std::pair<int, std::vector<int64_t>>, std::pair<std::vector<int64_t>, c10::ScalarType>> input_shapes_;
  std::set<std::pair<int, std::vector<int64_t>>> shapes_said_;  // the shapes this rank's sends said
  std::vector<torch::Tensor> held_;   // this rank's stages' parameters (verdict_parameters(), the clip)
  std::vector<int64_t> whole_owner_;  // per parameter of the whole model: the pp rank that counts it in the norm
  std::vector<int64_t> held_owner_;   // the same, per parameter of held_
  std::optional<dist::SplitGradients> tp_split_;  // parallel.tp > 1: per parameter of held_
  dist::FullyShard* fsdp_ = nullptr;              // dist.zero >= 2: the stage's ZeRO layout
  std::vector<size_t> piece_held_;  // dist.zero >= 2: each of fsdp_'s pieces' parameter, as a place in held_
  // The dp group's sequences (Collectives::sequence) of a step's gathers and reduce-scatters.
  static constexpr uint64_t kGathers = 1, kReduceScatters = 2;
};

}  // namespace keel
