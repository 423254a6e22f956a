// trainer/compile/unit_trace.h: the units of compile.granularity = "blocks" traced from the model's
// own C++ code (issue 65): the transformer block, the root's embeddings, head and loss, and under
// tensor parallelism the block's two regions between its collectives, as the sharded block
// computes them.
//
// Owns: one probe forward of the placed model on the example batch, with the model's seams
// (models::BlockStructure's block_runner, root_runner and region_runner) set for that forward
// only, so that each unit's eager code is reached as the model runs it and traced there by
// graph_file.h's trace_graph (its parameters and input as graph inputs, its checks); every other
// block's graph compared with block 0's (one package serves every block); each root part and
// region given the parameters it reads, no more; and the bundle of the units' graphs as one
// "keel-graphs/1" file for the packaging step. A refusal found while the forward runs is kept
// until the forward has finished (under tensor parallelism the forward runs the tp group's
// collectives: every rank completes it), then thrown. Does not own: the packaging (inductor.h),
// loading the units (inductor_block.h).
#pragma once

#include <torch/torch.h>

#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "keel/models/model.h"
#include "trainer/compile/graph_file.h"

namespace keel {

using LossFn = std::function<torch::Tensor(const torch::Tensor&, const torch::Tensor&)>;

/// The units of `model` (placed; under the caller's autocast) traced on one forward of `input`:
/// without `regions`, "block" (block 0 between its hooks), "embed" and "head" (where the model's
/// forward gives them to BlockStructure::root_call as functions of their input) and "loss"
/// (`loss` of the logits and `target`, in float32, traced with the root); with `regions` (tp > 1:
/// the model sharded), "attention" and "mlp", block 0's regions. Throws InputError for a model
/// without blocks, GraphRefusal (a block that differs from block 0, what trace_graph refuses) or
/// CompileError (what the graph file cannot carry).
GraphFile trace_block_units(models::Model& model, const torch::Tensor& input, const torch::Tensor& target,
                            const LossFn& loss, bool regions);

/// Each block's parameter names, relative to the block, and the tensors, in the model's order (the
/// blocks as `prefixes` name them); and the root's (every parameter in no block: embeddings, final
/// norm, an untied head).
struct BlockParameters {
  std::vector<std::vector<std::string>> names;
  std::vector<std::vector<torch::Tensor>> tensors;
  std::vector<std::string> root_names;
  std::vector<torch::Tensor> root_tensors;
};
BlockParameters block_parameters(const models::Model& model, const std::vector<std::string>& prefixes);

/// Named unit graphs as one file: {"format": "keel-graphs/1", "units": {name: the unit's keel-graph/1
/// JSON with "tensor_base", where its tensors start}}; the tensors one after the other; the
/// fingerprint the SHA-256 of the units' names and fingerprints.
GraphFile bundle_units(std::vector<std::pair<std::string, GraphFile>> units);

}  // namespace keel
