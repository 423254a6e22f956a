#include "dist/tp_checkpoint.h"

#include <stdexcept>

#include "dist/placement.h"

namespace keel::dist {

TensorParallelParameters::TensorParallelParameters(models::NamedTensors params,
                                                   std::vector<std::optional<models::TpRule>> rules, const Mesh& mesh)
    : params_(std::move(params)), rules_(std::move(rules)), mesh_(&mesh) {
  if (rules_.size() != params_.size())
    throw std::logic_error("TensorParallelParameters: one rule (or none) per parameter");
  for (auto& rule : rules_)  // a Replicate rule splits nothing (tp_slice returns the whole)
    if (rule && rule->split == models::TpSplit::Replicate) rule.reset();
  std::vector<uint64_t> bytes;
  for (size_t i = 0; i < params_.size(); ++i) {
    index_[params_[i].first] = i;
    bytes.push_back(static_cast<uint64_t>(c10::multiply_integers(whole_shape(i))) * params_[i].second.element_size());
  }
  owners_ = owner_partition(bytes, mesh.world().size);
}

std::vector<int64_t> TensorParallelParameters::whole_shape(size_t i) const {
  std::vector<int64_t> shape = params_[i].second.sizes().vec();
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
  const std::vector<torch::Tensor> parts =
      mesh_->on(Axis::Tp).all_gather(part.detach().contiguous(), "tp checkpoint: a split tensor made whole");
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
  models::NamedTensors out;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!gathered_here(i)) continue;
    torch::Tensor whole = gather(i, params_[i].second);
    if (owners_[i] == mesh_->world().rank)
      out.emplace_back(params_[i].first, whole.to(torch::kCPU, /*non_blocking=*/false, /*copy=*/true));
  }
  return out;
}

void TensorParallelParameters::load_pieces(const models::NamedTensors& whole) {
  torch::NoGradGuard ng;
  const int64_t rank = mesh_->coordinate(Axis::Tp), size = mesh_->tp();
  for (const auto& [name, t] : whole) {
    const auto it = index_.find(name);
    if (it == index_.end()) continue;
    const size_t i = it->second;
    torch::Tensor param = params_[i].second;
    param.detach().copy_(rules_[i] ? models::tp_slice(t, *rules_[i], rank, size) : t);
  }
}

models::NamedTensors TensorParallelParameters::parameter_shapes() const {
  models::NamedTensors out;
  for (size_t i = 0; i < params_.size(); ++i)
    out.emplace_back(params_[i].first, torch::empty(whole_shape(i), params_[i].second.options().device(torch::kMeta)));
  return out;
}

models::NamedTensors TensorParallelParameters::whole_state(const models::NamedTensors& piece_state,
                                                           const std::map<std::string, std::string>& fields) {
  std::map<std::string, torch::Tensor> mine(piece_state.begin(), piece_state.end());
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
  const int64_t rank = mesh_->coordinate(Axis::Tp), size = mesh_->tp();
  models::NamedTensors out;
  for (const auto& [name, t] : whole_state) {
    const size_t dot = name.find_last_of('.');
    const auto it = dot == std::string::npos ? index_.end() : index_.find(name.substr(0, dot));
    if (it == index_.end() || !rules_[it->second] || t.sizes().vec() != whole_shape(it->second)) {
      out.emplace_back(name, t);  // not split, a scalar, or a tensor the loader will name
      continue;
    }
    out.emplace_back(name, models::tp_slice(t, *rules_[it->second], rank, size));
  }
  return out;
}

}  // namespace keel::dist
