// dist/tensor_parallel.h: the second transform of dist/transform_plan.h: each block's matrices
// sharded over the mesh's tp axis by its family's plan (models/transformer.h's TransformerFamily::
// tp_plan: column-wise, row-wise, vocabulary-parallel), and the block's regions set to
// dist/tp_ops.h's communication. Under tp > 1 the tp ranks of one dp coordinate read the same
// batch (the sampler asks mesh.dp()), and data parallelism (DDP or ZeRO 1-3) runs over the dp
// axis only (distribute() takes its Collectives): ZeRO shards the tp shards.
//
// In place: shard_block(), one block at a time, and shard_model_tensor_parallel() for the gpt,
// gpt2 and llama families, with or without sequence parallelism (tests/test_tp_ops.cpp),
// applied by place() when parallel.tp > 1 (eager; trainer/config/config.cpp refuses the rest by
// name).
#pragma once

#include <optional>
#include <vector>

#include "dist/mesh.h"
#include "dist/tp_ops.h"
#include "dist/transform_plan.h"
#include "keel/dist/collectives.h"
#include "keel/models/model.h"
#include "models/deferred_init.h"
#include "models/transformer.h"

namespace keel::dist {

/// A whole model sharded over a tp group: this rank's vocabulary range, each parameter's split,
/// and what that leaves for the step's gradients.
struct TensorParallelShard {
  tp::VocabRange range;
  /// Per model parameter, in model order: its split (nullopt: replicated, every tp rank holds it
  /// whole; a plan's Replicate rule is recorded so).
  std::vector<std::optional<models::TpRule>> rules;
  bool sequence_parallel = false;
  /// Per parameter: not split.
  std::vector<bool> replicated() const;
  /// Per parameter: with sequence parallelism each replicated one (norms, the row-parallel
  /// biases, a position embedding) gets from each tp rank a gradient of its own positions only,
  /// to be summed over the tp group once a step's backward is complete (tp::sum_gradients).
  std::vector<bool> partial() const;
};

/// torch.nn.utils.clip_grad_norm_ over a tensor-parallel model: the norm of every split
/// parameter's parts over the tp group, and of each replicated parameter once (tp rank 0's;
/// every tp rank holds the same), then every held gradient scaled by max_norm / (norm + 1e-6)
/// clamped to 1. `held`: the tensors whose gradients this rank keeps, `replicated[k]` whether
/// held[k] is (part of) a replicated parameter. Without `dp` they are whole parameters whose
/// gradients are already whole over dp (DDP), so the squares are summed over tp (one
/// all-reduce); with `dp` they are this rank's ZeRO parts (dist.zero >= 1: owned parameters or
/// pieces, distinct on each dp rank), summed over dp, then over tp. Returns the norm, the same on
/// every rank of the mesh.
torch::Tensor clip_grad_norm_tensor_parallel(const std::vector<torch::Tensor>& held,
                                             const std::vector<bool>& replicated, Collectives& tp, double max_norm,
                                             Collectives* dp = nullptr);

/// Shards `model`'s parameters over the mesh's tp axis in place (tp = 1: none; else
/// shard_model_tensor_parallel on mesh.on(Axis::Tp)), recorded in `plan` with what that means
/// for the gradients (TransformPlan::set_split_gradients: the data-parallel transform sums the
/// partial ones and clips over the mesh) and how a checkpoint holds the parameters whole
/// (TransformPlan::set_sharded_parameters: dist/tp_checkpoint.h).
/// `deferred` (sharded initialisation, models/deferred_init.h): the parameters it holds keep
/// their tp slices once made, and nothing is made here. A pipeline stage's model (dist/stages.h's
/// StageModel) is sharded as its whole model, and the gradients' flags and the checkpoint's slices
/// are of the parameters its stages hold (composed with the stage's own: StageParameters).
void shard_tensor_parallel(models::Model& model, const Mesh& mesh, bool sequence_parallel, TransformPlan& plan,
                           models::DeferredInit* deferred = nullptr);

/// Shards a whole model of a transformer family over the tp group `tp` (rank tp.rank() of
/// tp.size()): every block by the family's plan (shard_block), the token embedding and the
/// output projection by vocabulary; its logits are then this rank's vocabulary columns
/// (tp::vocab_parallel_cross_entropy takes them, with the returned range). With
/// `sequence_parallel` the embeddings' output is reduce-scattered to T / tp positions per rank,
/// the norms, dropout and residual adds run on them, and the output projection gathers the whole
/// sequence again (T must divide by tp). Throws InputError naming the key for a model without a
/// tensor-parallel plan (model.name), or a model.vocab, model.heads, model.kv_heads or MLP width
/// that does not divide by tp. The model keeps references to `tp`, which must outlive it.
TensorParallelShard shard_model_tensor_parallel(models::Model& model, Collectives& tp, bool sequence_parallel = false,
                                                models::DeferredInit* deferred = nullptr);

/// `model` sharded as tp rank 0 of `size` holds it, without a group (keel compile: the units traced
/// from the sharded block, trainer/compile/unit_trace.h): every block's and the vocabulary's
/// parameters cut to rank 0's part, every collective a local stand-in of the right shape (the
/// regions' enter and leave the identity, the vocabulary lookup a local one). Its forward runs, with
/// values that are not a model's: only the shapes and the regions' code are of use.
void shard_as_tp_rank_0(models::Model& model, int64_t size);

/// Keeps this rank's part (rank tp.rank() of tp.size()) of each of `block`'s parameters that a
/// rule of `plan` matches (the rules' suffixes relative to the block), and sets the block's
/// regions: Megatron's copy / reduce pair, or with `sequence_parallel` the all-gather /
/// reduce-scatter pair over the sequence dimension (then the block's input and output are this
/// rank's T / tp positions, and the gradients of its replicated parameters (norms, the
/// row-parallel biases) are partial sums over the tp group, to be summed over it).
/// Throws InputError naming model.heads, model.kv_heads or the MLP's width when one does not
/// divide by tp.size() (std::invalid_argument for another split dimension). `tp` must outlive the block.
void shard_block(models::TransformerBlockImpl& block, const std::vector<models::TpRule>& plan, Collectives& tp,
                 bool sequence_parallel, models::DeferredInit* deferred = nullptr);

}  // namespace keel::dist
