// dist/tensor_parallel.h: the second transform of dist/transform_plan.h: each block's matrices
// sharded over the mesh's tp axis by its family's plan (models/transformer.h's TransformerFamily::
// tp_plan: column-wise, row-wise, vocabulary-parallel), and the block's regions set to
// dist/tp_ops.h's communication. Under tp > 1 the tp ranks of one dp coordinate read the same
// batch (the sampler asks mesh.dp()), and data parallelism runs over the dp axis only
// (distribute() takes its Collectives; ZeRO with tp is refused until they compose).
//
// In place: shard_block(), one block at a time, and shard_model_tensor_parallel() for the gpt,
// gpt2 and llama families, with or without sequence parallelism (tests/test_tp_ops.cpp),
// applied by place() when parallel.tp > 1 (eager, over DDP; trainer/config/config.cpp refuses
// the rest by name).
#pragma once

#include <optional>
#include <vector>

#include "dist/mesh.h"
#include "dist/tp_ops.h"
#include "dist/transform_plan.h"
#include "keel/dist/collectives.h"
#include "keel/models/model.h"
#include "models/transformer.h"

namespace keel::dist {

/// What the tensor-parallel transform leaves for the step: with sequence parallelism, the
/// replicated parameters (norms, the row-parallel biases, a position embedding) whose gradient
/// each tp rank computes from its own positions only; finish() sums them over the tp group (one
/// all-reduce, tp::sum_gradients) once a step's backward is complete. Empty otherwise: a no-op.
class PartialGradients {
 public:
  PartialGradients() = default;
  PartialGradients(std::vector<torch::Tensor> params, Collectives& tp) : params_(std::move(params)), tp_(&tp) {}
  void finish() const {
    if (tp_ && !params_.empty()) tp::sum_gradients(params_, *tp_);
  }
  size_t size() const { return params_.size(); }

 private:
  std::vector<torch::Tensor> params_;
  Collectives* tp_ = nullptr;
};

/// A whole model sharded over a tp group: this rank's vocabulary range, and what its step must
/// finish (PartialGradients).
struct TensorParallelShard {
  tp::VocabRange range;
  PartialGradients partial;
  /// Per model parameter, in model order: its split (nullopt: replicated, every tp rank holds it whole).
  std::vector<std::optional<models::TpRule>> rules;
};

/// torch.nn.utils.clip_grad_norm_ over a tensor-parallel model (data parallelism at dist.zero = 0
/// over the rest of the mesh, so every gradient here is already whole over dp): the norm of
/// every split parameter's parts over the tp group, and of each replicated parameter once (tp
/// rank 0's; every tp rank holds the same), one all-reduce; every gradient is then scaled by
/// max_norm / (norm + 1e-6) clamped to 1. Returns the norm, the same on every tp rank.
torch::Tensor clip_grad_norm_tensor_parallel(const std::vector<torch::Tensor>& params,
                                             const std::vector<bool>& replicated, Collectives& tp, double max_norm);

/// Shards `model`'s parameters over the mesh's tp axis in place (tp = 1: none; else
/// shard_model_tensor_parallel on mesh.on(Axis::Tp)), recorded in `plan` with what the step must
/// do for it: the partial gradients' sum after each backward (TransformPlan::on_backward_complete)
/// and the clip over the mesh (TransformPlan::set_gradient_clip); and how a checkpoint holds the
/// parameters whole (TransformPlan::set_sharded_parameters: dist/tp_checkpoint.h).
void shard_tensor_parallel(models::Model& model, const Mesh& mesh, bool sequence_parallel, TransformPlan& plan);

/// Shards a whole model of a transformer family over the tp group `tp` (rank tp.rank() of
/// tp.size()): every block by the family's plan (shard_block), the token embedding and the
/// output projection by vocabulary; its logits are then this rank's vocabulary columns
/// (tp::vocab_parallel_cross_entropy takes them, with the returned range). With
/// `sequence_parallel` the embeddings' output is reduce-scattered to T / tp positions per rank,
/// the norms, dropout and residual adds run on them, and the output projection gathers the whole
/// sequence again (T must divide by tp). Throws InputError naming the key for a model without a
/// tensor-parallel plan (model.name), or a model.vocab, model.heads, model.kv_heads or MLP width
/// that does not divide by tp. The model keeps references to `tp`, which must outlive it.
TensorParallelShard shard_model_tensor_parallel(models::Model& model, Collectives& tp, bool sequence_parallel = false);

/// Keeps this rank's part (rank tp.rank() of tp.size()) of each of `block`'s parameters that a
/// rule of `plan` matches (the rules' suffixes relative to the block), and sets the block's
/// regions: Megatron's copy / reduce pair, or with `sequence_parallel` the all-gather /
/// reduce-scatter pair over the sequence dimension (then the block's input and output are this
/// rank's T / tp positions, and the gradients of its replicated parameters (norms, the
/// row-parallel biases) are partial sums over the tp group, to be summed over it).
/// Throws InputError naming model.heads, model.kv_heads or the MLP's width when one does not
/// divide by tp.size() (std::invalid_argument for another split dimension). `tp` must outlive the block.
void shard_block(models::TransformerBlockImpl& block, const std::vector<models::TpRule>& plan, Collectives& tp,
                 bool sequence_parallel);

}  // namespace keel::dist
