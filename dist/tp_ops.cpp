#include "dist/tp_ops.h"

#include <limits>
#include <stdexcept>
#include <string>

namespace keel::dist::tp {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The group travels through the autograd context as an integer (saved_data holds IValues).
int64_t as_int(Collectives& c) { return static_cast<int64_t>(reinterpret_cast<intptr_t>(&c)); }
Collectives& group_of(int64_t tp) { return *reinterpret_cast<Collectives*>(static_cast<intptr_t>(tp)); }
Collectives& from(AutogradContext* ctx) { return group_of(ctx->saved_data["tp"].toInt()); }

torch::Tensor summed(const torch::Tensor& t, Collectives& tp, const char* what) {
  torch::Tensor s = t.clone(at::MemoryFormat::Contiguous);
  tp.all_reduce(s, ReduceOp::Sum, what);
  return s;
}

// Every rank's `x` along dim 0, concatenated in rank order.
torch::Tensor gathered(const torch::Tensor& x, Collectives& tp, const char* what) {
  const torch::Tensor shard = x.contiguous();
  std::vector<int64_t> shape = shard.sizes().vec();
  shape[0] *= tp.size();
  torch::Tensor full = torch::empty(shape, shard.options());
  tp.start_all_gather_into(full.view({-1}), shard.view({-1}), what).wait();
  return full;
}

// `x` summed over the group, this rank's chunk along dim 0.
torch::Tensor reduce_scattered(const torch::Tensor& x, Collectives& tp, const char* what) {
  const torch::Tensor full = x.contiguous();
  if (full.size(0) % tp.size() != 0)
    throw std::invalid_argument(std::string(what) + ": a dimension of " + std::to_string(full.size(0)) +
                                " does not divide over " + std::to_string(tp.size()) + " tp ranks");
  std::vector<int64_t> shape = full.sizes().vec();
  shape[0] /= tp.size();
  torch::Tensor shard = torch::empty(shape, full.options());
  tp.start_reduce_scatter(shard.view({-1}), full.view({-1}), what).wait();
  return shard;
}

struct CopyToRegion : torch::autograd::Function<CopyToRegion> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, int64_t tp) {
    ctx->saved_data["tp"] = tp;
    return x;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    return {summed(grad[0], from(ctx), "tp: gradient into a column-parallel region"), torch::Tensor()};
  }
};

struct ReduceFromRegion : torch::autograd::Function<ReduceFromRegion> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, int64_t tp) {
    return summed(x, group_of(tp), "tp: row-parallel partial sums");
  }
  static variable_list backward(AutogradContext*, variable_list grad) { return {grad[0], torch::Tensor()}; }
};

// Sequence parallel: `Gather` all-gathers forward and reduce-scatters backward; the other way
// round for scatter. Along dim 0 (the callers move the sequence dimension there).
template <bool Gather>
struct SequenceRegion : torch::autograd::Function<SequenceRegion<Gather>> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, int64_t tp) {
    ctx->saved_data["tp"] = tp;
    Collectives& g = from(ctx);
    return Gather ? gathered(x, g, "sp: sequence shards into a tp region")
                  : reduce_scattered(x, g, "sp: tp region out to sequence shards");
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    Collectives& g = from(ctx);
    return {Gather ? reduce_scattered(grad[0], g, "sp: gradient out of a tp region")
                   : gathered(grad[0], g, "sp: gradient into sequence shards"),
            torch::Tensor()};
  }
};

// The vocabulary-parallel cross-entropy (Megatron's): per token, the maximum logit over the
// whole vocabulary (one all-reduce), then the sum of exponentials and the target's shifted
// logit (one all-reduce of both). Backward: softmax minus the target's one-hot, on this rank's
// columns only. Tokens whose target is `ignore_index` count for nothing: the loss is the sum over
// the others divided by their number (at least 1), as trainer/loss.h's cross_entropy.
struct VocabCrossEntropy : torch::autograd::Function<VocabCrossEntropy> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& logits, const torch::Tensor& target,
                               int64_t first, int64_t tp, int64_t ignore_index) {
    Collectives& g = group_of(tp);
    const torch::Tensor l = logits.scalar_type() == torch::kDouble ? logits : logits.to(torch::kFloat);
    const int64_t n = l.size(1);
    torch::Tensor max = std::get<0>(l.max(1, /*keepdim=*/true)).contiguous();
    g.all_reduce(max, ReduceOp::Max, "tp: cross-entropy maximum");
    const torch::Tensor shifted = l - max;
    const torch::Tensor exp = shifted.exp();
    const torch::Tensor local = target.reshape({-1, 1}) - first;
    const torch::Tensor mine = local.ge(0).logical_and(local.lt(n));
    const torch::Tensor index = local.clamp(0, n - 1);
    // (masked with where, not a product: another rank's -inf logit would make 0 x -inf = NaN here)
    torch::Tensor sums = torch::cat({exp.sum(1, true), torch::where(mine, shifted.gather(1, index), 0.0)}, 1);
    g.all_reduce(sums, ReduceOp::Sum, "tp: cross-entropy sums");
    const torch::Tensor sum_exp = sums.select(1, 0).unsqueeze(1);
    const torch::Tensor counted = target.reshape({-1, 1}).ne(ignore_index);
    const torch::Tensor count = counted.sum().clamp_min(1).to(l.scalar_type());
    const torch::Tensor per_token = torch::where(counted, sum_exp.log() - sums.select(1, 1).unsqueeze(1), 0.0);
    const torch::Tensor loss = per_token.sum() / count;
    ctx->save_for_backward({exp / sum_exp, index, mine, counted, count});
    ctx->saved_data["dtype"] = static_cast<int64_t>(logits.scalar_type());
    return loss;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    const auto saved = ctx->get_saved_variables();
    torch::Tensor g = saved[0].clone();
    g.scatter_add_(1, saved[1], -saved[2].to(g.scalar_type()));
    g.mul_(saved[3].to(g.scalar_type())).mul_(grad[0] / saved[4]);
    const auto dtype = static_cast<c10::ScalarType>(ctx->saved_data["dtype"].toInt());
    return {g.to(dtype), torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

torch::Tensor copy_to_region(const torch::Tensor& x, Collectives& tp) {
  if (tp.size() == 1) return x;
  return CopyToRegion::apply(x, as_int(tp));
}

torch::Tensor reduce_from_region(const torch::Tensor& x, Collectives& tp) {
  if (tp.size() == 1) return x;
  return ReduceFromRegion::apply(x, as_int(tp));
}

torch::Tensor gather_sequence(const torch::Tensor& x, int64_t dim, Collectives& tp) {
  if (tp.size() == 1) return x;
  return SequenceRegion<true>::apply(x.movedim(dim, 0), as_int(tp)).movedim(0, dim);
}

torch::Tensor scatter_sequence(const torch::Tensor& x, int64_t dim, Collectives& tp) {
  if (tp.size() == 1) return x;
  return SequenceRegion<false>::apply(x.movedim(dim, 0), as_int(tp)).movedim(0, dim);
}

VocabRange VocabRange::of(int64_t vocab, int64_t ranks, int64_t rank) {
  if (ranks < 1 || vocab % ranks != 0 || rank < 0 || rank >= ranks)
    throw std::invalid_argument("VocabRange: a vocabulary of " + std::to_string(vocab) + " does not split over " +
                                std::to_string(ranks) + " ranks (rank " + std::to_string(rank) + ")");
  const int64_t n = vocab / ranks;
  return {rank * n, n};
}

torch::Tensor vocab_parallel_embedding(const torch::Tensor& ids, const torch::Tensor& weight, VocabRange range,
                                       Collectives& tp, bool sequence_parallel, int64_t padding_idx) {
  const torch::Tensor local = ids - range.first;
  const torch::Tensor mine = local.ge(0).logical_and(local.lt(range.n));
  const int64_t local_padding =
      padding_idx >= range.first && padding_idx < range.first + range.n ? padding_idx - range.first : -1;
  const torch::Tensor rows = torch::embedding(weight, local.clamp(0, range.n - 1), local_padding);
  const torch::Tensor partial = torch::where(mine.unsqueeze(-1), rows, 0.0);
  return sequence_parallel ? scatter_sequence(partial, 1, tp) : reduce_from_region(partial, tp);
}

void sum_gradients(const std::vector<torch::Tensor>& params, Collectives& tp) {
  if (tp.size() == 1) return;
  std::vector<torch::Tensor> grads;
  for (auto p : params) {
    // A parameter this rank used no part of (dist.find_unused_parameters) takes part with zeros,
    // so that every rank of the group sums the same elements.
    if (!p.grad().defined()) p.mutable_grad() = torch::zeros_like(p);
    grads.push_back(p.mutable_grad());
  }
  if (grads.empty()) return;
  std::vector<torch::Tensor> flats;
  for (const auto& g : grads) flats.push_back(g.reshape({-1}));
  torch::Tensor flat = torch::cat(flats);
  tp.all_reduce(flat, ReduceOp::Sum, "sp: replicated parameters' gradients");
  int64_t offset = 0;
  for (auto& g : grads) {
    g.copy_(flat.narrow(0, offset, g.numel()).view_as(g));
    offset += g.numel();
  }
}

torch::Tensor vocab_parallel_cross_entropy(const torch::Tensor& logits, const torch::Tensor& target, VocabRange range,
                                           Collectives& tp, int64_t ignore_index) {
  const torch::Tensor flat = logits.reshape({-1, logits.size(-1)});
  if (flat.size(1) != range.n)
    throw std::invalid_argument("vocab_parallel_cross_entropy: logits with " + std::to_string(flat.size(1)) +
                                " columns for a vocabulary range of " + std::to_string(range.n));
  return VocabCrossEntropy::apply(flat, target.reshape({-1}), range.first, as_int(tp), ignore_index);
}

torch::Tensor vocab_parallel_argmax(const torch::Tensor& logits, VocabRange range, Collectives& tp) {
  torch::NoGradGuard no_grad;
  const torch::Tensor flat = logits.reshape({-1, logits.size(-1)});
  const auto [local_max, local_index] = flat.max(1);
  torch::Tensor max = local_max.clone(at::MemoryFormat::Contiguous);  // (local_max is compared below)
  tp.all_reduce(max, ReduceOp::Max, "tp: argmax maximum");
  const int64_t none = std::numeric_limits<int64_t>::max();
  torch::Tensor index = torch::where(local_max.eq(max), local_index + range.first, torch::full_like(local_index, none));
  tp.all_reduce(index, ReduceOp::Min, "tp: argmax index");
  return index;
}

}  // namespace keel::dist::tp
