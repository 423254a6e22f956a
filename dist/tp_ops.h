// dist/tp_ops.h: the communication of tensor and sequence parallelism, as autograd functions over
// the tp axis's Collectives (Megatron-LM's regions, Shoeybi et al. 2019; Korthikanti et al. 2022).
// Written once here; the transformer block applies them where its family's plan
// (models/transformer.h's tp_plan) shards a matrix.
//
//   x -> copy_to_region -> column-parallel linear -> ... -> row-parallel linear -> reduce_from_region
//        (identity; backward all-reduce)                                          (all-reduce; backward identity)
//
// With sequence parallelism the pair becomes gather_sequence (all-gather of the sequence shards
// in; reduce-scatter backward) and scatter_sequence (reduce-scatter out; all-gather backward):
// the same bytes on the wire, and what lies between regions (norms, dropout, residual adds) runs
// on 1/tp of the tokens.
//
// The vocabulary-parallel pair: an embedding whose rows are split over the tp ranks, and the
// cross-entropy over logits split the same way, computed from each rank's shard with two
// all-reduces per token (the maximum; then the sum of exponentials and the target's logit
// together), never gathering the full logits. Targets are ids of the vocabulary or the ignore
// index; another outside every rank's range is not caught here (trainer/loss.h checks batches).
//
// Every call goes through the Collectives' door (validated, counted, observed); each is a
// collective over the tp group: every rank of the group calls it in the same order with the same
// shapes. `tp` must outlive the autograd graph that uses it (the mesh owns it for the run).
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <vector>

#include "keel/dist/collectives.h"

namespace keel::dist::tp {

/// Identity forward; backward, the gradient summed over the tp group. Before a column-parallel
/// layer, whose ranks each read the whole input.
torch::Tensor copy_to_region(const torch::Tensor& x, Collectives& tp);
/// Forward, `x` summed over the tp group; identity backward. After a row-parallel layer, whose
/// ranks each hold a partial sum.
torch::Tensor reduce_from_region(const torch::Tensor& x, Collectives& tp);
/// Sequence parallel, entering a tensor-parallel region: every rank's shard of `x` along `dim`
/// concatenated in rank order (all-gather); backward, the gradient reduce-scattered back to
/// this rank's shard.
torch::Tensor gather_sequence(const torch::Tensor& x, int64_t dim, Collectives& tp);
/// Sequence parallel, leaving a tensor-parallel region: `x` (a partial sum, whole along `dim`)
/// summed over the group and this rank's chunk along `dim` kept (reduce-scatter); backward, the
/// gradient all-gathered. `dim`'s size must divide by the group's size.
torch::Tensor scatter_sequence(const torch::Tensor& x, int64_t dim, Collectives& tp);

/// The rows [first, first + n) of a vocabulary of `vocab` split over `ranks` ranks: rank r
/// holds rows r * vocab / ranks onwards (`vocab` divisible by `ranks`).
struct VocabRange {
  int64_t first = 0, n = 0;
  static VocabRange of(int64_t vocab, int64_t ranks, int64_t rank);
};

/// The embedding of `ids` (int64, (B, T, ...)) from this rank's rows `weight` (n x width) of the
/// vocabulary range `range`: each rank looks up the ids it holds (zeros for the others) and the
/// lookups are summed over the group (reduce_from_region), or with `sequence_parallel`
/// reduce-scattered to this rank's T / tp positions along dim 1 (scatter_sequence).
/// `padding_idx`: an id of the whole vocabulary whose row gets no gradient (torch's embedding's
/// padding_idx), or -1.
torch::Tensor vocab_parallel_embedding(const torch::Tensor& ids, const torch::Tensor& weight, VocabRange range,
                                       Collectives& tp, bool sequence_parallel = false, int64_t padding_idx = -1);

/// Sums the gradients of `params` over the tp group in place, in one all-reduce of them
/// flattened (a parameter without a gradient gets zeros first, so every rank sums alike). Sequence
/// parallelism's replicated parameters, whose gradient each rank computes from its positions.
void sum_gradients(const std::vector<torch::Tensor>& params, Collectives& tp);

/// The mean cross-entropy of `logits` (N x n: this rank's vocabulary columns `range` of each
/// token's logits) against `target` (N, int64 ids over the whole vocabulary), equal to
/// torch's cross_entropy(ignore_index) over the gathered logits up to rounding: tokens whose
/// target is `ignore_index` add nothing, the mean is over the others (0 when there are none, as
/// trainer/loss.h's cross_entropy). In float32 for 16- and 32-bit logits (double stays double);
/// returns a scalar of that dtype, the same on every rank of the group; its backward gives each
/// rank its columns' gradient, in the logits' dtype.
torch::Tensor vocab_parallel_cross_entropy(const torch::Tensor& logits, const torch::Tensor& target, VocabRange range,
                                           Collectives& tp, int64_t ignore_index = -100);

/// The index over the whole vocabulary of each row's largest logit, from this rank's columns
/// `range` of `logits` (N x n): the first such index when several are equal, as torch's argmax.
/// Two all-reduces of one value per row (the maximum, then the smallest index holding it). No
/// gradient. Returns (N) int64, the same on every rank of the group.
torch::Tensor vocab_parallel_argmax(const torch::Tensor& logits, VocabRange range, Collectives& tp);

}  // namespace keel::dist::tp
