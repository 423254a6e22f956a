#include "dist/recompute.h"

#include <ATen/autocast_mode.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>

#include <mutex>
#include <utility>
#include <vector>

#include "keel/common/error.h"
#include "models/transformer.h"

namespace keel::dist {

namespace {

// The generators a block may draw from on `device`: the CPU's, and the device's own.
std::vector<at::Generator> generators(const torch::Device& device) {
  std::vector<at::Generator> g{at::globalContext().defaultGenerator(torch::kCPU)};
  if (!device.is_cpu()) g.push_back(at::globalContext().defaultGenerator(device));
  return g;
}

std::vector<torch::Tensor> states_of(std::vector<at::Generator> gens) {
  std::vector<torch::Tensor> s;
  for (auto& g : gens) {
    std::lock_guard<std::mutex> lock(g.mutex());
    s.push_back(g.get_state());
  }
  return s;
}

void set_states(std::vector<at::Generator>& gens, const std::vector<torch::Tensor>& states) {
  for (size_t i = 0; i < gens.size(); ++i) {
    std::lock_guard<std::mutex> lock(gens[i].mutex());
    gens[i].set_state(states[i]);
  }
}

// For its lifetime: the generators at `states` (the forward's), and autocast on `device` as the
// forward had it (on with its dtype, or off); both restored after, also when the block throws.
class ForwardsState {
 public:
  ForwardsState(const torch::Device& device, const std::vector<torch::Tensor>& states, bool autocast,
                at::ScalarType dtype)
      : gens_(generators(device)),
        now_(states_of(gens_)),
        type_(device.type()),
        was_enabled_(at::autocast::is_autocast_enabled(type_)),
        was_dtype_(at::autocast::get_autocast_dtype(type_)) {
    set_states(gens_, states);
    at::autocast::set_autocast_enabled(type_, autocast);
    at::autocast::set_autocast_dtype(type_, dtype);
    if (autocast) at::autocast::increment_nesting();
    nested_ = autocast;
  }
  ~ForwardsState() {
    if (nested_ && at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    at::autocast::set_autocast_enabled(type_, was_enabled_);
    at::autocast::set_autocast_dtype(type_, was_dtype_);
    set_states(gens_, now_);
  }
  ForwardsState(const ForwardsState&) = delete;
  ForwardsState& operator=(const ForwardsState&) = delete;

 private:
  std::vector<at::Generator> gens_;
  std::vector<torch::Tensor> now_;
  c10::DeviceType type_;
  bool was_enabled_;
  at::ScalarType was_dtype_;
  bool nested_ = false;
};

// The backward of recompute(): f(x) again, with autograd, then backpropagation through it.
struct RecomputeBackward : torch::autograd::Node {
  models::BlockStructure::BlockFunction f;
  torch::autograd::SavedVariable input;
  bool input_requires_grad = false;
  torch::Device device = torch::kCPU;
  std::vector<torch::Tensor> rng;  // the generators' states before the forward
  bool autocast = false;
  at::ScalarType autocast_dtype = at::kFloat;

  std::string name() const override { return "keel::RecomputeBackward"; }
  void release_variables() override {
    input.reset_data();
    f = nullptr;
  }

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    if (!f) throw std::runtime_error("activation checkpointing: a block's backward ran twice (retain_graph)");
    const torch::Tensor x = input.unpack().detach().requires_grad_(input_requires_grad);
    torch::Tensor y;
    {
      torch::AutoGradMode grad(true);
      ForwardsState forwards(device, rng, autocast, autocast_dtype);  // the same masks and dtypes
      y = f(x);
    }
    if (grads[0].defined()) torch::autograd::backward({y}, {grads[0]});
    if (!input_requires_grad || !x.grad().defined()) return {torch::Tensor()};
    // Contiguous, as the sum autograd hands on without recomputation: AccumulateGrad may keep one
    // of the input's contributions with the strides of the op that made it, and a reduction over
    // it further back (a row-parallel bias's gradient under sequence parallelism) would then add
    // in another order.
    return {x.grad().contiguous()};
  }
};

}  // namespace

torch::Tensor recompute(models::BlockStructure::BlockFunction f, const torch::Tensor& x) {
  if (!torch::GradMode::is_enabled()) return f(x);
  auto node = std::shared_ptr<RecomputeBackward>(new RecomputeBackward(), torch::autograd::deleteNode);
  node->device = x.device();
  node->rng = states_of(generators(x.device()));
  node->autocast = at::autocast::is_autocast_enabled(x.device().type());
  node->autocast_dtype = at::autocast::get_autocast_dtype(x.device().type());
  torch::Tensor y;
  {
    torch::NoGradGuard no_grad;
    y = f(x);
  }
  node->input_requires_grad = x.requires_grad();
  node->input = torch::autograd::SavedVariable(x, /*is_output=*/false);
  node->set_next_edges(torch::autograd::collect_next_edges(x));
  node->f = std::move(f);
  torch::autograd::set_history(y, node);
  return y;
}

void wrap_recompute(models::Model& model, Recompute policy, TransformPlan& plan) {
  if (policy == Recompute::None) {
    plan.applied(Transform::Recompute, "off");
    return;
  }
  if (!models::transformer_family(model.name()))
    throw InputError("train.activation_checkpointing = \"blocks\" recomputes a transformer's blocks: model.name = \"" +
                     model.name() + "\" is not one (gpt, gpt2 and llama are)");
  model.set_block_runner(recompute);
  plan.applied(Transform::Recompute, "blocks (" + std::to_string(model.block_prefixes().size()) +
                                         " blocks' activations recomputed in backward)");
}

}  // namespace keel::dist
