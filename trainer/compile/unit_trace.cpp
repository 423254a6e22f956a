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

// The unit `f` on input n of its inputs (its parameters come first).
UnitFn on_input(const BlockStructure::BlockFunction& f, size_t n) {
  return [&f, n](const std::vector<torch::Tensor>& v) { return std::vector<torch::Tensor>{f(v[n])}; };
}

// A unit's graph inputs: its parameters, then its input `x`.
std::vector<torch::Tensor> with_input(std::vector<torch::Tensor> params, const torch::Tensor& x) {
  params.push_back(x.detach());
  return params;
}

class Probe {
 public:
  explicit Probe(models::Model& model) : model_(model), prefixes_(model.block_prefixes()) {
    BlockParameters p = block_parameters(model, prefixes_);
    for (size_t i = 0; i < prefixes_.size(); ++i) blocks_.push_back({std::move(p.names[i]), std::move(p.tensors[i])});
    root_ = {std::move(p.root_names), std::move(p.root_tensors)};
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
    const size_t n = all.tensors.size();
    const TracedUnit t = trace_unit(on_input(f, n), with_input(all.tensors, x));
    Named used;
    const auto inputs = t.graph->inputs();
    for (size_t k = 0; k < n; ++k)
      if (!inputs[k]->uses().empty()) used.names.push_back(all.names[k]), used.tensors.push_back(all.tensors[k]);
    return used;
  }

  void add(const std::string& unit, const Named& params, const BlockStructure::BlockFunction& f, const torch::Tensor& x,
           const std::string& what) {
    TracingValues values(params.tensors);
    std::vector<GraphInput> names;
    for (const auto& n : params.names) names.push_back({n, "parameter"});
    names.push_back({"input", "input"});
    units_.emplace_back(unit, trace_graph(on_input(f, params.tensors.size()), with_input(params.tensors, x), names,
                                          what, /*vary_data=*/true));
  }

  // Unit `unit` of block i: block 0's traced and checked; another block's graph must be block 0's
  // (its own parameters in the same places), as one package serves them all.
  void same_as_block_0(const std::string& unit, size_t i, const Named& params, const BlockStructure::BlockFunction& f,
                       const torch::Tensor& x, const std::string& what) {
    std::string text;
    {
      TracingValues values(params.tensors);
      const TracedUnit t = trace_unit(on_input(f, params.tensors.size()), with_input(params.tensors, x));
      refuse_reads(t, what);  // as trace_graph refuses them in block 0
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
  Probe probe(model);
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

BlockParameters block_parameters(const models::Model& model, const std::vector<std::string>& prefixes) {
  BlockParameters b;
  b.names.resize(prefixes.size());
  b.tensors.resize(prefixes.size());
  for (const auto& [name, p] : model.named_parameters()) {
    bool in_block = false;
    for (size_t i = 0; i < prefixes.size() && !in_block; ++i)
      if (name.rfind(prefixes[i], 0) == 0) {
        b.names[i].push_back(name.substr(prefixes[i].size()));
        b.tensors[i].push_back(p);
        in_block = true;
      }
    if (!in_block) b.root_names.push_back(name), b.root_tensors.push_back(p);
  }
  return b;
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
