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

// The gradients of a product mat1 mat2 (+ bias) as autograd's MmBackward0 and AddmmBackward0
// compute them (FunctionsManual.cpp's mm_mat1_backward and mm_mat2_backward, which LibTorch does
// not export): the same kernels on the same layouts, so a kept product's gradients are those of
// the product made again.
torch::Tensor mat1_gradient(const torch::Tensor& grad, const torch::Tensor& mat2, const torch::Tensor& mat1) {
  if (mat1.stride(0) == 1 && mat1.stride(1) == mat1.size(0)) return mat2.mm(grad.t()).t();  // column-major
  return grad.mm(mat2.t());
}
torch::Tensor mat2_gradient(const torch::Tensor& grad, const torch::Tensor& mat1, const torch::Tensor& mat2) {
  if (mat2.stride(0) == 1 && mat2.stride(1) == mat2.size(0)) return grad.t().mm(mat1).t();  // column-major
  return mat1.t().mm(grad);
}

// The backward of a dense product that the recomputation did not make again (its output kept
// from the forward): its inputs are (the bias inside an addmm, or none; mat1; mat2), its output
// mat1 mat2 (+ bias), or that product folded back to the input's leading dimensions (matmul's
// _unsafe_view, whose backward reshapes the gradient to 2-D).
struct KeptProductBackward : torch::autograd::Node {
  torch::autograd::SavedVariable mat1, mat2;

  std::string name() const override { return "keel::KeptProductBackward"; }
  void release_variables() override {
    mat1.reset_data();
    mat2.reset_data();
  }
  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    torch::autograd::variable_list out(3);
    if (!grads[0].defined()) return out;
    const torch::Tensor g = grads[0].dim() == 2 ? grads[0] : grads[0].reshape({-1, grads[0].size(-1)});
    const torch::Tensor m1 = mat1.unpack(), m2 = mat2.unpack();
    if (should_compute_output(0)) out[0] = g;  // the engine sums it to the bias's shape
    if (should_compute_output(1)) out[1] = mat1_gradient(g, m2, m1);
    if (should_compute_output(2)) out[2] = mat2_gradient(g, m1, m2);
    return out;
  }
};

// As autocast casts an argument of a lower-precision op (linear, matmul, addmm) on x's device.
torch::Tensor autocast_argument(const torch::Tensor& t, const torch::Tensor& x) {
  const c10::DeviceType type = x.device().type();
  if (!t.defined() || !at::autocast::is_autocast_enabled(type)) return t;
  return at::autocast::cached_cast(at::autocast::get_autocast_dtype(type), t, type);
}

// Selective recomputation's tape (models::DenseTape): in the forward it makes each dense product
// as models::dense_product() does and keeps it (without a bias added after it); in the
// recomputation it hands the kept products back in the same order, each attached to autograd as
// the op that made it would be (the same casts, views and KeptProductBackward for the product),
// so the recomputation makes every other op again but no product, and the gradients are the
// same bit for bit.
//
// dense_product() makes three forms: an addmm with the bias inside (GPT-2's Conv1D over the
// flattened input; a Linear on a 2-D input), a matmul without a bias (the row-parallel partial
// products, a Linear without one), and a Linear's matmul followed by its bias added in place.
// Autocast casts x (or its flattened 2-D view, for Conv1D's addmm), the bias of an addmm, and the
// weight as the product takes it (a Linear's transposed).
class KeptProducts : public models::DenseTape {
 public:
  void replay() {
    replaying_ = true;
    next_ = 0;
  }
  void check_replayed() const {
    if (next_ != kept_.size())
      throw std::runtime_error("selective activation checkpointing: a block's recomputation made " +
                               std::to_string(next_) + " dense products, its forward " + std::to_string(kept_.size()));
  }
  void release() { kept_.clear(); }

  torch::Tensor project(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& bias,
                        bool conv1d) override {
    const bool addmm = bias.defined() && (conv1d || x.dim() == 2);
    const bool bias_after = bias.defined() && !addmm;
    auto shape = x.sizes().vec();
    shape.back() = conv1d ? w.size(1) : w.size(0);
    if (!replaying_) return keep(x, w, bias, shape, conv1d, addmm, bias_after);
    if (next_ >= kept_.size())
      throw std::runtime_error(
          "selective activation checkpointing: a block's recomputation made more dense "
          "products than its forward (" +
          std::to_string(kept_.size()) + ")");
    Kept kept = std::move(kept_[next_++]);
    if (!kept.product.defined())
      throw std::runtime_error(
          "selective activation checkpointing: a block's backward ran a second time (retain_graph), but its kept "
          "products were handed on in the first: use train.activation_checkpointing = \"blocks\"");
    if (kept.product._version() != kept.version)
      throw std::logic_error(
          "selective activation checkpointing: a kept dense product was changed in place after "
          "the forward made it");
    torch::Tensor y = std::move(kept.product);
    const torch::Tensor m2 = autocast_argument(conv1d ? w : w.t(), x);
    torch::Tensor bc, m1;
    if (addmm) {  // addmm(bias, mat1, mat2), each argument cast
      bc = autocast_argument(bias, x);
      m1 = autocast_argument(conv1d ? x.reshape({-1, x.size(-1)}) : x, x);
    } else {  // matmul(x, mat2): both cast, then x's leading dimensions folded
      const torch::Tensor xc = autocast_argument(x, x);
      m1 = xc.dim() == 2 ? xc : xc.reshape({-1, xc.size(-1)});
    }
    const auto made = addmm ? std::vector<int64_t>{m1.size(0), m2.size(1)} : shape;
    if (y.sizes() != c10::IntArrayRef(made) || y.scalar_type() != m2.scalar_type() || y.device() != x.device())
      throw std::runtime_error("selective activation checkpointing: a kept dense product (" + c10::str(y.sizes()) +
                               ", " + c10::toString(y.scalar_type()) + ") is handed to a product (" + c10::str(made) +
                               ", " + c10::toString(m2.scalar_type()) + ")");
    auto node = std::shared_ptr<KeptProductBackward>(new KeptProductBackward(), torch::autograd::deleteNode);
    node->mat1 = torch::autograd::SavedVariable(m1, /*is_output=*/false);
    node->mat2 = torch::autograd::SavedVariable(m2, /*is_output=*/false);
    node->set_next_edges(torch::autograd::collect_next_edges(bc, m1, m2));
    torch::autograd::set_history(y, node);
    if (addmm) return conv1d ? y.view(shape) : y;
    if (bias_after) y.add_(bias);  // as torch::nn::Linear's forward: in place, the bias uncast
    return y;
  }

 private:
  // The product as dense_product() makes it with autograd on (the weight requiring grad): a
  // matmul folds x's leading dimensions into one (also where x, gathered by sequence
  // parallelism, is not contiguous) and multiplies with mm, never bmm.
  torch::Tensor keep(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& bias,
                     const std::vector<int64_t>& shape, bool conv1d, bool addmm, bool bias_after) {
    const torch::Tensor x2d = x.dim() == 2 ? x : x.reshape({-1, x.size(-1)});
    const torch::Tensor m2 = conv1d ? w : w.t();
    torch::Tensor product;
    if (addmm)
      product = torch::addmm(bias, x2d, m2);
    else
      product = x.dim() == 2 ? x2d.mm(m2) : at::_unsafe_view(x2d.mm(m2), shape);
    kept_.push_back({product, product._version()});
    if (bias_after) {  // added into a copy, so that the kept product stays the one before it
      torch::Tensor out = torch::empty_like(product);
      torch::add_out(out, product, bias);
      return out;
    }
    return addmm && conv1d ? product.view(shape) : product;
  }

  struct Kept {
    torch::Tensor product;
    int64_t version = 0;  // its version counter when kept: nothing may change it in place after
  };
  std::vector<Kept> kept_;
  size_t next_ = 0;
  bool replaying_ = false;
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
  std::unique_ptr<KeptProducts> kept;  // Recompute::Selective: the forward's dense products

  std::string name() const override { return "keel::RecomputeBackward"; }
  void release_variables() override {
    input.reset_data();
    f = nullptr;
    if (kept) kept->release();
  }

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    if (!f)
      throw std::runtime_error(
          "activation checkpointing: a block's backward ran again after its graph was freed (backward twice "
          "without retain_graph)");
    const torch::Tensor x = input.unpack().detach().requires_grad_(input_requires_grad);
    torch::Tensor y;
    {
      torch::AutoGradMode grad(true);
      ForwardsState forwards(device, rng, autocast, autocast_dtype);  // the same masks and dtypes
      if (kept) kept->replay();
      models::DenseTape::Use tape(kept.get());
      y = f(x);
      if (kept) kept->check_replayed();
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

torch::Tensor recompute(models::BlockStructure::BlockFunction f, const torch::Tensor& x, Recompute policy) {
  if (!torch::GradMode::is_enabled() || policy == Recompute::None) return f(x);
  auto node = std::shared_ptr<RecomputeBackward>(new RecomputeBackward(), torch::autograd::deleteNode);
  if (policy == Recompute::Selective) node->kept = std::make_unique<KeptProducts>();
  node->device = x.device();
  node->rng = states_of(generators(x.device()));
  node->autocast = at::autocast::is_autocast_enabled(x.device().type());
  node->autocast_dtype = at::autocast::get_autocast_dtype(x.device().type());
  torch::Tensor y;
  {
    torch::NoGradGuard no_grad;
    models::DenseTape::Use tape(node->kept.get());
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
  const bool selective = policy == Recompute::Selective;
  const std::string name = selective ? "selective" : "blocks";
  if (!models::transformer_family(model.name()))
    throw InputError("train.activation_checkpointing = \"" + name +
                     "\" recomputes a transformer's blocks: model.name = \"" + model.name() +
                     "\" is not one (gpt, gpt2 and llama are)");
  // A model that reaches here without its blocks (a wrapper that hides them) would recompute
  // nothing, silently: refused.
  if (model.block_prefixes().empty())
    throw std::logic_error("train.activation_checkpointing = \"" + name + "\": model \"" + model.name() +
                           "\" shows no blocks (a wrapper that does not pass its BlockStructure on)");
  model.set_block_runner([policy](models::BlockStructure::BlockFunction f, const torch::Tensor& x) {
    return recompute(std::move(f), x, policy);
  });
  const std::string blocks = std::to_string(model.block_prefixes().size()) + " blocks' ";
  plan.applied(Transform::Recompute,
               selective
                   ? "selective (" + blocks + "dense products kept, their other activations recomputed in backward)"
                   : "blocks (" + blocks + "activations recomputed in backward)");
}

}  // namespace keel::dist
