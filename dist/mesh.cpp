#include "dist/mesh.h"

#include "dist/phase.h"

#include "keel/common/error.h"

namespace keel::dist {

const char* axis_name(Axis a) {
  switch (a) {
    case Axis::Pp:
      return "pp";
    case Axis::Dp:
      return "dp";
    case Axis::Tp:
      return "tp";
  }
  return "?";
}

Mesh Mesh::build(const World& world, const MeshShape& shape) {
  const int64_t pp = shape.pp, tp = shape.tp;
  if (pp < 1 || tp < 1 || shape.dp < 0)
    throw InputError("dist: the mesh's degrees must be at least 1 (pp " + std::to_string(pp) + ", dp " +
                     std::to_string(shape.dp) + ", tp " + std::to_string(tp) + ")");
  const int64_t dp = shape.dp > 0 ? shape.dp : world.size / (pp * tp);
  if (pp * dp * tp != world.size)
    throw InputError("dist: a mesh of pp " + std::to_string(pp) + " x dp " + std::to_string(dp) + " x tp " +
                     std::to_string(tp) + " needs " + std::to_string(pp * dp * tp) + " ranks; the world has " +
                     std::to_string(world.size));
  Mesh m;
  m.world_ = world;
  m.sizes_ = {pp, dp, tp};
  m.coords_ = m.coordinates_of(world.rank);
  return m;
}

std::array<int64_t, 3> Mesh::coordinates_of(int64_t world_rank) const {
  return {world_rank / (dp() * tp()), world_rank / tp() % dp(), world_rank % tp()};
}

int64_t Mesh::rank_at(int64_t pp_index, int64_t dp_index, int64_t tp_index) const {
  return (pp_index * dp() + dp_index) * tp() + tp_index;
}

std::vector<int64_t> Mesh::group_ranks(Axis a) const {
  std::vector<int64_t> out;
  for (int64_t i = 0; i < size(a); ++i) {
    auto c = coords_;
    c[index(a)] = i;
    out.push_back(rank_at(c[0], c[1], c[2]));
  }
  return out;
}

std::string Mesh::name_of(int64_t world_rank) const {
  std::string name = "rank " + std::to_string(world_rank);
  int axes_in_use = 0;
  for (const Axis a : kAxes) axes_in_use += size(a) > 1;
  if (axes_in_use <= 1) return name;
  const auto c = coordinates_of(world_rank);
  return name + " (pp " + std::to_string(c[0]) + ", dp " + std::to_string(c[1]) + ", tp " + std::to_string(c[2]) + ")";
}

std::string Mesh::describe() const {
  return "pp " + std::to_string(pp()) + " x dp " + std::to_string(dp()) + " x tp " + std::to_string(tp());
}

void Mesh::connect(const std::shared_ptr<Collectives>& world_coll, Validate validate) {
  for (const Axis a : kAxes) {
    auto& slot = colls_[index(a)];
    if (size(a) == world_.size) {
      slot = world_coll;
      continue;
    }
    const auto ranks = group_ranks(a);
    std::vector<std::string> names;
    for (const int64_t r : ranks) names.push_back(name_of(r));
    // One name per group: the axis and its first rank (every member computes the same).
    const std::string name = std::string(axis_name(a)) + "/" + std::to_string(ranks.front());
    slot = std::make_shared<Collectives>(world_coll->group()->subgroup(ranks, name, std::move(names)), validate);
  }
}

Collectives& Mesh::on(Axis a) const { return *shared(a); }

void Mesh::set_step(int64_t step) {
  set_phase_step(step);
  for (const auto& c : colls_)
    if (c) c->set_step(step);
}

const std::shared_ptr<Collectives>& Mesh::shared(Axis a) const {
  const auto& c = colls_[index(a)];
  if (!c) throw std::logic_error(std::string("dist::Mesh: the ") + axis_name(a) + " axis is not connected");
  return c;
}

}  // namespace keel::dist
