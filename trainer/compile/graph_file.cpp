#include "trainer/compile/graph_file.h"

#include <ATen/autocast_mode.h>
#include <ATen/record_function.h>
#include <torch/csrc/jit/api/function_impl.h>
#include <torch/csrc/jit/frontend/tracer.h>
#include <torch/csrc/jit/ir/constants.h>
#include <torch/csrc/jit/ir/ir.h>
#include <torch/serialize.h>

#include <cmath>
#include <map>
#include <mutex>
#include <set>

#include "common/atomic_file.h"
#include "common/log.h"
#include "common/sha256.h"
#include "trainer/compile/compile.h"

namespace keel {
namespace {

constexpr const char* kGraphFormat = "keel-graph/1";

// What a refusal of `what` (a unit of a model) says: the reason, and that the model trains eager.
[[noreturn]] void refuse_unit(const std::string& what, const std::string& why) {
  throw GraphRefusal("compile.mode = \"inductor\": " + what + " cannot be compiled as traced: " + why +
                     " (compile.mode = \"off\" trains it eager)");
}

// Ops that read a value out of a tensor onto the host: whatever the C++ code does with the value
// (a branch, a size, a scale) is baked into the graph as a constant of this input's value.
const std::set<std::string>& scalar_reads() {
  static const std::set<std::string> ops = {"aten::item", "aten::_local_scalar_dense", "aten::is_nonzero",
                                            "aten::equal", "aten::allclose"};
  return ops;
}

// Tracer warnings and scalar reads, collected per trace (one trace at a time).
std::mutex g_trace_mu;
std::vector<std::string>* g_warnings = nullptr;
thread_local std::vector<std::string>* t_reads = nullptr;

void collect_warning(const std::string& msg) {
  if (g_warnings) g_warnings->push_back(msg.substr(0, msg.find('\n')));
}

std::unique_ptr<at::ObserverContext> observe_op(const at::RecordFunction& fn) {
  const char* name = fn.name();
  if (t_reads && name && scalar_reads().count(name)) t_reads->push_back(name);
  return nullptr;
}

}  // namespace

TracedUnit trace_unit(const UnitFn& fn, const std::vector<torch::Tensor>& inputs) {
  std::lock_guard<std::mutex> lock(g_trace_mu);
  TracedUnit t;
  g_warnings = &t.warnings;
  t_reads = &t.reads;
  torch::jit::tracer::setWarn(collect_warning);
  // Autocast's cached low-precision copies of parameters would enter the graph as constants.
  at::autocast::clear_cache();
  const at::CallbackHandle handle =
      at::addThreadLocalCallback(at::RecordFunctionCallback(observe_op).scopes({at::RecordScope::FUNCTION}));
  struct Done {
    at::CallbackHandle h;
    ~Done() {
      at::removeCallback(h);
      g_warnings = nullptr;
      t_reads = nullptr;
    }
  } done{handle};
  torch::jit::Stack stack(inputs.begin(), inputs.end());
  auto traced = [&fn](torch::jit::Stack in) -> torch::jit::Stack {
    std::vector<torch::Tensor> ts;
    for (auto& v : in) ts.push_back(v.toTensor());
    const std::vector<torch::Tensor> out = fn(ts);
    return torch::jit::Stack(out.begin(), out.end());
  };
  auto result = torch::jit::tracer::trace(
      stack, traced, [](const torch::autograd::Variable&) { return std::string(); }, /*strict=*/false);
  t.graph = result.first->graph;
  return t;
}

void refuse_reads(const TracedUnit& t, const std::string& what) {
  if (!t.reads.empty())
    refuse_unit(what, t.reads.front() +
                          " reads a value out of a tensor on the host (item(), a branch on a tensor's value), which "
                          "the graph would hold as a constant");
}

torch::Tensor other_values(const torch::Tensor& x) {
  if (x.is_floating_point()) return torch::randn_like(x);
  const int64_t hi = std::max<int64_t>(2, x.max().item<int64_t>() + 1);
  return torch::randint_like(x, 0, hi);
}

std::vector<torch::Tensor> other_inputs(const torch::Tensor& x) {
  std::vector<torch::Tensor> variants = {other_values(x)};
  if (x.is_floating_point()) variants.insert(variants.end(), {-x, x.abs() * 100.0, x.abs() * -100.0});
  return variants;
}

std::string graph_text(const torch::jit::Graph& g) { return g.toString(/*print_source_locations=*/false); }

namespace {

c10::TypePtr unwrap_optional(c10::TypePtr t) {
  if (!t) return t;
  if (auto opt = t->cast<c10::OptionalType>()) return opt->getElementType();
  return t;
}

std::string tensor_spec_of(const torch::Tensor& t) {
  return c10::str(t.sizes()) + " " + c10::getDtypeNames(t.scalar_type()).first;
}

nlohmann::json number(double d) {
  if (std::isfinite(d)) return {{"f", d}};
  return {{"f", std::isnan(d) ? "nan" : (d > 0 ? "inf" : "-inf")}};  // JSON has no inf
}

// Writes a traced graph as keel-graph/1 (see graph_file.h). Refuses what cannot be replayed.
class Writer {
 public:
  Writer(const torch::jit::Graph& g, std::string what, c10::DeviceType device, const std::vector<GraphInput>& names,
         const std::vector<torch::Tensor>& inputs)
      : g_(g), what_(std::move(what)), device_(device), names_(names), inputs_(inputs) {}

  nlohmann::json write() {
    const auto& names = names_;
    const auto& inputs = inputs_;
    nlohmann::json in = nlohmann::json::array();
    const auto graph_inputs = g_.inputs();
    for (size_t i = 0; i < graph_inputs.size(); ++i) {
      ids_[graph_inputs[i]] = next_++;
      in.push_back({{"name", names.at(i).name},
                    {"kind", names.at(i).kind},
                    {"shape", inputs.at(i).sizes().vec()},
                    {"dtype", c10::getDtypeNames(inputs.at(i).scalar_type()).first}});
    }
    nlohmann::json nodes = nlohmann::json::array();
    for (const auto* n : g_.nodes())
      if (n->kind() != c10::prim::Constant) nodes.push_back(node(n));
    nlohmann::json out = nlohmann::json::array();
    for (const auto* v : g_.outputs()) out.push_back(arg(v, nullptr));
    return {{"format", kGraphFormat}, {"what", what_},  {"inputs", in},
            {"nodes", nodes},         {"outputs", out}, {"constants", constants_.size()}};
  }
  std::vector<torch::Tensor>& constants() { return constants_; }
  /// The tensor constants' shapes and dtypes: tensors the unit read from outside its inputs.
  const std::vector<std::string>& baked() const { return baked_; }

 private:
  [[noreturn]] void refuse(const std::string& op, const std::string& why) const { refuse_unit(what_, op + " " + why); }
  // What keel's graph file does not carry (a limit of keel's, not the model's doing): a
  // CompileError, so the model trains eager unless compile.fullgraph.
  [[noreturn]] void unsupported(const std::string& op, const std::string& why) const {
    throw CompileError("compile.mode = \"inductor\": " + what_ + ": " + op + " " + why);
  }

  nlohmann::json literal(const c10::IValue& v, const c10::TypePtr& declared, const std::string& op) {
    const c10::TypePtr real = unwrap_optional(declared);
    const c10::TypeKind kind = real ? real->kind() : c10::TypeKind::AnyType;
    if (v.isNone()) return {{"none", true}};
    if (v.isInt() && kind == c10::TypeKind::ScalarTypeType)
      return {{"dtype", c10::getDtypeNames(static_cast<c10::ScalarType>(v.toInt())).first}};
    if (v.isInt() && kind == c10::TypeKind::LayoutType) return {{"layout", v.toInt()}};
    if (v.isInt() && kind == c10::TypeKind::MemoryFormatType) return {{"memory_format", v.toInt()}};
    if (v.isTensor()) {
      const at::Tensor& t = v.toTensor();
      if (t.unsafeGetTensorImpl()->is_wrapped_number()) {  // a C++ number the op took as a tensor
        if (t.is_floating_point()) return number(t.item<double>());
        if (t.scalar_type() == at::kBool) return {{"b", t.item<bool>()}};
        return {{"i", t.item<int64_t>()}};
      }
      for (size_t i = 0; i < inputs_.size(); ++i)
        if (t.has_storage() && inputs_[i].has_storage() && t.storage().is_alias_of(inputs_[i].storage()))
          refuse(op, "reads the data of " + names_[i].kind + " " + names_[i].name +
                         " outside the graph (.data(), a raw copy): the package would hold its values of compile "
                         "time as a constant");
      baked_.push_back(tensor_spec_of(t));
      constants_.push_back(t.detach().to(torch::kCPU).clone().contiguous());
      return {{"t", constants_.size() - 1}};
    }
    if (v.isInt()) return {{"i", v.toInt()}};
    if (v.isDouble()) return number(v.toDouble());
    if (v.isBool()) return {{"b", v.toBool()}};
    if (v.isString()) return {{"s", v.toStringRef()}};
    if (v.isIntList()) return {{"ints", v.toIntVector()}};
    if (v.isBoolList()) {
      std::vector<bool> b;
      for (bool x : v.toBoolList()) b.push_back(x);
      return {{"bools", b}};
    }
    if (v.isDoubleList()) {
      nlohmann::json l = nlohmann::json::array();
      for (double d : v.toDoubleVector()) l.push_back(number(d));
      return {{"list", l}};
    }
    if (v.isDevice()) return {{"device", c10::DeviceTypeName(v.toDevice().type(), /*lower_case=*/true)}};
    unsupported(op, "takes a constant of type " + v.tagKind() + ", which keel's graph file does not carry");
  }

  nlohmann::json arg(const torch::jit::Value* v, const c10::TypePtr& declared, const std::string& op = "") {
    if (v->node()->kind() == c10::prim::Constant) {
      const std::optional<c10::IValue> iv = torch::jit::toIValue(v);
      if (!iv) unsupported(op, "takes a constant keel cannot read");
      return literal(*iv, declared, op);
    }
    const auto it = ids_.find(v);
    if (it == ids_.end()) unsupported(op, "takes a value defined in a nested block (control flow)");
    return {{"v", it->second}};
  }

  nlohmann::json node(const torch::jit::Node* n) {
    const std::string kind = n->kind().toQualString();
    nlohmann::json j = {{"op", kind}};
    nlohmann::json args = nlohmann::json::array();
    if (kind == "prim::ListConstruct" || kind == "prim::TupleConstruct") {
      const c10::TypePtr elem = kind == "prim::ListConstruct" ? n->output()->type()->containedType(0) : nullptr;
      for (const auto* in : n->inputs()) args.push_back(arg(in, elem, kind));
    } else if (kind == "prim::ListUnpack" || kind == "prim::TupleUnpack" || kind == "prim::NumToTensor") {
      for (const auto* in : n->inputs()) args.push_back(arg(in, nullptr, kind));
    } else {
      if (scalar_reads().count(kind))
        refuse(kind, "reads a value out of a tensor on the host, which the graph would hold as a constant");
      const c10::FunctionSchema* schema = n->maybeSchema();
      if (!schema) unsupported(kind, "has no operator schema (control flow or a TorchScript-only node)");
      const bool to_number =
          kind == "aten::Int" || kind == "aten::Float" || kind == "aten::Bool" || kind == "aten::ScalarImplicit";
      if (to_number && n->input(0)->node()->kind() != c10::prim::NumToTensor)
        refuse(kind, "reads a value out of a tensor on the host, which the graph would hold as a constant");
      check_transfer(n, kind);
      j["overload"] = schema->overload_name();
      const auto& formal = schema->arguments();
      for (size_t i = 0; i < n->inputs().size(); ++i)
        args.push_back(arg(n->input(i), i < formal.size() ? formal[i].real_type() : nullptr, kind));
    }
    j["args"] = std::move(args);
    nlohmann::json outs = nlohmann::json::array();
    for (const auto* o : n->outputs()) {
      ids_[o] = next_;
      outs.push_back(next_++);
    }
    j["out"] = std::move(outs);
    return j;
  }

  // A copy to another kind of device inside the unit (x.cpu(), x.to(torch::kCUDA) on the CPU).
  void check_transfer(const torch::jit::Node* n, const std::string& kind) const {
    if (kind == "aten::cuda" || kind == "aten::cpu") refuse(kind, "moves a tensor to another device inside the unit");
    if (kind != "aten::to" && kind != "aten::_to_copy") return;
    for (const auto* in : n->inputs()) {
      if (in->node()->kind() != c10::prim::Constant) continue;
      const std::optional<c10::IValue> iv = torch::jit::toIValue(in);
      if (iv && iv->isDevice() && iv->toDevice().type() != device_)
        refuse(kind, "moves a tensor to " + iv->toDevice().str() + " inside the unit, which runs on " +
                         c10::DeviceTypeName(device_, true));
    }
  }

  const torch::jit::Graph& g_;
  std::string what_;
  c10::DeviceType device_;
  const std::vector<GraphInput>& names_;
  const std::vector<torch::Tensor>& inputs_;
  std::map<const torch::jit::Value*, int64_t> ids_;
  int64_t next_ = 0;
  std::vector<torch::Tensor> constants_;
  std::vector<std::string> baked_;
};

std::string fingerprint_of(const nlohmann::json& j, const std::vector<torch::Tensor>& constants) {
  Sha256 h;
  const std::string text = j.dump();
  h.update(text.data(), text.size());
  for (const auto& t : constants) {
    const std::string head = c10::str(t.sizes(), t.scalar_type());
    h.update(head.data(), head.size());
    h.update(t.data_ptr(), t.nbytes());
  }
  return h.hex();
}

// The random generators as they were (tracing and the checks run the unit several times).
class KeepGenerators {
 public:
  explicit KeepGenerators(const torch::Device& device) {
    gens_.push_back(at::globalContext().defaultGenerator(torch::kCPU));
    if (!device.is_cpu()) gens_.push_back(at::globalContext().defaultGenerator(device));
    for (auto& g : gens_) states_.push_back(g.get_state());
  }
  ~KeepGenerators() {
    for (size_t i = 0; i < gens_.size(); ++i) gens_[i].set_state(states_[i]);
  }

 private:
  std::vector<at::Generator> gens_;
  std::vector<torch::Tensor> states_;
};

}  // namespace

void GraphFile::write(const std::string& path) const {
  // A tuple of tensors: what torch.load(weights_only=True) reads (a typed tensor list is not).
  const std::vector<char> bytes =
      torch::pickle_save(c10::ivalue::Tuple::create(std::vector<c10::IValue>(tensors.begin(), tensors.end())));
  write_atomic(path + ".pt", std::string(bytes.begin(), bytes.end()));
  write_atomic(path, json.dump(1));
}

namespace {

using Refuse = std::function<void(const std::string&)>;

// The unit's first output as a scalar seed for its gradients (its sum where it is not one).
torch::Tensor seed_of(const torch::Tensor& out) { return out.dim() == 0 ? out : out.sum(); }

// The gradients of `out` with respect to the unit's parameters (zeros for those it leaves unused).
std::vector<torch::Tensor> parameter_grads(const torch::Tensor& out, const std::vector<torch::Tensor>& params) {
  if (params.empty() || !out.requires_grad()) {
    std::vector<torch::Tensor> zeros;
    for (const auto& p : params) zeros.push_back(torch::zeros_like(p));
    return zeros;
  }
  auto g = torch::autograd::grad({seed_of(out).to(torch::kFloat)}, params, {}, false, false, /*allow_unused=*/true);
  for (size_t i = 0; i < g.size(); ++i) g[i] = g[i].defined() ? g[i].detach() : torch::zeros_like(params[i]);
  return g;
}

// What the tracer cannot see, on a fresh input: the graph and the C++ code must agree on the
// output (a kernel outside the dispatcher, data_ptr arithmetic) and on every parameter's gradient
// (the trace holds the forward's ops only: a NoGradGuard region, a custom autograd Function's own
// backward, a tensor hook are not in it).
void check_fresh_input(const UnitFn& fn, const TracedUnit& first, std::vector<torch::Tensor> in,
                       const std::vector<GraphInput>& names, const Refuse& refuse) {
  for (size_t i = 0; i < names.size(); ++i)
    if (names[i].kind == "input" || names[i].kind == "target") in[i] = other_values(in[i]);
  std::vector<torch::Tensor> params;
  std::vector<std::string> param_names;
  for (size_t i = 0; i < names.size(); ++i)
    if (names[i].kind == "parameter" && in[i].requires_grad())
      params.push_back(in[i]), param_names.push_back(names[i].name);
  torch::AutoGradMode grad_mode(true);  // the step trains: its gradients are compared
  torch::jit::GraphFunction graph_fn("unit", first.graph->copy(), nullptr);
  torch::jit::Stack stack(in.begin(), in.end());
  graph_fn.run(stack);
  const torch::Tensor got = stack.front().toTensor(), want = fn(in).front();
  const bool low = at::autocast::is_autocast_enabled(got.device().type());
  const double rtol = low ? 1e-2 : 1e-4, atol = low ? 1e-2 : 1e-5;
  const torch::Tensor g32 = got.detach().to(torch::kFloat), w32 = want.detach().to(torch::kFloat);
  if (!torch::allclose(g32, w32, rtol, atol))
    refuse("the traced graph and the C++ code disagree on a fresh input (max abs difference " +
           std::to_string((g32 - w32).abs().max().item<double>()) +
           "): a kernel the dispatcher does not see, or raw data_ptr arithmetic, is not in the graph");
  const auto got_grads = parameter_grads(got, params), want_grads = parameter_grads(want, params);
  for (size_t i = 0; i < params.size(); ++i) {
    const torch::Tensor a = got_grads[i].to(torch::kFloat), b = want_grads[i].to(torch::kFloat);
    const double scale = 1.0 + b.abs().max().item<double>();  // the gradient's own size
    if (!torch::allclose(a, b, rtol, atol * scale))
      refuse("the gradient of " + param_names[i] + " through the traced graph differs from the C++ code's (max abs " +
             "difference " + std::to_string((a - b).abs().max().item<double>()) +
             "): the C++ code's backward is not its forward's (a NoGradGuard region, a custom autograd Function, a "
             "tensor hook), which a trace does not carry");
  }
}

// A second value of data input `vary` of the same shape (other values, -x, +-100|x|) must give the
// same graph.
void check_other_inputs(const UnitFn& fn, const TracedUnit& first, const std::vector<torch::Tensor>& inputs, int vary,
                        const Refuse& refuse) {
  const std::string reference = graph_text(*first.graph);
  for (const auto& v : other_inputs(inputs[static_cast<size_t>(vary)])) {
    std::vector<torch::Tensor> in = inputs;
    in[static_cast<size_t>(vary)] = v;
    if (graph_text(*trace_unit(fn, in).graph) != reference)
      refuse("a second input of the same shape gave another graph (a branch on the input's values)");
  }
}

}  // namespace

GraphFile trace_graph(const UnitFn& fn, const std::vector<torch::Tensor>& inputs, const std::vector<GraphInput>& names,
                      const std::string& what, bool vary_data) {
  const torch::Device on = inputs.empty() ? torch::Device(torch::kCPU) : inputs.front().device();
  // The example values (not in the fingerprint: they differ between ranks) as they are now.
  std::vector<std::pair<std::string, torch::Tensor>> examples;
  for (size_t i = 0; i < names.size(); ++i)
    if (names[i].kind != "parameter")  // the packaging step makes its own parameters
      examples.emplace_back(names[i].name, inputs[i].detach().to(torch::kCPU).clone());
  KeepGenerators keep(on);
  // Buffers as they were: the traces and the checks run the forward (BatchNorm's statistics).
  std::vector<std::pair<torch::Tensor, torch::Tensor>> buffers;
  for (size_t i = 0; i < names.size(); ++i)
    if (names[i].kind == "buffer") buffers.emplace_back(inputs[i], inputs[i].detach().clone());
  struct Restore {
    std::vector<std::pair<torch::Tensor, torch::Tensor>>& b;
    ~Restore() {
      torch::NoGradGuard ng;
      for (auto& [live, saved] : b) live.copy_(saved);
    }
  } restore{buffers};
  const Refuse refuse = [&](const std::string& why) { refuse_unit(what, why); };
  TracedUnit first;
  try {
    first = trace_unit(fn, inputs);
    refuse_reads(first, what);
    if (!first.warnings.empty()) refuse("the tracer warned: " + first.warnings.front());
    if (vary_data) {
      for (size_t i = 0; i < names.size(); ++i)
        if (names[i].kind == "input" || names[i].kind == "target")
          check_other_inputs(fn, first, inputs, static_cast<int>(i), refuse);
      check_fresh_input(fn, first, inputs, names, refuse);
    }
  } catch (const CompileError&) {
    throw;
  } catch (const std::exception& e) {  // the tracer's own refusals (a tensor that requires grad read as a constant)
    const std::string msg = e.what();
    refuse("the tracer stopped: " + msg.substr(0, msg.find('\n')));
  }
  Writer writer(*first.graph, what, on.type(), names, inputs);
  GraphFile file;
  file.json = writer.write();
  file.tensors = std::move(writer.constants());
  file.fingerprint = fingerprint_of(file.json, file.tensors);
  if (!writer.baked().empty())
    logging::warn(
        "compile: {} reads {} tensor(s) outside its parameters and buffers ({}{}), held in the package as "
        "constants of their values now; register one as a buffer if it changes while training",
        what, writer.baked().size(), writer.baked().front(), writer.baked().size() > 1 ? ", ..." : "");
  nlohmann::json index = nlohmann::json::object();
  for (auto& [name, t] : examples) {
    index[name] = file.tensors.size();
    file.tensors.push_back(std::move(t));
  }
  file.json["examples"] = index;
  return file;
}

GraphFile trace_training_step(models::Model& model, const torch::Tensor& input, const torch::Tensor& target,
                              const std::function<torch::Tensor(const torch::Tensor&, const torch::Tensor&)>& loss) {
  std::vector<torch::Tensor> inputs;
  std::vector<GraphInput> names;
  for (const auto& [n, p] : model.named_parameters()) inputs.push_back(p), names.push_back({n, "parameter"});
  for (const auto& [n, b] : model.named_buffers()) inputs.push_back(b), names.push_back({n, "buffer"});
  const size_t first = inputs.size();
  inputs.push_back(input.detach());
  names.push_back({"input", "input"});
  inputs.push_back(target.detach());
  names.push_back({"target", "target"});
  UnitFn fn = [&model, &loss, first](const std::vector<torch::Tensor>& in) {
    return std::vector<torch::Tensor>{loss(model.forward(in[first]), in[first + 1]).to(torch::kFloat)};
  };
  return trace_graph(fn, inputs, names, "the training step of model " + model.name(), /*vary_data=*/true);
}

}  // namespace keel
