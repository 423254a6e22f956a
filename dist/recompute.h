// dist/recompute.h: the third transform of dist/transform_plan.h: activation checkpointing
// (train.activation_checkpointing), each block's activations freed after its forward and
// recomputed in backward. It comes after the tensor-parallel shard (a block recomputes its own
// shard, its tp collectives included) and before compile; it runs inside dist.zero = 3's gather
// of the block (BlockStructure's enter / leave), so the recomputation finds the block whole.
//
// Owns: recompute(), torch.utils.checkpoint's reentrant variant for LibTorch (which has none):
// the forward runs without autograd and keeps only its input; its backward runs the block again
// with autograd, under the random generators' states and the autocast state of the forward (the
// same dropout masks, the same dtypes), and backpropagates through it, so the parameters'
// gradients come from the same kernels as without recomputation. `selective` also keeps the
// block's dense products (every one; torchtitan's op policy keeps every other matmul and also
// attention's output and the reduce-scatters), and the recomputation makes everything but them
// again: norms, activations, attention, dropout, tp collectives.
// Does not own: which blocks a model has (BlockStructure), what a block computes.
#pragma once

#include <torch/torch.h>

#include "dist/transform_plan.h"
#include "keel/models/model.h"

namespace keel::dist {

/// f(x), keeping only x for the backward, which recomputes f(x) and backpropagates through it
/// (f is kept until then). Recompute::Selective also keeps the outputs of f's dense products
/// (models::DenseTape: a transformer block's projections), which the recomputation takes instead
/// of multiplying again, with the gradients autograd's own product would give. Without grad mode,
/// or Recompute::None: f(x).
torch::Tensor recompute(models::BlockStructure::BlockFunction f, const torch::Tensor& x,
                        Recompute policy = Recompute::Blocks);

/// Runs each block of `model` through recompute() with `policy`, recorded in `plan`. Throws
/// InputError naming train.activation_checkpointing for a model that is not a transformer family
/// (gpt, gpt2, llama: their blocks run through BlockStructure::block_run).
void wrap_recompute(models::Model& model, Recompute policy, TransformPlan& plan);

}  // namespace keel::dist
