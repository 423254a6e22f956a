#include "trainer/compile/inductor_block.h"

#include <torch/csrc/inductor/aoti_package/model_package_loader.h>

#include <ATen/autocast_mode.h>

#include <array>
#include <map>
#include <set>

#include "common/log.h"
#include "keel/common/error.h"
#include "trainer/compile/packaging.h"
#include "trainer/compile/unit_trace.h"

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
    torch::Tensor dx;  // token ids take none
    if (block->input_grad()) {
      dx = grads.back();
      grads.pop_back();
    }
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
  return load_units(req, {Unit{"block", block_params, block_specs}}, report).at(0);
}

std::vector<std::shared_ptr<InductorBlock>> InductorBlock::load_units(const InductorRequest& req,
                                                                      const std::vector<Unit>& units,
                                                                      CompileReport& report) {
  if (req.granularity != "blocks") throw std::logic_error("InductorBlock: a request of granularity " + req.granularity);
  PackageEntry entry = fetch_package(req, report);
  std::vector<std::shared_ptr<InductorBlock>> out;
  for (const Unit& unit : units) {
    const bool root = unit.name == "embed" || unit.name == "head" || unit.name == "loss";
    if (root && !entry.manifest.at("models").contains(unit.name + "_forward")) {
      out.emplace_back();
      continue;
    }
    auto block = std::shared_ptr<InductorBlock>(new InductorBlock());
    block->path_ = entry.path;
    block->sha256_ = entry.manifest.at("sha256").get<std::string>();
    block->manifest_ = entry.manifest;
    block->read_signature(unit, req.device);
    out.push_back(std::move(block));
  }
  entry.loaded(report);
  return out;
}

InductorBlock::~InductorBlock() = default;

void InductorBlock::read_signature(const Unit& u, const torch::Device& device) {
  const std::string& unit = u.name;
  const std::vector<std::string>&block_params = u.params, &block_specs = u.specs;
  unit_ = unit;
  const std::string fw = unit + "_forward", bw = unit + "_backward";
  const auto& models = manifest_.at("models");
  if (!models.contains(fw) || !models.contains(bw))
    throw std::runtime_error(path_ + ": not a package of " + unit + "s (no " + fw + " and " + bw + ")");
  std::vector<std::string> names, specs;
  for (const auto& in : models[fw].at("inputs")) {
    const std::string kind = in.value("kind", "");
    if (kind == "parameter") {
      names.push_back(in.at("name").get<std::string>()), specs.push_back(spec_of(in));
    } else if (kind == "rotary" || kind == "target") {
      extra_names_.push_back(in.at("name").get<std::string>());
      extra_shapes_.push_back(shape_of(in));
      extra_dtypes_.push_back(in.at("dtype").get<std::string>());
    } else if (kind == "input") {
      input_shape_ = shape_of(in);
      const std::string dtype = in.at("dtype").get<std::string>();
      // a hidden state; the loss's logits (float16 under fp16 autocast); the embed's token ids
      static const std::map<std::string, c10::ScalarType> kDtypes = {{"float32", c10::ScalarType::Float},
                                                                     {"bfloat16", c10::ScalarType::BFloat16},
                                                                     {"float16", c10::ScalarType::Half},
                                                                     {"int64", c10::ScalarType::Long}};
      const auto d = kDtypes.find(dtype);
      if (d == kDtypes.end())
        throw std::runtime_error(path_ + ": a " + unit + " input of dtype " + dtype + ", which keel does not pass");
      input_dtype_ = d->second;
    } else {
      throw std::runtime_error(path_ + ": a block input keel does not pass: " + in.dump());
    }
  }
  if (unit == "block") {
    if (const std::string d = first_difference(names, specs, block_params, block_specs); !d.empty())
      throw std::runtime_error(path_ + " does not fit the model: " + d);
  } else {  // a region takes some of the block's parameters; a root unit some of the root's
    const std::string whose = unit == "attention" || unit == "mlp" ? "block" : "model";
    for (size_t i = 0; i < names.size(); ++i) {
      const auto it = std::find(block_params.begin(), block_params.end(), names[i]);
      if (it == block_params.end() || block_specs[static_cast<size_t>(it - block_params.begin())] != specs[i])
        throw std::runtime_error(
            path_ + " does not fit the model: its " + unit + " unit's parameter " + names[i] + " (" + specs[i] +
            ") is " +
            (it == block_params.end()
                 ? "not the " + whose + "'s"
                 : block_specs[static_cast<size_t>(it - block_params.begin())] + " in the " + whose));
    }
  }
  param_names_ = names;
  amp_ = models.at(fw).value("amp", std::string("off"));
  num_params_ = names.size();
  num_extra_ = extra_names_.size();
  size_t saved = 0;
  for (const auto& out : models[fw].at("outputs")) saved += out.value("kind", "") == "saved";
  for (const auto& in : models[bw].at("inputs")) {
    const std::string kind = in.value("kind", ""), name = in.at("name").get<std::string>();
    Source s{Source::Kind::GradOutput, 0};
    if (kind == "parameter") {
      const auto it = std::find(names.begin(), names.end(), name);
      if (it == names.end()) throw std::runtime_error(path_ + ": the block's backward reads an unknown " + name);
      s = {Source::Kind::Parameter, static_cast<size_t>(it - names.begin())};
    } else if (kind == "input") {
      s = {Source::Kind::Input, 0};
    } else if (kind == "rotary" || kind == "target") {
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
  forward_ = std::make_unique<torch::inductor::AOTIModelPackageLoader>(path_, fw, true, 1, index);
  backward_ = std::make_unique<torch::inductor::AOTIModelPackageLoader>(path_, bw, true, 1, index);
}

bool InductorBlock::fits(const torch::Tensor& x, const std::vector<torch::Tensor>& extra) const {
  // The package's precision is traced in: it runs only under the autocast it was traced with.
  const bool autocast = at::autocast::is_autocast_enabled(x.device().type());
  if (extra.size() > extra_shapes_.size()) return false;
  for (size_t i = 0; i < extra.size(); ++i)
    if (extra[i].sizes().vec() != extra_shapes_[i] ||
        c10::getDtypeNames(extra[i].scalar_type()).first != extra_dtypes_[i])
      return false;
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

// The tensors of a unit's parameters `wanted`, each found by name among `names` (a block's, or the
// root's) and taken from `tensors`, in the unit's order (read_signature checked they are there).
std::vector<torch::Tensor> tensors_named(const std::vector<std::string>& wanted, const std::vector<std::string>& names,
                                         const std::vector<torch::Tensor>& tensors) {
  std::vector<torch::Tensor> out;
  for (const auto& n : wanted)
    out.push_back(tensors[static_cast<size_t>(std::find(names.begin(), names.end(), n) - names.begin())]);
  return out;
}

}  // namespace

namespace {

// A compiled unit's input of another shape than the package's: warned once per shape, counted in
// report->recompiles, InputError past max_recompiles.
class OtherShapes {
 public:
  OtherShapes(std::shared_ptr<CompileReport> report, int64_t max_recompiles)
      : report_(std::move(report)), max_(max_recompiles) {}
  void seen(const torch::Tensor& x, const InductorBlock& unit, const std::string& what_runs) {
    const std::string what =
        tensor_spec(x) + (at::autocast::is_autocast_enabled(x.device().type()) ? " under autocast" : "");
    if (!shapes_.insert(what).second) return;
    if (++report_->recompiles > max_)
      throw InputError("compile: a block input of shape " + what + " makes " + std::to_string(report_->recompiles) +
                       " shapes the package of the blocks does not take, more than compile.max_recompiles = " +
                       std::to_string(max_) + "; keep batch shapes static (data.drop_last = true)");
    logging::warn("compile: a block input of shape {} is not the package's ({}): {} eager for it", what,
                  unit.input_spec(), what_runs);
  }

 private:
  std::shared_ptr<CompileReport> report_;
  int64_t max_;
  std::set<std::string> shapes_;
};

// llama's rotary cos and sin, (1, T, head_dim) float32 as traced, when the unit takes them.
std::vector<torch::Tensor> rotary_inputs(const InductorBlock& unit, const torch::Tensor& cos,
                                         const torch::Tensor& sin) {
  if (unit.num_extra() == 0 || !cos.defined() || !sin.defined()) return {};
  return {cos.unsqueeze(0).to(torch::kFloat).contiguous(), sin.unsqueeze(0).to(torch::kFloat).contiguous()};
}

// parallel.tp > 1: the package's attention and MLP regions, each block's parameters taken once in
// each region's order.
std::shared_ptr<InductorBlock> compile_regions(models::Model& model, const InductorRequest& req,
                                               const BlockParameters& blocks, const std::vector<std::string>& specs,
                                               std::shared_ptr<CompileReport> report, int64_t max_recompiles) {
  const auto units =
      InductorBlock::load_units(req, {{"attention", blocks.names[0], specs}, {"mlp", blocks.names[0], specs}}, *report);
  // tensors[u][i]: unit u's parameters of block i.
  std::vector<std::vector<std::vector<torch::Tensor>>> tensors(units.size());
  for (size_t u = 0; u < units.size(); ++u)
    for (size_t i = 0; i < blocks.names.size(); ++i)
      tensors[u].push_back(tensors_named(units[u]->param_names(), blocks.names[i], blocks.tensors[i]));
  auto other = std::make_shared<OtherShapes>(report, max_recompiles);
  auto ran = std::make_shared<std::array<bool, 2>>();  // each region's first run from the package, said once
  const bool ok = model.set_region_compiled([=](size_t i, models::BlockStructure::Region region, const torch::Tensor& x,
                                                const torch::Tensor& cos, const torch::Tensor& sin) -> torch::Tensor {
    if (!torch::GradMode::is_enabled()) return {};  // evaluation: the eager regions
    const size_t u = region == models::BlockStructure::Region::Attention ? 0 : 1;
    if (!units[u]->fits(x)) {
      other->seen(x, *units[u], "the tensor-parallel regions run");
      return {};
    }
    if (!(*ran)[u]) {
      (*ran)[u] = true;
      logging::info("compile: the blocks' {} regions run from the package (input {})", u == 0 ? "attention" : "MLP",
                    units[u]->input_spec());
    }
    return units[u]->forward(tensors[u][i], x, rotary_inputs(*units[u], cos, sin));
  });
  if (!ok) throw InputError("compile.granularity = \"blocks\": model " + model.name() + " has no blocks to compile");
  return units[0];
}

// The root's units from the package (at tp = 1): embed and head as the model's
// BlockStructure::root_compiled, the loss as block.root_loss(). Where an input does not fit, the
// root runs eager, unwarned and uncounted: the blocks, whose input changes with it, warn and count
// that shape. A package without them (made by another packaging script: the cache key has the
// script's SHA-256, so not keel's own): the root eager.
void compile_root(models::Model& model, InductorBlock& block, const std::array<std::shared_ptr<InductorBlock>, 3>& root,
                  const BlockParameters& params) {
  const auto& [embed, head, loss] = root;
  if (!embed || !head || !loss) {
    logging::info("compile: the package has no root units: the embeddings, head and loss run eager");
    return;
  }
  // Between them the embed and the head take every root parameter: a package traced with a tied
  // head would otherwise leave an lm_head of the model's own without its gradient.
  for (const auto& n : params.root_names)
    if (std::find(embed->param_names().begin(), embed->param_names().end(), n) == embed->param_names().end() &&
        std::find(head->param_names().begin(), head->param_names().end(), n) == head->param_names().end())
      throw std::runtime_error(block.path() + " does not fit the model: its root units do not take the model's " + n);
  const std::array<std::vector<torch::Tensor>, 2> tensors = {
      tensors_named(embed->param_names(), params.root_names, params.root_tensors),
      tensors_named(head->param_names(), params.root_names, params.root_tensors)};
  auto ran = std::make_shared<bool>(false);  // said once
  const bool ok =
      model.set_root_compiled([=](models::BlockStructure::RootPart part, const torch::Tensor& x) -> torch::Tensor {
        if (!torch::GradMode::is_enabled()) return {};  // evaluation: the eager root
        const bool first = part == models::BlockStructure::RootPart::Embed;
        const std::shared_ptr<InductorBlock>& unit = first ? embed : head;
        if (!unit->fits(x)) return {};
        if (!*ran) {
          *ran = true;
          logging::info("compile: the root's embeddings and head run from the package (input {})", embed->input_spec());
        }
        return unit->forward(tensors[first ? 0 : 1], x);
      });
  if (!ok) return;
  auto said = std::make_shared<bool>(false);
  block.set_root_loss([loss, said](const torch::Tensor& logits, const torch::Tensor& target) -> torch::Tensor {
    if (!torch::GradMode::is_enabled() || !loss->fits(logits, {target})) return {};
    if (!*said) {
      *said = true;
      logging::info("compile: the loss runs from the package (logits {})", loss->input_spec());
    }
    return loss->forward({}, logits, {target.contiguous()});
  });
}

}  // namespace

namespace {

// The units of `req` traced from `model` (unit_trace.h) on req.example_input, or on a random batch
// of the model's input spec, and the ranks agreed on the outcome.
std::shared_ptr<const GraphFile> traced_units(models::Model& model, const InductorRequest& req) {
  const models::InputSpec spec = model.input_spec();
  std::vector<int64_t> shape = {req.batch};
  shape.insert(shape.end(), spec.sample_shape.begin(), spec.sample_shape.end());
  const auto ids = torch::TensorOptions().dtype(torch::kLong).device(req.device);
  torch::Tensor input = req.example_input, target = req.example_target;
  if (!input.defined())
    input = spec.kind == models::InputKind::Tokens ? torch::randint(0, spec.num_classes, shape, ids)
                                                   : torch::randn(shape, ids.dtype(torch::kFloat));
  if (!target.defined())
    target = spec.kind == models::InputKind::Tokens ? torch::randint(0, spec.num_classes, shape, ids)
                                                    : torch::randint(0, spec.num_classes, {req.batch}, ids);
  return std::make_shared<const GraphFile>(traced_and_agreed(req, [&] {
    return trace_block_units(model, input.to(req.device), target.to(req.device), request_loss(req), req.tp > 1);
  }));
}

}  // namespace

std::shared_ptr<InductorBlock> compile_blocks(models::Model& model, const InductorRequest& request,
                                              std::shared_ptr<CompileReport> report, int64_t max_recompiles) {
  const std::vector<std::string> prefixes = model.block_prefixes();
  if (prefixes.empty())
    throw InputError("compile.granularity = \"blocks\": model " + model.name() +
                     " has no blocks (a model declares them with keel::models::BlockStructure)");
  InductorRequest req = request;
  if (!req.graph && req.traces()) req.graph = traced_units(model, req);
  const BlockParameters first = block_parameters(model, prefixes);
  for (size_t i = 1; i < prefixes.size(); ++i)
    if (first.names[i] != first.names[0])
      throw InputError("compile.granularity = \"blocks\": block " + prefixes[i] + " has other parameters than " +
                       prefixes[0] + " (one package serves blocks of one shape)");
  std::vector<std::string> specs, root_specs;
  for (const auto& t : first.tensors[0]) specs.push_back(tensor_spec(t));
  for (const auto& t : first.root_tensors) root_specs.push_back(tensor_spec(t));
  if (req.tp > 1) return compile_regions(model, req, first, specs, report, max_recompiles);
  const auto units = InductorBlock::load_units(req,
                                               {{"block", first.names[0], specs},
                                                {"embed", first.root_names, root_specs},
                                                {"head", first.root_names, root_specs},
                                                {"loss", {}, {}}},
                                               *report);
  const std::shared_ptr<InductorBlock>& block = units[0];
  compile_root(model, *block, {units[1], units[2], units[3]}, first);
  auto other = std::make_shared<OtherShapes>(report, max_recompiles);
  // Each block's parameter tensors, taken once: a transform after compile (ZeRO-3's gathers and
  // frees, sharded initialisation) gives them other data with set_data, never other tensors.
  const std::vector<std::vector<torch::Tensor>> tensors = first.tensors;
  const bool ok = model.set_block_compiled(
      [=](size_t i, const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) -> torch::Tensor {
        if (!torch::GradMode::is_enabled()) return {};  // evaluation: the eager block
        if (!block->fits(x)) {
          other->seen(x, *block, "the blocks (and the root) run");
          return {};
        }
        return block->forward(tensors[i], x, rotary_inputs(*block, cos, sin));
      });
  if (!ok) throw InputError("compile.granularity = \"blocks\": model " + model.name() + " has no blocks to compile");
  return block;
}

}  // namespace keel
