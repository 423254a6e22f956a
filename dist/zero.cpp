#include "dist/zero.h"

#include <algorithm>
#include <cmath>

namespace keel::dist {

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
  if (!grads.empty() && std::isfinite(max_norm))
    at::_foreach_mul_(grads, torch::clamp(max_norm / (total + 1e-6), std::nullopt, 1.0));
  return total;
}

torch::Tensor clip_by_summed_squares(const std::vector<torch::Tensor>& counted,
                                     const std::vector<torch::Tensor>& scaled, const std::vector<Collectives*>& groups,
                                     double max_norm, const char* what) {
  // A rank with nothing to count (more ranks than elements) still takes part, with 0.
  torch::Tensor squares = torch::zeros({1}, torch::TensorOptions().device(groups.front()->group()->comm_device()));
  if (!counted.empty()) {
    const auto norms = at::_foreach_norm(counted, 2);
    squares = torch::stack(norms).to(torch::kFloat).pow(2).sum().reshape({1});
  }
  for (Collectives* g : groups) g->all_reduce(squares, ReduceOp::Sum, what);
  const torch::Tensor total = squares.sqrt().reshape({});
  if (!scaled.empty() && std::isfinite(max_norm))
    at::_foreach_mul_(scaled, torch::clamp(max_norm / (total + 1e-6), std::nullopt, 1.0));
  return total;
}

torch::Tensor clip_grad_norm_of_pieces(const models::NamedTensors& pieces, Collectives& coll, double max_norm) {
  std::vector<torch::Tensor> grads;
  for (const auto& [n, p] : pieces)
    if (p.grad().defined()) grads.push_back(p.grad().detach());
  return clip_by_summed_squares(grads, grads, {&coll}, max_norm, "ZeRO-3 gradient norm");
}

}  // namespace keel::dist
