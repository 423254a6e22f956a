#include "trainer/step/graphs.h"

#ifdef KEEL_WITH_CUDA
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include <cmath>
#include <sstream>
#include <stdexcept>
#include <utility>

#include "common/log.h"
#include "keel/common/error.h"
#include "keel/dist/collectives.h"
#include "trainer/optim.h"
#include "trainer/run.h"

namespace keel {
namespace {

// The rehearsal's graph: a replay runs what was captured, again.
class RehearsedGraph final : public StepGraph {
 public:
  void capture(std::function<void()> body) override { body_ = std::move(body); }
  void replay() override { body_(); }

 private:
  std::function<void()> body_;
};

#ifdef KEEL_WITH_CUDA
// As torch.cuda.graph: captured on a side stream once the device is idle, the work's memory in
// the graph's private pool (kept for its replays); capture_begin registers the default CUDA
// generator. A replay runs on the current stream.
// run.sync_debug = error is paused for the capture's synchronisation.
class CudaStepGraph final : public StepGraph {
 public:
  void capture(std::function<void()> body) override {
    auto& warnings = c10::cuda::warning_state();
    const auto debug = warnings.get_sync_debug_mode();
    warnings.set_sync_debug_mode(c10::cuda::SyncDebugMode::L_DISABLED);
    c10::cuda::device_synchronize();
    warnings.set_sync_debug_mode(debug);
    c10::cuda::CUDAStreamGuard side(c10::cuda::getStreamFromPool());
    graph_.capture_begin();
    try {
      body();
    } catch (...) {
      try {
        graph_.capture_end();  // the stream leaves capture mode; the graph is discarded
      } catch (...) {
      }
      throw;
    }
    graph_.capture_end();
  }
  void replay() override { graph_.replay(); }

 private:
  at::cuda::CUDAGraph graph_;
};
#endif

std::string describe(const std::vector<data::Batch>& batches) {
  std::ostringstream os;
  for (size_t i = 0; i < batches.size(); ++i)
    os << (i ? ", " : "") << batches[i].input.sizes() << " -> " << batches[i].target.sizes();
  return os.str();
}

}  // namespace

std::unique_ptr<StepGraph> make_step_graph(const torch::Device& device) {
#ifdef KEEL_WITH_CUDA
  if (device.is_cuda()) return std::make_unique<CudaStepGraph>();
#endif
  if (!device.is_cpu()) throw std::logic_error("compile.cuda_graphs: no graphs for device " + device.str());
  return std::make_unique<RehearsedGraph>();
}

void TensorAddresses::record(const std::vector<std::pair<std::string, torch::Tensor>>& named) {
  where_.clear();
  for (const auto& [name, t] : named) {
    const torch::Tensor g = t.grad();
    where_[name] = {t.data_ptr(), g.defined() ? g.data_ptr() : nullptr};
  }
}

std::string TensorAddresses::first_moved(const std::vector<std::pair<std::string, torch::Tensor>>& named) const {
  for (const auto& [name, t] : named) {
    const auto it = where_.find(name);
    if (it == where_.end()) return name + " (not there when the step was captured)";
    if (t.data_ptr() != it->second.first) return name;
    const torch::Tensor g = t.grad();
    if (it->second.second && (!g.defined() || g.data_ptr() != it->second.second)) return name + "'s gradient";
  }
  return "";
}

StepGraphs::StepGraphs(const JobParts& job, ModelParts& net, UpdateParts& update, const Progress& progress,
                       GraphCounts& counts)
    : job_(job), net_(net), update_(update), counts_(counts), first_step_(progress.steps_done + 1) {
  // What the config could not tell: the device and backend `auto` resolved to, a registered optimizer.
  const bool rehearsal = job.cfg.compile.cuda_graphs_rehearsal;
  const torch::Device dev = net.params.front().device();
  if (!rehearsal && (!dev.is_cuda() || job.group->backend() != "nccl"))
    throw InputError("compile.cuda_graphs = true needs a GPU and NCCL; this run has device " + dev.str() +
                     " and backend " + job.group->backend() +
                     " (set compile.cuda_graphs = false, or compile.cuda_graphs_rehearsal = true with run.device = "
                     "\"cpu\" to rehearse it)");
  if (!update.fused)
    throw InputError(
        "compile.cuda_graphs = true captures the update as a fused optimizer's kernel: train.optimizer = \"" +
        job.cfg.train.optimizer + "\" has none (use \"adamw\" or \"sgd\" with train.fused_optimizer = true)");
  // PyTorch asks for 11 eager DDP iterations before capturing one (NCCL's async error handling);
  // the same for every data-parallel placement here.
  warmup_ = job.mesh.dp() > 1 ? 11 : 3;
  // The fused kernels read a CPU learning rate as a double, a CUDA one as float32.
  lr_ = torch::zeros({}, torch::TensorOptions().device(dev).dtype(dev.is_cpu() ? torch::kDouble : torch::kFloat));
  found_ = torch::zeros({1}, torch::TensorOptions().device(dev).dtype(torch::kFloat));
  update.fused->read_lr_from(lr_);
  logging::info("compile.cuda_graphs{}: {} eager warm-up steps, then the step is captured and replayed",
                rehearsal ? " (rehearsed on the CPU: a replay re-runs the step)" : "", warmup_);
}

std::string StepGraphs::shape_key(const std::vector<data::Batch>& batches) const {
  std::ostringstream os;
  for (const auto& b : batches)
    os << b.input.sizes() << c10::toString(b.input.scalar_type()) << b.target.sizes()
       << c10::toString(b.target.scalar_type()) << ";";
  return os.str();
}

torch::Tensor StepGraphs::forward_backward(const std::vector<data::Batch>& batches, const ForwardBackward& body) {
  ++steps_;
  const std::string key = shape_key(batches);
  auto it = captured_.find(key);
  if (it == captured_.end()) {
    const bool new_shape = ran_eagerly_.insert(key).second;
    if (steps_ <= warmup_ || new_shape) return body(batches);
  }
  Captured& c = it != captured_.end() ? *it->second : capture_forward_backward(key, batches, body);
  for (size_t i = 0; i < batches.size(); ++i) {
    c.inputs[i].input.copy_(batches[i].input, /*non_blocking=*/true);
    c.inputs[i].target.copy_(batches[i].target, /*non_blocking=*/true);
  }
  {
    dist::CaptureScope capturing;
    c.graph->replay();
  }
  replayed();
  return c.loss.clone();
}

StepGraphs::Captured& StepGraphs::capture_forward_backward(const std::string& key,
                                                           const std::vector<data::Batch>& batches,
                                                           const ForwardBackward& body) {
  const auto recaptures = static_cast<int64_t>(captured_.size());  // this one, after the first
  if (recaptures > 0) {
    if (recaptures > job_.cfg.compile.max_recompiles)
      throw InputError("compile.cuda_graphs: a step of batch shape " + describe(batches) + " would be captured " +
                       std::to_string(recaptures) + " times after the first, more than " +
                       "compile.max_recompiles = " + std::to_string(job_.cfg.compile.max_recompiles) +
                       " (keep the batch shape fixed: data.drop_last = true, or raise compile.max_recompiles)");
  }
  auto c = std::make_unique<Captured>();
  for (const auto& b : batches) c->inputs.push_back({torch::empty_like(b.input), torch::empty_like(b.target)});
  c->graph = make_step_graph(batches.front().input.device());
  Captured* self = c.get();
  {
    dist::CaptureScope capturing;
    c->graph->capture([self, body] { self->loss = body(self->inputs); });
  }
  ++counts_.captures;
  // One forward-backward a step: the step number is counted here (with dist.consensus = late
  // the loop's steps_done is one behind the step in hand).
  logging::info("compile.cuda_graphs: step {} captured the forward and backward of batch shape {}{}",
                first_step_ + steps_ - 1, describe(batches),
                captured_.empty() ? std::string() : " (another shape: counted against compile.max_recompiles)");
  return *captured_.emplace(key, std::move(c)).first->second;
}

torch::Tensor StepGraphs::update(const torch::Tensor& found_inf, double lr, const Update& body) {
  lr_.fill_(lr);
  found_.copy_(found_inf.reshape({1}), /*non_blocking=*/true);
  if (steps_ <= warmup_) return body(found_);
  // The options' learning rate is NaN while the update is captured and replayed: a kernel that
  // took it instead of lr_ would keep the capture's value on a GPU, and spoils the rehearsal.
  set_lr(*update_.optimizer, std::nan(""));
  if (!update_graph_) {
    update_graph_ = make_step_graph(found_.device());
    dist::CaptureScope capturing;
    update_graph_->capture([this, body] { update_out_ = body(found_); });
    ++counts_.captures;
  }
  {
    dist::CaptureScope capturing;
    update_graph_->replay();
  }
  set_lr(*update_.optimizer, lr);
  replayed();
  return update_out_.clone();
}

// Every replay leaves the parameters and gradients where the captured step wrote them.
void StepGraphs::replayed() {
  ++counts_.replays;
  if (addresses_.empty()) {
    named_ = net_.model->named_parameters();  // the same tensors for the whole run (set_data keeps them)
    addresses_.record(named_);
    return;
  }
  const std::string moved = addresses_.first_moved(named_);
  if (!moved.empty())
    throw std::logic_error("compile.cuda_graphs: parameter " + moved +
                           " moved after the step was captured; the graph writes where it was");
}

}  // namespace keel
