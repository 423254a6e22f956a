// trainer/compile/compile.h: the static-graph compile stage (compile.mode = trace).
//
// Owns: capturing a model's forward as a TorchScript graph with the TorchScript tracer (a C++
// module's parameters are passed as graph inputs, so they stay trainable), running it through
// a GraphFunction (autograd flows through the graph), and catching the ways a traced graph
// silently differs from the model:
//   a. data-dependent control flow ("graph break"): tracing again from an input with other
//      values gives another graph, or the tracer warned that a tensor became a scalar;
//   b. computation the tracer cannot see: the graph and eager forward disagree on a fresh input
//      ("untraceable computation");
//   c. non-deterministic ops in the graph (dropout, bernoulli, randperm, ...): a warning, or an
//      error with compile.deterministic;
//   d. shape guards: an input of another shape re-specialises the graph (counted and logged),
//      at most compile.max_recompiles times ("recompilation storm");
//   e. device transfers inside forward (aten::to / cuda / cpu to a device).
// With compile.fullgraph, a, b and e are errors naming the cause; without, a warning and the
// eager module is used instead.
// With compile.cache_dir, a traced graph is stored and reused across runs and ranks
// (trainer/compile/compile_cache.h); a hit skips tracing and the checks (they passed when the entry
// was made). Does not own: CUDA graphs.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "keel/models/model.h"
#include "keel/trainer/config/config.h"

namespace keel {

/// The compile stage refused the model (fullgraph, deterministic, or a recompilation storm).
class CompileError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// compile.mode = "inductor": keel's C++ code does something a traced graph would bake in silently
/// (trainer/compile/graph_file.h): a value read out of a tensor, another graph for a second input,
/// a device transfer. The user's model, never an eager fallback: exit 2 on every rank.
class GraphRefusal : public CompileError {
 public:
  using CompileError::CompileError;
};

struct CompileReport {
  std::string mode = "off";    // off | trace | inductor | eager-fallback
  double compile_ms = 0;       // time spent tracing and checking
  int64_t recompiles = 0;      // re-specialisations after the first trace
  std::string cache = "off";   // off | hit | miss | checkpoint (inductor: the package stored with the checkpoint)
  std::string package;         // inductor: the package's path
  std::string package_sha256;  // inductor: its SHA-256
  std::vector<std::string> warnings;
};

/// Wraps `model` for compile.mode = trace. `example` is an input of the training shape (on the
/// model's device). `identity` names the model and its config for the compile cache (required
/// when compile.cache_dir is set). Returns the model to train: the traced one, or `model`
/// itself after a fallback. Throws CompileError as described above.
std::shared_ptr<models::Model> compile_model(std::shared_ptr<models::Model> model, const CompileConfig& cfg,
                                             const torch::Tensor& example, CompileReport& report,
                                             const std::string& identity = "");

/// The traced graph of `model` (as returned by compile_model) for its training input shape, as
/// a self-contained TorchScript module: the parameters become attributes (dots in their names
/// replaced by "__"), forward(input) runs the graph. torch::jit::load / torch.jit.load serve it
/// without keel's model code. Returns "" when `model` is not a traced model (compile.mode =
/// off, or an eager fallback).
std::string export_traced_module(models::Model& model);

/// Node kinds treated as non-deterministic inside a graph.
const std::vector<std::string>& nondeterministic_ops();

}  // namespace keel
