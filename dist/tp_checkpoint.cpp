#include "dist/tp_checkpoint.h"

#include <stdexcept>

#include "dist/placement.h"

namespace keel::dist {

namespace {

// The world rank that writes each parameter: one of the tp group at its data-parallel owner
// `dp_owner` (this rank's pipeline stage), the tp ranks sharing that owner's parameters balanced
// by whole bytes.
std::vector<int64_t> writers(const std::vector<int64_t>& dp_owner, const std::vector<uint64_t>& bytes,
                             const Mesh& mesh) {
  std::vector<int64_t> out(dp_owner.size());
  for (int64_t d = 0; d < mesh.dp(); ++d) {
    std::vector<size_t> mine;
    std::vector<uint64_t> sizes;
    for (size_t i = 0; i < dp_owner.size(); ++i)
      if (dp_owner[i] == d) mine.push_back(i), sizes.push_back(bytes[i]);
    const std::vector<int64_t> tp = owner_partition(sizes, mesh.tp());
    for (size_t k = 0; k < mine.size(); ++k) out[mine[k]] = mesh.rank_at(mesh.coordinate(Axis::Pp), d, tp[k]);
  }
  return out;
}

}  // namespace

TensorParallelParameters::TensorParallelParameters(models::NamedTensors params,
                                                   std::vector<std::optional<models::TpRule>> rules, const Mesh& mesh)
    : params_(std::move(params)), rules_(std::move(rules)), mesh_(&mesh) {
  if (rules_.size() != params_.size())
    throw std::logic_error("TensorParallelParameters: one rule (or none) per parameter");
  for (size_t i = 0; i < params_.size(); ++i) {
    index_[params_[i].first] = i;
    shapes_.push_back(params_[i].second.sizes().vec());
  }
  // Until over_data_parallel(): data parallelism's owners as dist.zero = 0's placement makes them.
  over_data_parallel(Placement(0, params_, {}, mesh.dp()), nullptr);
}

void TensorParallelParameters::over_data_parallel(const Placement& placement, ShardedParameters* pieces) {
  if (placement.num_params() != params_.size())
    throw std::logic_error("TensorParallelParameters: the data-parallel placement has other parameters");
  std::vector<uint64_t> bytes;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (placement.name(i) != params_[i].first)
      throw std::logic_error("TensorParallelParameters: the data-parallel placement's parameter " + std::to_string(i) +
                             " is '" + placement.name(i) + "', not '" + params_[i].first + "'");
    bytes.push_back(static_cast<uint64_t>(c10::multiply_integers(whole_shape(i))) * params_[i].second.element_size());
  }
  owners_ = writers(placement.owners(), bytes, *mesh_);
  state_pieces_ = placement.shards_gradients() ? pieces : nullptr;
  param_pieces_ = placement.shards_parameters() ? pieces : nullptr;
}

std::vector<int64_t> TensorParallelParameters::whole_shape(size_t i) const {
  std::vector<int64_t> shape = shapes_[i];
  if (rules_[i]) shape[static_cast<size_t>(rules_[i]->dim)] *= mesh_->tp();
  return shape;
}

bool TensorParallelParameters::gathered_here(size_t i) const {
  const auto writer = mesh_->coordinates_of(owners_[i]);
  return writer[0] == mesh_->coordinate(Axis::Pp) && writer[1] == mesh_->coordinate(Axis::Dp);
}

torch::Tensor TensorParallelParameters::gather(size_t i, const torch::Tensor& part) const {
  if (!rules_[i]) return part;
  const models::TpRule& rule = *rules_[i];
  const std::vector<torch::Tensor> parts = mesh_->on(Axis::Tp).all_gather(
      part.detach().to(params_[i].second.device()).contiguous(), "tp checkpoint: a split tensor made whole");
  // Each rank's part holds its share of every one of the rule's blocks (q, k and v of a fused
  // projection): the whole is block by block, rank by rank within each.
  const int64_t per = part.size(rule.dim) / rule.blocks;
  std::vector<torch::Tensor> pieces;
  for (int64_t b = 0; b < rule.blocks; ++b)
    for (const auto& p : parts) pieces.push_back(p.narrow(rule.dim, b * per, per));
  return torch::cat(pieces, rule.dim);
}

models::NamedTensors TensorParallelParameters::whole_owned_parameters() {
  torch::NoGradGuard ng;
  // At dist.zero = 3 this rank's slices are pieces: FullyShard makes the slices whole on their dp
  // owner, which is this tp group for exactly the parameters gathered here.
  std::map<std::string, torch::Tensor> held;
  if (param_pieces_)
    for (auto& [name, t] : param_pieces_->whole_owned_parameters()) held.emplace(name, t);
  models::NamedTensors out;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!gathered_here(i)) continue;
    const std::string& name = params_[i].first;
    if (param_pieces_ && !held.count(name))
      throw std::logic_error("TensorParallelParameters: parameter '" + name + "' is not whole on its dp owner");
    torch::Tensor whole = gather(i, param_pieces_ ? held.at(name) : params_[i].second);
    if (owners_[i] == mesh_->world().rank)
      out.emplace_back(name, whole.to(torch::kCPU, /*non_blocking=*/false, /*copy=*/true));
  }
  return out;
}

models::NamedTensors TensorParallelParameters::slices(const models::NamedTensors& whole) const {
  const int64_t rank = mesh_->coordinate(Axis::Tp), size = mesh_->tp();
  models::NamedTensors out;
  for (const auto& [name, t] : whole) {
    const size_t dot = name.find_last_of('.');
    auto it = index_.find(name);  // a parameter, or "<parameter>.<field>" of its state
    if (it == index_.end() && dot != std::string::npos) it = index_.find(name.substr(0, dot));
    if (it == index_.end() || !rules_[it->second] || t.sizes().vec() != whole_shape(it->second)) {
      out.emplace_back(name, t);  // not split, a scalar, or a tensor the loader will name
      continue;
    }
    out.emplace_back(name, models::tp_slice(t, *rules_[it->second], rank, size));
  }
  return out;
}

void TensorParallelParameters::load_pieces(const models::NamedTensors& whole) {
  torch::NoGradGuard ng;
  models::NamedTensors mine;
  for (const auto& [name, t] : whole)
    if (index_.count(name)) mine.emplace_back(name, t);
  mine = slices(mine);
  if (param_pieces_) return param_pieces_->load_pieces(mine);
  for (const auto& [name, t] : mine) params_[index_.at(name)].second.detach().copy_(t);
}

models::NamedTensors TensorParallelParameters::parameter_shapes() const {
  models::NamedTensors out;
  for (size_t i = 0; i < params_.size(); ++i)
    out.emplace_back(params_[i].first, torch::empty(whole_shape(i), params_[i].second.options().device(torch::kMeta)));
  return out;
}

models::NamedTensors TensorParallelParameters::whole_state(const models::NamedTensors& piece_state,
                                                           const std::map<std::string, std::string>& fields) {
  // At dist.zero >= 2 the optimizer steps pieces: FullyShard makes their state whole slices'
  // state on each parameter's dp owner first.
  std::map<std::string, torch::Tensor> mine;
  for (auto& [name, t] : state_pieces_ ? state_pieces_->whole_state(piece_state, fields) : piece_state)
    mine.emplace(name, t);
  // Which parameters' state every rank of this tp group holds, in one all-reduce (min): a part's
  // state is gathered only where each rank has its own, so every rank issues the same gathers.
  const auto P = static_cast<int64_t>(params_.size()), F = static_cast<int64_t>(fields.size());
  auto held = torch::zeros({std::max<int64_t>(P * F, 1)}, torch::kLong);
  auto* h = held.data_ptr<int64_t>();
  int64_t f = 0;
  for (const auto& [field, kind] : fields) {
    for (int64_t i = 0; i < P; ++i) h[f * P + i] = mine.count(params_[static_cast<size_t>(i)].first + "." + field);
    ++f;
  }
  mesh_->on(Axis::Tp).all_reduce(held, ReduceOp::Min, "tp checkpoint: optimizer state presence");
  h = held.data_ptr<int64_t>();
  torch::NoGradGuard ng;
  models::NamedTensors out;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!gathered_here(i)) continue;
    f = 0;
    for (const auto& [field, kind] : fields) {
      const std::string name = params_[i].first + "." + field;
      if (h[f++ * P + static_cast<int64_t>(i)] == 0) continue;
      const torch::Tensor& t = mine.at(name);
      torch::Tensor whole = kind == "scalar" ? t : gather(i, t);
      if (owners_[i] == mesh_->world().rank) out.emplace_back(name, whole);
    }
  }
  return out;
}

models::NamedTensors TensorParallelParameters::piece_state(const models::NamedTensors& whole_state) const {
  const models::NamedTensors mine = slices(whole_state);
  return state_pieces_ ? state_pieces_->piece_state(mine) : mine;
}

}  // namespace keel::dist
