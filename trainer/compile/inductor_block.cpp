#include "trainer/compile/inductor_block.h"

#include <torch/csrc/inductor/aoti_package/model_package_loader.h>

#include <ATen/autocast_mode.h>

#include <set>

#include "common/log.h"
#include "keel/common/error.h"
#include "trainer/compile/packaging.h"

namespace keel {
namespace {

using aot::shape_of;
using aot::spec_of;

// What the autograd node keeps of its package: the package itself, so that a graph held past
// the model (a loss kept by a callback) never runs a freed one.
struct BlockHolder : torch::CustomClassHolder {
  explicit BlockHolder(std::shared_ptr<InductorBlock> b) : block(std::move(b)) {}
  std::shared_ptr<InductorBlock> block;
};

// The block's forward in the package; its backward hands each parameter and the input their
// gradients. Everything the backward reads is saved as autograd saves eager tensors (version
// checked, released after the backward): the parameters as the tensors themselves, so that with
// dist.zero = 3 (their memory freed after the block and gathered again before its backward) the
// package reads them as they are then, as an eager block would.
struct BlockFunction : public torch::autograd::Function<BlockFunction> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, at::TensorList params,
                               const std::shared_ptr<InductorBlock>& block, const torch::Tensor& x,
                               at::TensorList extra) {
    std::vector<torch::Tensor> in(params.begin(), params.end());
    in.push_back(x);
    in.insert(in.end(), extra.begin(), extra.end());
    auto out = block->run_forward(std::move(in));
    std::vector<torch::Tensor> keep(params.begin(), params.end());
    keep.push_back(x);
    keep.insert(keep.end(), extra.begin(), extra.end());
    keep.insert(keep.end(), out.begin() + 1, out.end());
    ctx->save_for_backward(keep);
    ctx->saved_data["block"] = c10::IValue::make_capsule(c10::make_intrusive<BlockHolder>(block));
    ctx->saved_data["counts"] =
        std::vector<int64_t>{static_cast<int64_t>(params.size()), static_cast<int64_t>(extra.size())};
    return out[0];
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_out) {
    const auto block = static_cast<BlockHolder*>(ctx->saved_data.at("block").toCapsule().get())->block;
    const auto counts = ctx->saved_data.at("counts").toIntVector();
    const auto n = static_cast<size_t>(counts[0]), e = static_cast<size_t>(counts[1]);
    const auto kept = ctx->get_saved_variables();  // the parameters, the input, the extra, the saved
    const auto at = [&](size_t from, size_t count) {
      return std::vector<torch::Tensor>(kept.begin() + static_cast<std::ptrdiff_t>(from),
                                        kept.begin() + static_cast<std::ptrdiff_t>(from + count));
    };
    const auto extra = at(n + 1, e);
    auto grads =
        block->run_backward(at(0, n), kept[n], extra, at(n + 1 + e, kept.size() - n - 1 - e), grad_out[0].contiguous());
    torch::Tensor dx = grads.back();
    grads.pop_back();
    grads.emplace_back();  // the block gets none
    grads.push_back(std::move(dx));
    grads.resize(grads.size() + extra.size());  // nor do the extra inputs
    return grads;
  }
};

std::string first_difference(const std::vector<std::string>& names, const std::vector<std::string>& specs,
                             const std::vector<std::string>& want_names, const std::vector<std::string>& want_specs) {
  if (names.size() != want_names.size())
    return std::to_string(names.size()) + " parameters in the package, " + std::to_string(want_names.size()) +
           " in the model's block";
  for (size_t i = 0; i < names.size(); ++i) {
    if (names[i] != want_names[i])
      return "parameter " + std::to_string(i) + " is " + names[i] + " in the package, " + want_names[i] +
             " in the model's block";
    if (specs[i] != want_specs[i])
      return "parameter " + names[i] + " is " + specs[i] + " in the package, " + want_specs[i] +
             " in the model's block";
  }
  return "";
}

}  // namespace

std::shared_ptr<InductorBlock> InductorBlock::load_or_compile(const InductorRequest& req,
                                                              const std::vector<std::string>& block_params,
                                                              const std::vector<std::string>& block_specs,
                                                              CompileReport& report) {
  if (req.granularity != "blocks") throw std::logic_error("InductorBlock: a request of granularity " + req.granularity);
  PackageEntry entry = fetch_package(req, report);
  auto block = std::shared_ptr<InductorBlock>(new InductorBlock());
  block->path_ = entry.path;
  block->sha256_ = entry.manifest.at("sha256").get<std::string>();
  block->manifest_ = std::move(entry.manifest);
  block->read_signature(block_params, block_specs, req.device);
  entry.loaded(report);
  return block;
}

InductorBlock::~InductorBlock() = default;

void InductorBlock::read_signature(const std::vector<std::string>& block_params,
                                   const std::vector<std::string>& block_specs, const torch::Device& device) {
  const auto& models = manifest_.at("models");
  if (!models.contains("block_forward") || !models.contains("block_backward"))
    throw std::runtime_error(path_ + ": not a block package (no block_forward and block_backward)");
  std::vector<std::string> names, specs;
  for (const auto& in : models["block_forward"].at("inputs")) {
    const std::string kind = in.value("kind", "");
    if (kind == "parameter") {
      names.push_back(in.at("name").get<std::string>()), specs.push_back(spec_of(in));
    } else if (kind == "rotary") {
      extra_names_.push_back(in.at("name").get<std::string>());
    } else if (kind == "input") {
      input_shape_ = shape_of(in);
      const std::string dtype = in.at("dtype").get<std::string>();
      if (dtype != "float32" && dtype != "bfloat16")
        throw std::runtime_error(path_ + ": a block input of dtype " + dtype + ", which keel does not pass");
      input_dtype_ = dtype == "bfloat16" ? c10::ScalarType::BFloat16 : c10::ScalarType::Float;
    } else {
      throw std::runtime_error(path_ + ": a block input keel does not pass: " + in.dump());
    }
  }
  if (const std::string d = first_difference(names, specs, block_params, block_specs); !d.empty())
    throw std::runtime_error(path_ + " does not fit the model: " + d);
  amp_ = models.at("block_forward").value("amp", std::string("off"));
  num_params_ = names.size();
  num_extra_ = extra_names_.size();
  size_t saved = 0;
  for (const auto& out : models["block_forward"].at("outputs")) saved += out.value("kind", "") == "saved";
  for (const auto& in : models["block_backward"].at("inputs")) {
    const std::string kind = in.value("kind", ""), name = in.at("name").get<std::string>();
    Source s{Source::Kind::GradOutput, 0};
    if (kind == "parameter") {
      const auto it = std::find(names.begin(), names.end(), name);
      if (it == names.end()) throw std::runtime_error(path_ + ": the block's backward reads an unknown " + name);
      s = {Source::Kind::Parameter, static_cast<size_t>(it - names.begin())};
    } else if (kind == "input") {
      s = {Source::Kind::Input, 0};
    } else if (kind == "rotary") {
      const auto it = std::find(extra_names_.begin(), extra_names_.end(), name);
      if (it == extra_names_.end()) throw std::runtime_error(path_ + ": the block's backward reads an unknown " + name);
      s = {Source::Kind::Extra, static_cast<size_t>(it - extra_names_.begin())};
    } else if (kind == "saved") {
      s = {Source::Kind::Saved, std::stoul(name.substr(std::string("saved:").size()))};
      if (s.index >= saved)
        throw std::runtime_error(path_ + ": the block's backward reads " + name + " of " + std::to_string(saved) +
                                 " saved tensors");
    } else if (kind != "grad_output") {
      throw std::runtime_error(path_ + ": a block backward input keel does not pass: " + in.dump());
    }
    backward_inputs_.push_back(s);
  }
  const auto index = device.is_cuda() ? static_cast<c10::DeviceIndex>(device.index()) : c10::DeviceIndex(-1);
  forward_ = std::make_unique<torch::inductor::AOTIModelPackageLoader>(path_, "block_forward", true, 1, index);
  backward_ = std::make_unique<torch::inductor::AOTIModelPackageLoader>(path_, "block_backward", true, 1, index);
}

bool InductorBlock::fits(const torch::Tensor& x) const {
  // The package's precision is traced in: it runs only under the autocast it was traced with.
  const bool autocast = at::autocast::is_autocast_enabled(x.device().type());
  return x.sizes().vec() == input_shape_ && x.scalar_type() == input_dtype_ && autocast == (amp_ != "off");
}

std::string InductorBlock::input_spec() const {
  return c10::str(c10::IntArrayRef(input_shape_)) + " " + c10::getDtypeNames(input_dtype_).first +
         (amp_ != "off" ? " under autocast" : "");
}

torch::Tensor InductorBlock::forward(const std::vector<torch::Tensor>& params, const torch::Tensor& x,
                                     const std::vector<torch::Tensor>& extra) {
  if (params.size() != num_params_ || extra.size() != num_extra_)
    throw std::runtime_error("inductor block: " + std::to_string(params.size()) + " parameters and " +
                             std::to_string(extra.size()) + " extra inputs; the package takes " +
                             std::to_string(num_params_) + " and " + std::to_string(num_extra_));
  for (size_t i = 0; i < params.size(); ++i)  // the package reads them as traced: dense, row-major
    if (!params[i].is_contiguous())
      throw std::runtime_error("inductor block: parameter " + std::to_string(i) +
                               " is not contiguous; the package reads its parameters as they were traced");
  return BlockFunction::apply(at::TensorList(params), shared_from_this(), x.contiguous(), at::TensorList(extra));
}

std::vector<torch::Tensor> InductorBlock::run_forward(std::vector<torch::Tensor> inputs) {
  return forward_->run(inputs);
}

std::vector<torch::Tensor> InductorBlock::run_backward(const std::vector<torch::Tensor>& params, const torch::Tensor& x,
                                                       const std::vector<torch::Tensor>& extra,
                                                       const std::vector<torch::Tensor>& saved,
                                                       const torch::Tensor& grad_output) {
  std::vector<torch::Tensor> in;
  in.reserve(backward_inputs_.size());
  for (const Source& s : backward_inputs_) {
    switch (s.kind) {
      case Source::Kind::Parameter:
        in.push_back(params.at(s.index));
        break;
      case Source::Kind::Input:
        in.push_back(x);
        break;
      case Source::Kind::Extra:
        in.push_back(extra.at(s.index));
        break;
      case Source::Kind::Saved:
        in.push_back(saved.at(s.index));
        break;
      case Source::Kind::GradOutput:
        in.push_back(grad_output);
        break;
    }
  }
  torch::NoGradGuard no_grad;
  return backward_->run(in);
}

namespace {

// Each block's parameter names, relative to the block, and the tensors, in the model's order.
struct BlockParameters {
  std::vector<std::vector<std::string>> names;
  std::vector<std::vector<torch::Tensor>> tensors;
};

BlockParameters block_parameters(const models::Model& model, const std::vector<std::string>& prefixes) {
  BlockParameters b{std::vector<std::vector<std::string>>(prefixes.size()),
                    std::vector<std::vector<torch::Tensor>>(prefixes.size())};
  for (const auto& [name, p] : model.named_parameters())
    for (size_t i = 0; i < prefixes.size(); ++i)
      if (name.rfind(prefixes[i], 0) == 0) {
        b.names[i].push_back(name.substr(prefixes[i].size()));
        b.tensors[i].push_back(p);
        break;
      }
  return b;
}

}  // namespace

std::shared_ptr<InductorBlock> compile_blocks(models::Model& model, const InductorRequest& req,
                                              std::shared_ptr<CompileReport> report, int64_t max_recompiles) {
  const std::vector<std::string> prefixes = model.block_prefixes();
  if (prefixes.empty())
    throw InputError("compile.granularity = \"blocks\": model " + model.name() + " has no transformer blocks");
  const BlockParameters first = block_parameters(model, prefixes);
  for (size_t i = 1; i < prefixes.size(); ++i)
    if (first.names[i] != first.names[0])
      throw InputError("compile.granularity = \"blocks\": block " + prefixes[i] + " has other parameters than " +
                       prefixes[0] + " (one package serves blocks of one shape)");
  std::vector<std::string> specs;
  for (const auto& t : first.tensors[0]) specs.push_back(tensor_spec(t));
  auto block = InductorBlock::load_or_compile(req, first.names[0], specs, *report);
  auto other_shapes = std::make_shared<std::set<std::string>>();
  // Each block's parameter tensors, taken once: a transform after compile (ZeRO-3's gathers and
  // frees, sharded initialisation) gives them other data with set_data, never other tensors.
  const std::vector<std::vector<torch::Tensor>> tensors = first.tensors;
  const bool ok = model.set_block_compiled([=](size_t i, const torch::Tensor& x, const torch::Tensor& cos,
                                               const torch::Tensor& sin) -> torch::Tensor {
    if (!torch::GradMode::is_enabled()) return {};  // evaluation: the eager block
    if (!block->fits(x)) {
      const std::string what =
          tensor_spec(x) + (at::autocast::is_autocast_enabled(x.device().type()) ? " under autocast" : "");
      if (other_shapes->insert(what).second) {
        if (++report->recompiles > max_recompiles)
          throw InputError("compile: a block input of shape " + what + " makes " + std::to_string(report->recompiles) +
                           " shapes the block package does not take, more than compile.max_recompiles = " +
                           std::to_string(max_recompiles) + "; keep batch shapes static (data.drop_last = true)");
        logging::warn("compile: a block input of shape {} is not the package's ({}): the blocks run eager for it", what,
                      block->input_spec());
      }
      return {};
    }
    std::vector<torch::Tensor> extra;  // llama's rotary cos and sin, (1, T, head_dim) float32 as traced
    if (block->num_extra() > 0 && cos.defined() && sin.defined())
      extra = {cos.unsqueeze(0).to(torch::kFloat).contiguous(), sin.unsqueeze(0).to(torch::kFloat).contiguous()};
    return block->forward(tensors[i], x, extra);
  });
  if (!ok) throw InputError("compile.granularity = \"blocks\": model " + model.name() + " has no blocks to compile");
  return block;
}

}  // namespace keel
