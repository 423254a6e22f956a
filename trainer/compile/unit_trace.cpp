#include "trainer/compile/unit_trace.h"

#include <torch/csrc/jit/ir/ir.h>

#include <map>
#include <optional>

#include "common/sha256.h"
#include "keel/common/error.h"
#include "trainer/compile/compile.h"

namespace keel {
namespace {

using models::BlockStructure;

// A parameter whose data is a placeholder (sharded initialisation: one element, expanded) is given
// values for as long as a unit is traced, then its placeholder back: the checks compare the graph
// with the C++ code on values, which a placeholder's one undefined element does not give.
class TracingValues {
 public:
  explicit TracingValues(const std::vector<torch::Tensor>& params) {
    torch::NoGradGuard no_grad;
    for (const auto& p : params)
      if (p.numel() > 0 && !p.is_non_overlapping_and_dense()) {
        kept_.emplace_back(p, p.data());
        p.set_data(torch::randn(p.sizes(), p.options()).mul_(0.02));
      }
  }
  ~TracingValues() {
    torch::NoGradGuard no_grad;
    for (auto& [p, data] : kept_) p.set_data(data);
  }
  TracingValues(const TracingValues&) = delete;
  TracingValues& operator=(const TracingValues&) = delete;

 private:
  std::vector<std::pair<torch::Tensor, torch::Tensor>> kept_;
};

// Parameters by name: a block's (relative to the block) or the root's (as the model names them).
struct Named {
  std::vector<std::string> names;
  std::vector<torch::Tensor> tensors;
};

class Probe {
 public:
  Probe(models::Model& model, BlockStructure& bs) : model_(model), bs_(bs), prefixes_(model.block_prefixes()) {
    blocks_.resize(prefixes_.size());
    for (const auto& [name, p] : model.named_parameters()) {
      bool in_block = false;
      for (size_t i = 0; i < prefixes_.size() && !in_block; ++i)
        if (name.rfind(prefixes_[i], 0) == 0) {
          blocks_[i].names.push_back(name.substr(prefixes_[i].size()));
          blocks_[i].tensors.push_back(p);
          in_block = true;
        }
      if (!in_block) root_.names.push_back(name), root_.tensors.push_back(p);
    }
  }

  // Block i's computation (between its hooks): block 0 traced, every other one's graph compared.
  void block(size_t i, const BlockStructure::BlockFunction& f, const torch::Tensor& x) {
    guarded([&] {
      const std::string what = "the block " + prefixes_.at(i) + " of model " + model_.name();
      same_as_block_0("block", i, blocks_.at(i), f, x, what);
    });
  }

  // Block i's tensor-parallel region: traced at block 0 (with the parameters it reads), compared after.
  void region(size_t i, BlockStructure::Region r, const BlockStructure::BlockFunction& f, const torch::Tensor& x) {
    guarded([&] {
      const std::string unit = r == BlockStructure::Region::Attention ? "attention" : "mlp";
      const std::string what = "the " + unit + " region of block " + prefixes_.at(i) + " of model " + model_.name();
      same_as_block_0(unit, i, used_by(f, x, blocks_.at(i)), f, x, what);
    });
  }

  // A root part: traced with the root parameters it reads.
  void root(BlockStructure::RootPart part, const BlockStructure::RootFunction& f, const torch::Tensor& x) {
    guarded([&] {
      const bool embed = part == BlockStructure::RootPart::Embed;
      const std::string unit = embed ? "embed" : "head";
      if (seen_.count(unit)) return;
      seen_[unit] = "";
      add(unit, used_by(f, x, root_), f, x,
          std::string(embed ? "the embeddings" : "the head") + " of model " + model_.name());
    });
  }

  // The loss of the forward's logits.
  void loss(const LossFn& fn, const torch::Tensor& logits, const torch::Tensor& target) {
    guarded([&] {
      const std::vector<torch::Tensor> in = {logits.detach(), target};
      const std::vector<GraphInput> names = {{"input", "input"}, {"target", "target"}};
      units_.emplace_back("loss", trace_graph(
                                      [&fn](const std::vector<torch::Tensor>& t) {
                                        return std::vector<torch::Tensor>{fn(t[0], t[1]).to(torch::kFloat)};
                                      },
                                      in, names, "the loss of model " + model_.name(), /*vary_data=*/true));
    });
  }

  // After the forward: the first refusal, or the units.
  std::vector<std::pair<std::string, GraphFile>> take(const std::vector<std::string>& required) {
    if (error_) std::rethrow_exception(error_);
    for (const auto& unit : required)
      if (!seen_.count(unit))
        throw CompileError("compile.granularity = \"blocks\": model " + model_.name() +
                           "'s forward did not reach its " + unit +
                           (unit == "block" ? "s through BlockStructure::block_call (models/transformer.h's "
                                              "run_blocks)"
                                            : " region"));
    return std::move(units_);
  }

 private:
  // Runs `f`, keeping the first exception for take(): the forward goes on, eager.
  template <class F>
  void guarded(F&& f) {
    if (error_) return;
    try {
      f();
    } catch (...) {
      error_ = std::current_exception();
    }
  }

  // The subset of `all` that `f` reads on `x` (a trace's inputs that have uses).
  static Named used_by(const BlockStructure::BlockFunction& f, const torch::Tensor& x, const Named& all) {
    std::vector<torch::Tensor> in = all.tensors;
    in.push_back(x.detach());
    const size_t n = all.tensors.size();
    const TracedUnit t = trace_unit([&f, n](const std::vector<torch::Tensor>& v) { return std::vector{f(v[n])}; }, in);
    Named used;
    const auto inputs = t.graph->inputs();
    for (size_t k = 0; k < n; ++k)
      if (!inputs[k]->uses().empty()) used.names.push_back(all.names[k]), used.tensors.push_back(all.tensors[k]);
    return used;
  }

  void add(const std::string& unit, const Named& params, const BlockStructure::BlockFunction& f, const torch::Tensor& x,
           const std::string& what) {
    TracingValues values(params.tensors);
    std::vector<torch::Tensor> in = params.tensors;
    std::vector<GraphInput> names;
    for (const auto& n : params.names) names.push_back({n, "parameter"});
    in.push_back(x.detach());
    names.push_back({"input", "input"});
    const size_t n = params.tensors.size();
    units_.emplace_back(unit, trace_graph([&f, n](const std::vector<torch::Tensor>& v) { return std::vector{f(v[n])}; },
                                          in, names, what, /*vary_data=*/true));
  }

  // Unit `unit` of block i: block 0's traced and checked; another block's graph must be block 0's
  // (its own parameters in the same places), as one package serves them all.
  void same_as_block_0(const std::string& unit, size_t i, const Named& params, const BlockStructure::BlockFunction& f,
                       const torch::Tensor& x, const std::string& what) {
    std::vector<torch::Tensor> in = params.tensors;
    in.push_back(x.detach());
    const size_t n = params.tensors.size();
    std::string text;
    {
      TracingValues values(params.tensors);
      const TracedUnit t =
          trace_unit([&f, n](const std::vector<torch::Tensor>& v) { return std::vector{f(v[n])}; }, in);
      if (!t.reads.empty())  // as trace_graph says it of block 0
        throw GraphRefusal("compile.mode = \"inductor\": " + what +
                           " cannot be compiled as traced: " + t.reads.front() +
                           " reads a value out of a tensor on the host (item(), a branch on a tensor's value), which "
                           "the graph would hold as a constant (compile.mode = \"off\" trains it eager)");
      text = graph_text(*t.graph);
    }
    const auto it = seen_.find(unit);
    if (it == seen_.end()) {
      seen_[unit] = text;
      first_params_[unit] = params.names;
      add(unit, params, f, x, what);
      return;
    }
    if (params.names != first_params_[unit] || text != it->second)
      throw GraphRefusal("compile.granularity = \"blocks\": " + what + " computes another graph than block " +
                         prefixes_.at(0) + "'s (one package serves every block): compile.granularity = \"step\", or " +
                         "compile.mode = \"off\"");
  }

  models::Model& model_;
  BlockStructure& bs_;
  std::vector<std::string> prefixes_;
  std::vector<Named> blocks_;
  Named root_;
  std::map<std::string, std::string> seen_;  // unit -> block 0's graph text ("" for the root's)
  std::map<std::string, std::vector<std::string>> first_params_;
  std::vector<std::pair<std::string, GraphFile>> units_;
  std::exception_ptr error_;
};

// The seams as they were before the probe forward (activation checkpointing's runner stays).
struct KeepSeams {
  BlockStructure& bs;
  BlockStructure::BlockRun block = bs.block_runner;
  BlockStructure::RootRun root = bs.root_runner;
  BlockStructure::RegionRun region = bs.region_runner;
  ~KeepSeams() {
    bs.block_runner = std::move(block);
    bs.root_runner = std::move(root);
    bs.region_runner = std::move(region);
  }
};

}  // namespace

GraphFile trace_block_units(models::Model& model, const torch::Tensor& input, const torch::Tensor& target,
                            const LossFn& loss, bool regions) {
  BlockStructure* bs = model.block_structure();
  if (!bs || model.block_prefixes().empty())
    throw InputError("compile.granularity = \"blocks\": model " + model.name() +
                     " has no blocks (a model declares them with keel::models::BlockStructure)");
  if (bs->block_compiled || bs->region_compiled || bs->root_compiled)
    throw std::logic_error("trace_block_units: model " + model.name() + " already runs compiled units");
  Probe probe(model, *bs);
  torch::Tensor logits;
  {
    KeepSeams keep{*bs};
    size_t calls = 0;  // the blocks run in order: the call's index is the block's
    if (regions) {
      bs->region_runner = [&probe](size_t i, BlockStructure::Region r, const BlockStructure::BlockFunction& f,
                                   const torch::Tensor& x) {
        probe.region(i, r, f, x);
        return f(x);
      };
    } else {
      bs->block_runner = [&probe, &calls](BlockStructure::BlockFunction f, const torch::Tensor& x) {
        probe.block(calls++, f, x);
        return f(x);
      };
      bs->root_runner = [&probe](BlockStructure::RootPart part, const BlockStructure::RootFunction& f,
                                 const torch::Tensor& x) {
        probe.root(part, f, x);
        return f(x);
      };
    }
    logits = model.forward(input);
  }
  if (!regions) probe.loss(loss, logits, target);
  auto units = probe.take(regions ? std::vector<std::string>{"attention", "mlp"} : std::vector<std::string>{"block"});
  return bundle_units(std::move(units));
}

GraphFile bundle_units(std::vector<std::pair<std::string, GraphFile>> units) {
  GraphFile out;
  out.json = {{"format", "keel-graphs/1"}, {"units", nlohmann::json::object()}};
  Sha256 h;
  for (auto& [name, unit] : units) {
    unit.json["tensor_base"] = out.tensors.size();
    out.json["units"][name] = std::move(unit.json);
    out.tensors.insert(out.tensors.end(), unit.tensors.begin(), unit.tensors.end());
    const std::string line = name + " " + unit.fingerprint + "\n";
    h.update(line.data(), line.size());
  }
  out.fingerprint = h.hex();
  return out;
}

}  // namespace keel
