// dist/mesh.h: the parallel dimensions of a job as one value: the world's ranks laid out on the
// axes pp (pipeline stages), dp (data parallel: replicas, or ZeRO's shards) and tp (tensor
// parallel), with one validated Collectives per axis.
//
// Owns: the degrees (checked against the world), this rank's coordinates, the ranks of each of
// its axis groups, how a rank is named in messages, and the Collectives of each axis (the world's
// when an axis spans the world, a one-rank group when it is 1, else a c10d subgroup made from the
// world's store). Does not own: the world's rendezvous (dist/process_group.h), what runs on an
// axis (placement, ZeRO, tensor and pipeline parallelism).
//
// Layout: rank = (pp_index x dp + dp_index) x tp + tp_index; tp is innermost so that a tp group's
// ranks are neighbours (one host, the fastest links), as Megatron and torchtitan lay them out.
// Whoever means the data-parallel degree or rank asks dp() and dp_rank() (the sampler,
// evaluation's shards, the global batch, the memory estimate, ZeRO's placement); world().size is
// for what spans the whole world (rendezvous, the step consensus, logs).
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "keel/dist/collectives.h"
#include "keel/dist/world.h"

namespace keel::dist {

enum class Axis { Pp, Dp, Tp };  // outermost to innermost
inline constexpr std::array<Axis, 3> kAxes{Axis::Pp, Axis::Dp, Axis::Tp};
const char* axis_name(Axis a);  // "pp", "dp", "tp"

/// Degrees of the axes; dp = 0 means "the world divided by pp x tp".
struct MeshShape {
  int64_t pp = 1, dp = 0, tp = 1;
};

class Mesh {
 public:
  /// `world` laid out as `shape`. Throws InputError naming the degrees when they do not multiply
  /// to the world size (or one is below 1). Does not communicate.
  static Mesh build(const World& world, const MeshShape& shape = {});

  const World& world() const { return world_; }
  int64_t size(Axis a) const { return sizes_[index(a)]; }
  /// This rank's index along `a`.
  int64_t coordinate(Axis a) const { return coords_[index(a)]; }
  int64_t dp() const { return size(Axis::Dp); }
  int64_t dp_rank() const { return coordinate(Axis::Dp); }
  int64_t tp() const { return size(Axis::Tp); }
  int64_t pp() const { return size(Axis::Pp); }

  /// The coordinates (pp, dp, tp) of `world_rank`; rank_at() inverts it.
  std::array<int64_t, 3> coordinates_of(int64_t world_rank) const;
  /// The world rank at coordinates (pp, dp, tp).
  int64_t rank_at(int64_t pp_index, int64_t dp_index, int64_t tp_index) const;
  /// The world ranks of this rank's group along `a` (those that differ from it in `a` alone), in
  /// the axis's order.
  std::vector<int64_t> group_ranks(Axis a) const;
  /// "rank 3" when the mesh is the world along one axis; else "rank 3 (pp 0, dp 1, tp 1)".
  std::string name_of(int64_t world_rank) const;
  /// "pp 1 x dp 2 x tp 1" (every axis, in order).
  std::string describe() const;

  /// Makes the Collectives of every axis: `world_coll` (the world's) for an axis that spans the
  /// world, a one-rank group for an axis of 1, else a subgroup of the world's group (collective
  /// over every rank: each builds the groups it belongs to, in axis order).
  void connect(const std::shared_ptr<Collectives>& world_coll, Validate validate);
  /// The Collectives of `a` (connect() first). Its ranks are the axis's coordinates.
  Collectives& on(Axis a) const;
  /// The optimizer step, on every axis's Collectives (messages, dist.validate = first_step).
  void set_step(int64_t step);
  const std::shared_ptr<Collectives>& shared(Axis a) const;

 private:
  static size_t index(Axis a) { return static_cast<size_t>(a); }
  World world_;
  std::array<int64_t, 3> sizes_{1, 1, 1};
  std::array<int64_t, 3> coords_{0, 0, 0};
  std::array<std::shared_ptr<Collectives>, 3> colls_;
};

}  // namespace keel::dist
