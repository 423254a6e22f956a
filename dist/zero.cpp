#include "dist/zero.h"

#include <algorithm>
#include <thread>

namespace keel::dist {
namespace {

// dist.zero = 2: each bucket is reduce-scattered. The bucket's gradients are grouped by owner
// (the runs of one owner are contiguous in the buffer unless the Reducer rebuilt the bucket in
// another order; then that owner's pieces are copied together), pre-divided by the world size as
// the Reducer's own all-reduce does, and reduce-scattered with one input per rank (uneven:
// c10d's Gloo and NCCL both take it); the owner's sum is copied back into its gradients.
class ReduceScatterHook : public c10d::CommHookInterface {
 public:
  ReduceScatterHook(c10::intrusive_ptr<c10d::ProcessGroup> pg, std::unordered_map<const void*, int64_t> owner,
                    int64_t world, int64_t rank)
      : pg_(std::move(pg)), owner_(std::move(owner)), world_(world), rank_(rank) {}

  c10::intrusive_ptr<c10::ivalue::Future> runHook(c10d::GradBucket& bucket) override {
    at::Tensor buffer = bucket.getBufferRef();
    buffer.div_(static_cast<double>(world_));
    const auto grads = bucket.getGradients();
    const auto params = bucket.getParameters();
    std::vector<std::vector<at::Tensor>> pieces(static_cast<size_t>(world_));
    for (size_t i = 0; i < params.size(); ++i) {
      auto it = owner_.find(params[i].unsafeGetTensorImpl());
      TORCH_CHECK(it != owner_.end(), "ZeRO: a bucket holds a parameter without an owner");
      pieces[static_cast<size_t>(it->second)].push_back(grads[i].view(-1));
    }
    std::vector<at::Tensor> inputs;
    for (auto& list : pieces) inputs.push_back(joined(buffer, list));
    auto mine = pieces[static_cast<size_t>(rank_)];
    at::Tensor out = at::empty({inputs[static_cast<size_t>(rank_)].numel()}, buffer.options());
    std::vector<at::Tensor> outv{out};
    std::vector<std::vector<at::Tensor>> inv{inputs};
    auto work = pg_->reduce_scatter(outv, inv);
    auto copy_back = [buffer, out, mine]() -> c10::IValue {
      int64_t at = 0;
      for (const auto& g : mine) {
        const_cast<at::Tensor&>(g).copy_(out.narrow(0, at, g.numel()));
        at += g.numel();
      }
      return c10::IValue(buffer);
    };
    c10::intrusive_ptr<c10::ivalue::Future> native;
    try {
      native = work->getFuture();  // NCCL's
    } catch (const c10::Error&) {
    }
    if (native) return native->then([copy_back](c10::ivalue::Future&) { return copy_back(); }, c10::TensorType::get());
    // Gloo's reduce-scatter has no future: a helper thread waits for it, so that the backward
    // pass goes on meanwhile as with the Reducer's own all-reduce.
    auto fut = c10::make_intrusive<c10::ivalue::Future>(c10::TensorType::get());
    std::thread([work, fut, copy_back] {
      try {
        work->wait();
        fut->markCompleted(copy_back());
      } catch (...) {
        fut->setError(std::current_exception());
      }
    }).detach();
    return fut;
  }
  at::Tensor parseHookResult(const c10::IValue& result) override { return result.toTensor(); }

 private:
  // One rank's pieces as one flat tensor: a view of the buffer when they are adjacent.
  static at::Tensor joined(const at::Tensor& buffer, const std::vector<at::Tensor>& list) {
    if (list.empty()) return buffer.narrow(0, 0, 0);
    bool adjacent = true;
    for (size_t k = 1; k < list.size(); ++k)
      adjacent &= list[k].storage_offset() == list[k - 1].storage_offset() + list[k - 1].numel();
    if (adjacent) {
      int64_t n = 0;
      for (const auto& t : list) n += t.numel();
      return buffer.narrow(0, list.front().storage_offset() - buffer.storage_offset(), n);
    }
    return at::cat(list);
  }

  c10::intrusive_ptr<c10d::ProcessGroup> pg_;
  std::unordered_map<const void*, int64_t> owner_;
  int64_t world_, rank_;
};

}  // namespace

std::vector<int64_t> zero_partition(const std::vector<uint64_t>& sizes, int64_t world) {
  uint64_t total = 0;
  for (auto b : sizes) total += b;
  std::vector<int64_t> owner(sizes.size(), 0);
  if (total == 0 || world <= 1) return owner;
  // Rank of the parameter whose bytes straddle [before, before + b): the share that holds its
  // midpoint. Monotone in model order, so each rank's parameters are one contiguous range.
  long double before = 0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    const long double mid = before + static_cast<long double>(sizes[i]) / 2;
    owner[i] = std::min<int64_t>(world - 1, static_cast<int64_t>(mid * world / static_cast<long double>(total)));
    before += static_cast<long double>(sizes[i]);
  }
  return owner;
}

std::unique_ptr<c10d::CommHookInterface> make_reduce_scatter_hook(c10::intrusive_ptr<c10d::ProcessGroup> pg,
                                                                  std::unordered_map<const void*, int64_t> owner,
                                                                  int64_t world, int64_t rank) {
  return std::make_unique<ReduceScatterHook>(std::move(pg), std::move(owner), world, rank);
}

void zero_broadcast_parameters(const models::NamedTensors& params, const std::vector<int64_t>& owner, Collectives& coll,
                               size_t bucket_bytes) {
  if (coll.size() == 1) return;
  torch::NoGradGuard ng;
  for (int64_t r = 0; r < coll.size(); ++r) {
    std::vector<torch::Tensor> owned;
    for (size_t i = 0; i < params.size(); ++i)
      if (owner[i] == r) owned.push_back(params[i].second.detach());
    coll.broadcast_coalesced(owned, r, "ZeRO parameter broadcast", bucket_bytes);
  }
}

torch::Tensor clip_grad_norm(const models::NamedTensors& params, const std::vector<int64_t>& owner, Collectives& coll,
                             double max_norm, bool sharded) {
  // torch.nn.utils.clip_grad_norm_'s foreach arithmetic: the per-parameter norms in one
  // _foreach_norm, the norm of their vector, coef = max_norm / (total + 1e-6) clamped to 1, and
  // one _foreach_mul_. The vector has an entry per parameter of the model (0 where this rank has
  // no gradient, or, sharded, does not own it), so that it is the same vector whether or not the
  // norms are summed across owners (each entry is non-zero on its owner only: the sum is exact).
  std::vector<torch::Tensor> grads;
  std::vector<size_t> at;
  for (size_t i = 0; i < params.size(); ++i) {
    const auto& g = params[i].second.grad();
    if (g.defined() && (!sharded || owner[i] == coll.rank())) {
      grads.push_back(g.detach());
      at.push_back(i);
    }
  }
  const auto& first = params.front().second;
  const auto zero = torch::zeros({}, first.options().dtype(first.scalar_type()).requires_grad(false));
  std::vector<torch::Tensor> entries(params.size(), zero);
  if (!grads.empty()) {
    const auto norms = at::_foreach_norm(grads, 2);
    for (size_t k = 0; k < at.size(); ++k) entries[at[k]] = norms[k];
  }
  torch::Tensor table = torch::stack(entries);
  if (sharded) coll.all_reduce(table, ReduceOp::Sum, "ZeRO gradient norm");
  const torch::Tensor total = at::linalg_vector_norm(table, 2);
  if (!grads.empty()) at::_foreach_mul_(grads, torch::clamp(max_norm / (total + 1e-6), std::nullopt, 1.0));
  return total;
}

torch::Tensor clip_grad_norm_of_pieces(const models::NamedTensors& pieces, Collectives& coll, double max_norm) {
  std::vector<torch::Tensor> grads;
  for (const auto& [n, p] : pieces)
    if (p.grad().defined()) grads.push_back(p.grad().detach());
  // A rank without pieces (more ranks than elements) still takes part, with 0.
  torch::Tensor squares = torch::zeros({1}, torch::TensorOptions().device(coll.group()->comm_device()));
  if (!grads.empty()) {
    const auto norms = at::_foreach_norm(grads, 2);
    squares = torch::stack(norms).to(torch::kFloat).pow(2).sum().reshape({1});
  }
  coll.all_reduce(squares, ReduceOp::Sum, "ZeRO-3 gradient norm");
  const torch::Tensor total = squares.sqrt().reshape({});
  if (!grads.empty()) at::_foreach_mul_(grads, torch::clamp(max_norm / (total + 1e-6), std::nullopt, 1.0));
  return total;
}

}  // namespace keel::dist
