#include "dist/stage_checkpoint.h"

#include <stdexcept>

#include "dist/placement.h"

namespace keel::dist {

StageParameters::StageParameters(std::shared_ptr<StageModel> stages, const Mesh& mesh)
    : stages_(std::move(stages)), mesh_(&mesh) {
  for (const auto& [name, t] : stages_->named_parameters()) held_.insert(name);
  for (const auto& [name, t] : stages_->whole().named_parameters()) all_.insert(name);
  for (const auto& [name, t] : stages_->root_parameters()) root_.insert(name);
  // Until over_data_parallel(): data parallelism's owners as dist.zero = 0's placement makes them.
  over_data_parallel(Placement(0, stages_->named_parameters(), {}, mesh.dp()), nullptr);
}

bool StageParameters::stage_writes(const std::string& name) const {
  return held_.count(name) && (!root_.count(name) || stages_->holds_first());
}

void StageParameters::over_tensor_parallel(std::shared_ptr<ShardedParameters> slices) { slices_ = std::move(slices); }

void StageParameters::over_data_parallel(const Placement& placement, ShardedParameters* pieces) {
  if (slices_) return slices_->over_data_parallel(placement, pieces);
  state_pieces_ = placement.shards_gradients() ? pieces : nullptr;
  param_pieces_ = placement.shards_parameters() ? pieces : nullptr;
  written_.clear();
  for (size_t i = 0; i < placement.num_params(); ++i) {
    const std::string& name = placement.name(i);
    if (!held_.count(name))
      throw std::logic_error("StageParameters: the data-parallel placement's parameter '" + name +
                             "' is not one this rank's stages hold");
    // The root's parameters are held by the first and the last stage: the first's rank writes them.
    if (!stage_writes(name)) continue;
    if (placement.owner(i) == mesh_->coordinate(Axis::Dp)) written_.insert(name);
  }
}

std::string StageParameters::parameter_of(const std::string& name) const {
  if (held_.count(name)) return name;
  const size_t dot = name.find_last_of('.');
  return dot != std::string::npos && held_.count(name.substr(0, dot)) ? name.substr(0, dot) : "";
}

models::NamedTensors StageParameters::whole_owned_parameters() {
  torch::NoGradGuard ng;
  models::NamedTensors out;
  // Gathered over the stage's tp group (every stage's group gathers its own), or at dist.zero = 3
  // over its dp group, each on the placement's owner.
  if (ShardedParameters* inner = slices_ ? slices_.get() : param_pieces_) {
    for (auto& [name, t] : inner->whole_owned_parameters())
      if (stage_writes(name)) out.emplace_back(name, std::move(t));
    return out;
  }
  for (const auto& [name, t] : stages_->named_parameters())
    if (written_.count(name)) out.emplace_back(name, t.detach().to(torch::kCPU, /*non_blocking=*/false, /*copy=*/true));
  return out;
}

void StageParameters::load_pieces(const models::NamedTensors& whole) {
  torch::NoGradGuard ng;
  if (slices_) return slices_->load_pieces(whole);              // by name: the held parameters' slices
  if (param_pieces_) return param_pieces_->load_pieces(whole);  // dist.zero = 3: this rank's pieces
  std::map<std::string, torch::Tensor> read(whole.begin(), whole.end());
  // The parameters this rank's stages hold (the others' are freed: StageModel::release_others).
  for (const auto& [name, t] : stages_->named_parameters())
    if (const auto it = read.find(name); it != read.end()) t.detach().copy_(it->second);
}

models::NamedTensors StageParameters::parameter_shapes() const { return stages_->whole_parameter_shapes(); }

models::NamedTensors StageParameters::whole_state(const models::NamedTensors& piece_state,
                                                  const std::map<std::string, std::string>& fields) {
  models::NamedTensors out;
  // The state of tp slices, or at dist.zero >= 2 of ZeRO's pieces, made whole on its writer.
  if (ShardedParameters* inner = slices_ ? slices_.get() : state_pieces_) {
    for (auto& [name, t] : inner->whole_state(piece_state, fields))
      if (stage_writes(parameter_of(name))) out.emplace_back(name, std::move(t));
    return out;
  }
  for (const auto& [name, t] : piece_state)
    if (written_.count(parameter_of(name))) out.emplace_back(name, t);
  return out;
}

models::NamedTensors StageParameters::piece_state(const models::NamedTensors& whole_state) const {
  // The state of another stage's parameters is that stage's; a name of no parameter is passed on
  // for the loader to name.
  models::NamedTensors out;
  for (const auto& [name, t] : whole_state) {
    const size_t dot = name.find_last_of('.');
    const bool others = dot != std::string::npos && all_.count(name.substr(0, dot));
    if (!parameter_of(name).empty() || !others) out.emplace_back(name, t);
  }
  if (const ShardedParameters* inner = slices_ ? slices_.get() : state_pieces_) return inner->piece_state(out);
  return out;
}

std::vector<std::string> StageParameters::optimizer_parameters() const {
  std::vector<std::string> out;
  for (const auto& [name, t] : stages_->whole().named_parameters()) out.push_back(name);
  return out;
}

}  // namespace keel::dist
