// trainer/step/graphs.h: compile.cuda_graphs, the step's device work captured once and replayed.
//
// A step is two graphs, with the per-step consensus exchanged between them uncaptured (its
// fields are the host's: the step, the stop and checkpoint flags, the compute time):
//   forward-backward: zeroing the gradients, each micro-batch's forward, loss and (scaled)
//     backward with the gradient collectives (DDP's buckets, ZeRO's reduce-scatter, tensor
//     parallelism's), reading the static input buffers that each step's batches are copied
//     into; one graph per batch shape;
//   update: clipping, the fused optimizer (the learning rate and the agreed verdict read from
//     static tensors that are filled before the replay), ZeRO's parameter broadcast, the
//     GradScaler's update.
// Between them, uncaptured: this rank's verdict (unscaling), the fault hook on the gradients
// and the consensus. The outputs (the loss, the grad norm and scales) are copied out of the
// graphs' memory after each replay.
//
// When: the process's first warm-up steps run eagerly (11 with data parallelism, as PyTorch asks
// of DDP under NCCL; else 3); after them a batch shape that ran eagerly before is captured at its
// next step, and a new one runs one eager step first, so that (with dist.validate = always) every
// captured collective was checked across ranks with that shape: replays cannot change a shape, and
// captures and replays run in a dist::CaptureScope (no check, and on a GPU no host wait). A forward-backward captured
// after the first counts against compile.max_recompiles (InputError naming it past that).
//
// After each replay the model's parameters and their gradients must be where they were when the
// step was captured (a graph writes where they were): std::logic_error naming the one that moved.
// The optimizer's options hold a NaN learning rate while the update is captured and replayed.
//
// CUDA: at::cuda::CUDAGraph, captured on a side stream after a device synchronisation; its
// capture_begin registers the default CUDA generator, so dropout draws new numbers on each
// replay. The rehearsal (compile.cuda_graphs_rehearsal, run.device = "cpu"): a replay re-runs
// the captured function; everything else above is the same code.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "keel/trainer/data/data.h"

namespace keel {

// The run's parts the graphs read (trainer/run.h).
struct JobParts;
struct ModelParts;
struct UpdateParts;
struct Progress;
struct GraphCounts;

/// Recorded device work, replayed without the host issuing it again.
class StepGraph {
 public:
  virtual ~StepGraph() = default;
  /// Records `body` (CUDA: captured, not run; the rehearsal: kept, to be run by each replay).
  virtual void capture(std::function<void()> body) = 0;
  virtual void replay() = 0;
};

/// A CUDA graph for a CUDA device (CUDA builds), else the rehearsal's.
std::unique_ptr<StepGraph> make_step_graph(const torch::Device& device);

/// Where tensors were; the first that is no longer there.
class TensorAddresses {
 public:
  void record(const std::vector<std::pair<std::string, torch::Tensor>>& named);
  /// "" when each recorded tensor (and its gradient, recorded where it had one) is where it was.
  std::string first_moved(const std::vector<std::pair<std::string, torch::Tensor>>& named) const;
  bool empty() const { return where_.empty(); }

 private:
  std::map<std::string, std::pair<const void*, const void*>> where_;  // data, grad's data
};

class StepGraphs {
 public:
  /// The micro-batches' loss (one element, float64) from their batches on the device.
  using ForwardBackward = std::function<torch::Tensor(const std::vector<data::Batch>&)>;
  /// The update given the agreed verdict (float32, one element); returns what the host reads.
  using Update = std::function<torch::Tensor(const torch::Tensor& found_inf)>;

  StepGraphs(const JobParts& job, ModelParts& net, UpdateParts& update, const Progress& progress, GraphCounts& counts);
  /// The step's forward and backward over `batches` (on the device): eager, captured or replayed
  /// as the header says. Returns the loss, outside the graph's memory.
  torch::Tensor forward_backward(const std::vector<data::Batch>& batches, const ForwardBackward& body);
  /// The update at learning rate `lr`: eager during the warm-up, then captured once and replayed.
  /// Returns `body`'s result, outside the graph's memory.
  torch::Tensor update(const torch::Tensor& found_inf, double lr, const Update& body);
  /// The learning rate the fused optimizer reads (FusedOptimizer::read_lr_from).
  const torch::Tensor& lr() const { return lr_; }
  int64_t warmup_steps() const { return warmup_; }

 private:
  struct Captured {
    std::vector<data::Batch> inputs;  // the static buffers
    std::unique_ptr<StepGraph> graph;
    torch::Tensor loss;
  };
  void replayed();
  std::string shape_key(const std::vector<data::Batch>& batches) const;
  Captured& capture_forward_backward(const std::string& key, const std::vector<data::Batch>& batches,
                                     const ForwardBackward& body);

  const JobParts& job_;
  ModelParts& net_;
  UpdateParts& update_;
  GraphCounts& counts_;
  int64_t warmup_ = 3;
  int64_t steps_ = 0;                  // forward-backwards this process ran
  int64_t first_step_ = 1;             // the loop's step number of the first of them
  std::set<std::string> ran_eagerly_;  // batch shapes that ran one eager step
  std::map<std::string, std::unique_ptr<Captured>> captured_;
  std::unique_ptr<StepGraph> update_graph_;
  torch::Tensor lr_, found_, update_out_;  // the update's static input and output tensors
  TensorAddresses addresses_;
  std::vector<std::pair<std::string, torch::Tensor>> named_;  // the model's parameters, for the address check
};

}  // namespace keel
