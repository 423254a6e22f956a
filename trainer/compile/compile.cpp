#include "trainer/compile/compile.h"

#include "trainer/compile/compile_cache.h"
#include "trainer/compile/graph_file.h"

#include <torch/csrc/jit/api/function_impl.h>
#include <torch/csrc/jit/api/module.h>
#include <torch/csrc/jit/ir/ir.h>

#include <nlohmann/json.hpp>
#include "common/clock.h"
#include "common/log.h"

#include <chrono>
#include <map>
#include <set>
#include <sstream>

namespace keel {
namespace {

// The model's forward traced on `example`, its parameters graph inputs (trainer/compile/graph_file.h).
TracedUnit trace(models::Model& m, const torch::Tensor& example) {
  std::vector<torch::Tensor> inputs{example};
  for (auto& p : m.parameters()) inputs.push_back(p);
  return trace_unit([&m](const std::vector<torch::Tensor>& in) { return std::vector<torch::Tensor>{m.forward(in[0])}; },
                    inputs);
}

std::vector<std::string> find_nodes(const torch::jit::Graph& g, const std::set<std::string>& kinds) {
  std::vector<std::string> found;
  for (const auto* n : g.nodes())
    if (kinds.count(n->kind().toQualString())) found.push_back(n->kind().toQualString());
  return found;
}

// aten::to / _to_copy with a Device argument, .cuda(), .cpu(): a device switch inside forward.
std::vector<std::string> device_transfers(const torch::jit::Graph& g) {
  std::vector<std::string> found;
  for (const auto* n : g.nodes()) {
    const std::string k = n->kind().toQualString();
    if (k == "aten::cuda" || k == "aten::cpu") found.push_back(k);
    if (k == "aten::to" || k == "aten::_to_copy")
      for (const auto* in : n->inputs())
        if (in->type()->str().find("Device") != std::string::npos) {
          found.push_back(k + " with a device argument");
          break;
        }
  }
  return found;
}

// The traced model: one graph per input shape seen (a shape guard), each a GraphFunction whose
// inputs are (input, parameters...). Autograd flows through the graph to the parameters.
class TracedModel : public models::Model {
 public:
  TracedModel(std::shared_ptr<models::Model> inner, std::shared_ptr<torch::jit::Graph> graph,
              const std::vector<int64_t>& shape, const CompileConfig& cfg, CompileReport& report)
      : inner_(std::move(inner)), cfg_(cfg), report_(report), params_(inner_->parameters()) {
    first_graph_ = graph;
    graphs_[shape] = std::make_unique<torch::jit::GraphFunction>("forward", std::move(graph), nullptr);
  }
  std::string name() const override { return inner_->name(); }
  models::InputSpec input_spec() const override { return inner_->input_spec(); }
  torch::Tensor forward(const torch::Tensor& input) override {
    auto it = graphs_.find(input.sizes().vec());
    if (it == graphs_.end()) it = specialise(input);
    torch::jit::Stack stack{input};
    for (auto& p : params_) stack.emplace_back(p);
    it->second->run(stack);
    return stack.back().toTensor();
  }
  models::NamedTensors named_parameters() const override { return inner_->named_parameters(); }
  models::NamedTensors named_buffers() const override { return inner_->named_buffers(); }
  void to(const torch::Device& d) override {
    inner_->to(d);
    params_ = inner_->parameters();
  }
  void train(bool on) override { inner_->train(on); }

  // The graph of the first shape traced (the training shape) as a module with its parameters.
  std::string export_module() const {
    torch::jit::Module m(c10::QualifiedName("__torch__.keel.TracedModel"));
    const auto named = inner_->named_parameters();
    auto attr = [](std::string n) {
      for (size_t p = 0; (p = n.find('.', p)) != std::string::npos; p += 2) n.replace(p, 1, "__");
      return n;
    };
    for (const auto& [n, p] : named) m.register_parameter(attr(n), p.detach(), /*is_buffer=*/false);
    auto g = first_graph_->copy();
    auto* self = g->insertInput(0, "self");
    self->setType(m._ivalue()->type());
    {
      torch::jit::WithInsertPoint at(g->block()->nodes().front());
      for (size_t i = 0; i < named.size(); ++i)
        g->inputs()[2 + i]->replaceAllUsesWith(g->insertGetAttr(self, attr(named[i].first)));
    }
    for (size_t i = named.size(); i-- > 0;) g->eraseInput(2 + i);
    auto* fn = m._ivalue()->compilation_unit()->create_function(c10::QualifiedName(*m.type()->name(), "forward"), g);
    m.type()->addMethod(fn);
    std::ostringstream os;
    m.save(os);
    return os.str();
  }

 private:
  using Graphs = std::map<std::vector<int64_t>, std::unique_ptr<torch::jit::GraphFunction>>;
  // A new input shape: the existing graphs are specialised to their shapes; trace again.
  Graphs::iterator specialise(const torch::Tensor& input) {
    if (report_.recompiles >= cfg_.max_recompiles)
      throw CompileError("recompilation storm: input shape " + c10::str(input.sizes()) +
                         " would be re-specialisation #" + std::to_string(report_.recompiles + 1) +
                         ", above compile.max_recompiles = " + std::to_string(cfg_.max_recompiles) +
                         "; keep shapes static (data.drop_last = true)");
    ++report_.recompiles;
    logging::info("compile: re-specialising the graph for input shape {} (#{} of at most {})", c10::str(input.sizes()),
                  report_.recompiles, cfg_.max_recompiles);
    torch::NoGradGuard ng;
    auto graph = trace(*inner_, input.detach()).graph;
    return graphs_.emplace(input.sizes().vec(), std::make_unique<torch::jit::GraphFunction>("forward", graph, nullptr))
        .first;
  }

  std::shared_ptr<models::Model> inner_;
  CompileConfig cfg_;
  CompileReport& report_;
  std::vector<torch::Tensor> params_;
  std::shared_ptr<torch::jit::Graph> first_graph_;
  Graphs graphs_;
};

}  // namespace

std::string export_traced_module(models::Model& model) {
  auto* t = dynamic_cast<TracedModel*>(&model);
  return t ? t->export_module() : std::string();
}

const std::vector<std::string>& nondeterministic_ops() {
  static const std::vector<std::string> ops = {"aten::dropout",       "aten::dropout_",       "aten::feature_dropout",
                                               "aten::alpha_dropout", "aten::native_dropout", "aten::bernoulli",
                                               "aten::bernoulli_",    "aten::rand",           "aten::randn",
                                               "aten::randint",       "aten::randperm",       "aten::rand_like",
                                               "aten::randn_like",    "aten::randint_like",   "aten::multinomial",
                                               "aten::normal",        "aten::normal_",        "aten::uniform_",
                                               "aten::exponential_",  "aten::rrelu",          "aten::rrelu_with_noise"};
  return ops;
}

std::shared_ptr<models::Model> compile_model(std::shared_ptr<models::Model> model, const CompileConfig& cfg,
                                             const torch::Tensor& example, CompileReport& report,
                                             const std::string& identity) {
  report.mode = choice_name(kCompileModes, cfg.mode);
  if (cfg.mode != CompileMode::Trace) return model;
  const auto t0 = Clock::now();
  auto finish = [&]() { report.compile_ms = ms_since(t0); };
  std::unique_ptr<CompileCache> cache;
  std::string key;
  if (!cfg.cache_dir.empty()) {
    if (identity.empty()) throw CompileError("compile.cache_dir needs the model's identity (internal error)");
    cache = std::make_unique<CompileCache>(cfg.cache_dir);
    key = compile_cache_key(identity, cfg, example, "off");
    if (key.empty()) cache.reset();
  }
  if (cache) {
    if (auto graph = cache->load(key)) {
      report.cache = "hit";
      auto traced = std::make_shared<TracedModel>(model, graph, example.sizes().vec(), cfg, report);
      finish();
      logging::info("compile: cache hit {} ({:.0f} ms)", cache->entry_path(key), report.compile_ms);
      return traced;
    }
    report.cache = "miss";
  }
  // Problems that prevent one whole static graph: an error with fullgraph, else a fallback.
  auto refuse = [&](const std::string& why) -> std::shared_ptr<models::Model> {
    if (cfg.fullgraph) throw CompileError("compile (fullgraph): " + why);
    logging::warn("compile: {}; training the eager model instead (set compile.fullgraph = true to make this an error)",
                  why);
    report.warnings.push_back(why);
    report.mode = "eager-fallback";
    finish();
    return model;
  };

  torch::NoGradGuard ng;
  const torch::Tensor x = example.detach();
  TracedUnit first = trace(*model, x);
  // a. graph breaks
  if (!first.warnings.empty())
    return refuse("graph break: data-dependent control flow (the tracer saw a tensor converted to a scalar: " +
                  first.warnings.front().substr(0, first.warnings.front().find('\n')) + ")");
  // Trace again from inputs with other values: random ones, and for float inputs the negated
  // example and large all-positive / all-negative inputs, which flip value-based branches such
  // as `x.sum() > 0`. A branch that none of them flips is still likely to be caught by the
  // fresh-input comparison below (b); neither check can prove its absence.
  const std::string reference = graph_text(*first.graph);
  for (const auto& v : other_inputs(x))
    if (graph_text(*trace(*model, v).graph) != reference)
      return refuse(
          "graph break: data-dependent control flow (tracing from an input with other values gave another graph)");
  // e. device transfers
  auto moves = device_transfers(*first.graph);
  if (!moves.empty())
    return refuse("device transfer inside forward (" + moves.front() +
                  "); place the model and its inputs on one device before compile");
  // c. non-deterministic ops
  const std::set<std::string> nd(nondeterministic_ops().begin(), nondeterministic_ops().end());
  auto random = find_nodes(*first.graph, nd);
  if (!random.empty()) {
    std::string list;
    for (const auto& r : std::set<std::string>(random.begin(), random.end())) list += (list.empty() ? "" : ", ") + r;
    if (cfg.deterministic)
      throw CompileError("compile.deterministic = true, but the graph holds non-deterministic ops: " + list);
    logging::warn("compile: the graph holds non-deterministic ops: {}", list);
    report.warnings.push_back("non-deterministic ops: " + list);
  }
  auto traced = std::make_shared<TracedModel>(model, first.graph, x.sizes().vec(), cfg, report);
  // b. computation the tracer cannot see: graph and eager must agree on a fresh input.
  const torch::Tensor x3 = other_values(x);
  if (random.empty()) {
    auto eager = model->forward(x3);
    auto graph = traced->forward(x3);
    // float32: kernel-order rounding only; bf16/fp16 (autocast) carry 8 or 11 mantissa bits.
    const bool low = eager.scalar_type() == torch::kBFloat16 || eager.scalar_type() == torch::kHalf;
    eager = eager.to(torch::kFloat);
    graph = graph.to(torch::kFloat);
    if (!torch::allclose(eager, graph, low ? 1e-2 : 1e-4, low ? 1e-2 : 1e-5)) {
      const double diff = (eager - graph).abs().max().item<double>();
      return refuse(
          "untraceable computation: the traced graph and the eager model disagree on a fresh input "
          "(max abs difference " +
          std::to_string(diff) +
          "); a kernel the dispatcher does not see, or raw data_ptr arithmetic, is not in the graph");
    }
  }
  if (cache) {
    nlohmann::json meta = {
        {"key", key}, {"model", identity}, {"input_shape", x.sizes().vec()}, {"warnings", report.warnings}};
    cache->store(key, *first.graph, meta.dump());
  }
  finish();
  logging::info("compile: traced {} into a graph of {} nodes in {:.0f} ms", model->name(),
                std::distance(first.graph->nodes().begin(), first.graph->nodes().end()), report.compile_ms);
  return traced;
}

}  // namespace keel
