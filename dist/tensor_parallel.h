// dist/tensor_parallel.h: the second transform of dist/transform_plan.h: each block's matrices
// sharded over the mesh's tp axis by its family's plan (models/transformer.h's TransformerFamily::
// tp_plan: column-wise, row-wise, vocabulary-parallel), and the block's regions set to
// dist/tp_ops.h's communication. Under tp > 1 the tp ranks of one dp coordinate read the same
// batch (the sampler asks mesh.dp()), and data parallelism runs over the dp axis only
// (distribute() takes its Collectives; ZeRO with tp is refused until they compose).
//
// In place today: shard_block(), one block at a time, and shard_model_tensor_parallel() for the
// gpt family (tests/test_tp_ops.cpp), applied by place() when parallel.tp > 1 (eager, over DDP;
// trainer/config/config.cpp refuses the rest by name).
#pragma once

#include <vector>

#include "dist/mesh.h"
#include "dist/tp_ops.h"
#include "dist/transform_plan.h"
#include "keel/dist/collectives.h"
#include "keel/models/model.h"
#include "models/transformer.h"

namespace keel::dist {

/// Shards `model`'s parameters over the mesh's tp axis in place (tp = 1: none; else
/// shard_model_tensor_parallel on mesh.on(Axis::Tp)), recorded in `plan`.
void shard_tensor_parallel(models::Model& model, const Mesh& mesh, TransformPlan& plan);

/// Shards a whole model of a transformer family over the tp group `tp` (rank tp.rank() of
/// tp.size()): every block by the family's plan (shard_block), the token embedding and the
/// output projection by vocabulary; its logits are then this rank's vocabulary columns
/// (tp::vocab_parallel_cross_entropy takes them, with tp::VocabRange::of(vocab, tp.size(),
/// tp.rank())). Throws InputError for a model without a tensor-parallel plan (only gpt has
/// one yet) or a vocabulary that does not divide by tp, naming model.name or model.vocab.
/// Sequence parallelism of a whole model is not there yet (shard_block has it). The model keeps
/// references to `tp`, which must outlive it. Returns this rank's vocabulary range.
tp::VocabRange shard_model_tensor_parallel(models::Model& model, Collectives& tp);

/// Keeps this rank's part (rank tp.rank() of tp.size()) of each of `block`'s parameters that a
/// rule of `plan` matches (the rules' suffixes relative to the block), and sets the block's
/// regions: Megatron's copy / reduce pair, or with `sequence_parallel` the all-gather /
/// reduce-scatter pair over the sequence dimension (then the block's input and output are this
/// rank's T / tp positions, and the gradients of its replicated parameters (norms, the
/// row-parallel biases) are partial sums over the tp group, to be summed over it).
/// Throws std::invalid_argument when heads, kv_heads or a split dimension does not divide by
/// tp.size(). `tp` must outlive the block.
void shard_block(models::TransformerBlockImpl& block, const std::vector<models::TpRule>& plan, Collectives& tp,
                 bool sequence_parallel);

}  // namespace keel::dist
