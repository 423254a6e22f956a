// dist/placement.h: what each rank keeps of a model's state in data-parallel training, as one
// value (docs/zero.md): the stage of dist.zero as what it shards, and, over a model, which rank
// owns which elements of which parameter.
//
//   stage   optimizer state   gradients                    parameters
//   0       replicated        all-reduced (the Reducer)    replicated
//   1       by parameter      all-reduced (the Reducer)    replicated; broadcast by their owner
//   2       flat shards       reduce-scattered per block   replicated; all-gathered after the step
//   3       flat shards       reduce-scattered per block   flat shards, gathered around each block
//
// Made once, by DataParallel from dist.zero and the model, and read by everything that depends
// on it: FullyShard allocates its flat buffers from units(); the optimizer steps pieces(rank);
// clipping and the non-finite check read those pieces' gradients; a checkpoint writes each
// parameter's optimizer state (stages 1-3) and, at stage 3, the parameter itself on
// owner(param), and records describe() (which keel inspect shows); the per-step consensus
// compares fingerprint().
//
// Stages 2 and 3 lay the parameters out in units (one per block the model names through
// BlockStructure, and a root unit with every other parameter), each a flat buffer of its
// parameters in model order, each starting at a multiple of kAlign elements, padded to `world`
// equal shards of a multiple of kAlign elements: rank r holds elements [r S, (r + 1) S) of every
// unit, and a shard may split a parameter (as FSDP2 and DeepSpeed's ZeRO-3). Stages 0 and 1 step
// whole parameters.
// Does not own: any tensor (FullyShard holds the buffers), or a collective.
#pragma once

#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>
#include <vector>

#include "keel/models/model.h"

namespace keel::dist {

class Placement {
 public:
  /// Each parameter starts, and each shard is cut, at a multiple of 64 elements of a unit's
  /// buffer: a piece then starts where the whole parameter's 64-element runs do, so the CPU's
  /// fused optimizer kernels (vectorized runs, then a scalar tail) round each element of a piece
  /// as they round it in the whole parameter, and stages 2 and 3 update as stage 0 does, bit for
  /// bit. (It also aligns every parameter to 256 bytes in float32.)
  static constexpr int64_t kAlign = 64;

  /// The stage alone (what it shards; no layout): dist.zero, 0 to 3 (InputError otherwise).
  explicit Placement(int64_t stage = 0);
  /// The stage over a model's `params` (model order, already the same on every rank) among
  /// `world` ranks; at stages 2 and 3, one unit per block of `block_prefixes` (a parameter goes to
  /// the first block whose prefix starts its name) and a root unit with the rest. Deterministic:
  /// every rank makes the same. InputError for a unit whose parameters mix dtypes or devices.
  Placement(int64_t stage, const models::NamedTensors& params, const std::vector<std::string>& block_prefixes,
            int64_t world);

  int64_t stage() const { return stage_; }
  /// Stage >= 1: each parameter's optimizer state and update belong to one rank.
  bool shards_optimizer_state() const { return stage_ >= 1; }
  /// Stage >= 2: gradients are reduce-scattered; a rank keeps its shard of them between steps.
  bool shards_gradients() const { return stage_ >= 2; }
  /// Stage 3: parameters are sharded at rest and gathered around each block.
  bool shards_parameters() const { return stage_ >= 3; }
  /// "dist.zero = <stage>", for messages.
  std::string key() const { return "dist.zero = " + std::to_string(stage_); }

  int64_t world() const { return world_; }
  size_t num_params() const { return names_.size(); }
  const std::string& name(size_t param) const { return names_[param]; }
  int64_t numel(size_t param) const { return sizes_[param]; }
  /// The rank that writes parameter `param`'s optimizer state in a checkpoint (stages 1-3; at
  /// stage 0 it is replicated) and the parameter itself (stage 3), and, at stage 1, steps it: `world` contiguous ranges
  /// of the parameters balanced by bytes (owner_partition).
  int64_t owner(size_t param) const { return owners_[param]; }
  const std::vector<int64_t>& owners() const { return owners_; }

  /// Stages 2 and 3: a flat buffer of parameters.
  struct Unit {
    std::string name;                          // "block <prefix>", or the root unit's
    std::vector<size_t> params;                // indices of the model's parameters, model order
    std::vector<int64_t> offsets;              // each one's first element in the buffer
    std::vector<std::vector<int64_t>> shapes;  // each one's shape
    std::vector<int64_t> sizes;                // each one's elements
    int64_t numel = 0;                         // the end of the last one
    int64_t shard = 0;                         // a rank's share of the padded buffer (0 when empty)
  };
  /// The units (blocks in model order, the root last); empty at stages 0 and 1.
  const std::vector<Unit>& units() const { return units_; }

  /// Elements [in_param, in_param + numel) of parameter `param`, which are elements
  /// [in_shard, in_shard + numel) of its rank's shard of unit `unit` (stages 2 and 3; at stages
  /// 0 and 1 a piece is its whole parameter and `unit` and `in_shard` are 0).
  struct Piece {
    size_t param = 0, unit = 0;
    int64_t in_param = 0, in_shard = 0, numel = 0;
  };
  /// What `rank` steps, model order: every parameter whole (stage 0), those it owns (stage 1), or
  /// its shards' parts of each parameter (stages 2 and 3; a parameter with none left out).
  std::vector<Piece> pieces(int64_t rank) const;

  /// Stage, owners and units, for the per-step consensus.
  uint64_t fingerprint() const;
  /// What a checkpoint records of it: {"stage", "world", "units", "align"}.
  nlohmann::json describe() const;

 private:
  int64_t stage_ = 0, world_ = 1;
  std::vector<std::string> names_;
  std::vector<int64_t> sizes_;
  std::vector<int64_t> owners_;
  std::vector<Unit> units_;
};

/// The owner of each of `sizes` (bytes, model order) among `world` ranks: `world` contiguous
/// ranges balanced by bytes, a parameter going to the rank whose share of the total holds its
/// midpoint (so within half the largest parameter of even). Deterministic.
std::vector<int64_t> owner_partition(const std::vector<uint64_t>& sizes, int64_t world);

}  // namespace keel::dist
