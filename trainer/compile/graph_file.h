// trainer/compile/graph_file.h: the graph keel traces from its own C++ code, as the packaging
// step receives it (compile.mode = "inductor"; issue 65: one model, compiled as it is trained).
//
// Owns: tracing one compile unit (a function of tensors: the whole training step, forward and
// loss) with the TorchScript tracer, with the unit's parameters, buffers, input and target as
// graph inputs; refusing, by name, what a trace would bake in silently (a value read out of a
// tensor with item() and its kin, a graph that differs for a second input of the same shape, a
// tracer warning, a device transfer, a graph that disagrees with the eager code on a fresh input);
// and writing the graph as a "keel-graph/1" file: JSON (the inputs with names, kinds, shapes and
// dtypes; each node an ATen op by schema name and overload with its arguments as references to
// earlier values or constants; the outputs) plus a tensor file beside it (the graph's tensor
// constants, the example batch and the buffers' values), and its fingerprint (SHA-256 of the JSON
// and the constants' bytes, device-neutral: the same graph gives the same fingerprint on every
// rank and device). trainer/compile/aot_package.py --graph replays it through torch.ops inside
// its make_fx / AOTInductor pipeline. Does not own: the packaging (inductor.h), the cache.
#pragma once

#include <torch/torch.h>

#include <nlohmann/json.hpp>

#include <functional>
#include <string>
#include <vector>

#include "keel/models/model.h"

namespace torch::jit {
struct Graph;
}

namespace keel {

/// One graph input: its name and kind (parameter | buffer | input | target).
struct GraphInput {
  std::string name, kind;
};

/// A traced unit ready for the packaging step.
struct GraphFile {
  nlohmann::json json;                 // "keel-graph/1"
  std::vector<torch::Tensor> tensors;  // constants, then the example batch and buffers (on the CPU)
  std::string fingerprint;             // hex SHA-256 of the JSON and the tensor constants' bytes
  /// Writes `path` (the JSON) and `path` + ".pt" (the tensors, torch.load reads them), atomically.
  void write(const std::string& path) const;
};

/// The function traced: the unit's inputs in, its outputs out.
using UnitFn = std::function<std::vector<torch::Tensor>(const std::vector<torch::Tensor>&)>;

/// One trace of `fn` on `inputs` by the TorchScript tracer (a tensor `fn` reads is a graph input
/// when it is one of `inputs`, by identity; a constant otherwise), with the first line of each
/// tracer warning and the ops that read a value out of a tensor on the host (item(), is_nonzero,
/// equal, allclose: seen by a RecordFunction observer) while it ran. One trace at a time. Shared
/// by compile.mode = "trace" (trainer/compile/compile.cpp) and the units traced here.
struct TracedUnit {
  std::shared_ptr<torch::jit::Graph> graph;
  std::vector<std::string> warnings, reads;
};
TracedUnit trace_unit(const UnitFn& fn, const std::vector<torch::Tensor>& inputs);

/// Throws GraphRefusal for `what` when `t` read a value out of a tensor on the host (item() and
/// its kin): whatever the code did with it would be a constant of the graph.
void refuse_reads(const TracedUnit& t, const std::string& what);

/// A tensor of x's shape and dtype with other values (random; class indices below x's maximum + 1).
torch::Tensor other_values(const torch::Tensor& x);
/// The inputs a second-input check traces again from: other values and, for floating-point x, -x
/// and large all-positive and all-negative ones, which flip value-based branches (`x.sum() > 0`).
std::vector<torch::Tensor> other_inputs(const torch::Tensor& x);
/// A graph's text without source locations: equal for two traces that recorded the same ops.
std::string graph_text(const torch::jit::Graph& g);

/// Traces `fn` on `inputs` (named by `names`, in order) and checks the graph as above. `what`
/// names the unit in messages ("the training step of model gpt"); `vary_data`: the data inputs
/// (kinds input and target) are given other values for the second-input and fresh-input checks.
/// Throws GraphRefusal (the unit's doing) or CompileError (what the file cannot carry).
GraphFile trace_graph(const UnitFn& fn, const std::vector<torch::Tensor>& inputs, const std::vector<GraphInput>& names,
                      const std::string& what, bool vary_data);

/// The whole training step of `model` as keel's eager step computes it (trainer/step/step.cpp:
/// loss(model.forward(input), target) in float32, under the autocast the caller set): parameters,
/// buffers, input and target in; the loss out. The model's buffers and the random generators are as
/// before afterwards (tracing runs the forward).
GraphFile trace_training_step(models::Model& model, const torch::Tensor& input, const torch::Tensor& target,
                              const std::function<torch::Tensor(const torch::Tensor&, const torch::Tensor&)>& loss);

}  // namespace keel
