// dist/tp_checkpoint.h: a tensor-parallel model's parameters and optimizer state in a checkpoint
// as whole tensors (issue 45): the names, shapes and files of a tp = 1 run, so that `keel export
// --hf` and `keel inspect` see the same step and a step resumes at any (dp, tp, dist.zero).
//
// Owns: which rank writes each parameter (its data-parallel owner's tp group, the data-parallel
// placement's dist/placement.h owner, and in that group a tp rank balanced by whole bytes:
// owner_partition), gathering a split parameter's slices over that tp group (one all-gather per
// tensor; the other tp groups skip it), and cutting this rank's slice out of a whole tensor read
// back (models/transformer.h's tp_slice). With dist.zero >= 2 a rank's slices are ZeRO's pieces
// of them, which go through FullyShard's own conversions first (over_data_parallel): pieces over
// dp -> slices on their dp owner -> whole tensors over tp, and back. Does not own: the rules (the
// family's tp_plan), the files (checkpoint/).
#pragma once

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "dist/mesh.h"
#include "dist/sharded_parameters.h"
#include "models/transformer.h"

namespace keel::dist {

class TensorParallelParameters final : public ShardedParameters {
 public:
  /// `params`: the model's parameters after sharding, in model order; `rules`: each one's split
  /// (nullopt: not split, every tp rank holds the whole; TensorParallelShard::rules). `mesh` (connected) must outlive
  /// this.
  TensorParallelParameters(models::NamedTensors params, std::vector<std::optional<models::TpRule>> rules,
                           const Mesh& mesh);

  models::NamedTensors whole_owned_parameters() override;
  void load_pieces(const models::NamedTensors& whole) override;
  models::NamedTensors parameter_shapes() const override;
  models::NamedTensors whole_state(const models::NamedTensors& piece_state,
                                   const std::map<std::string, std::string>& fields) override;
  models::NamedTensors piece_state(const models::NamedTensors& whole_state) const override;
  void over_data_parallel(const Placement& placement, ShardedParameters* pieces) override;

 private:
  /// Whether parameter `i`'s writer is in this rank's tp group (which then gathers it).
  bool gathered_here(size_t i) const;
  /// Collective over the tp group: the whole tensor of parameter `i` from each rank's `part`.
  torch::Tensor gather(size_t i, const torch::Tensor& part) const;
  std::vector<int64_t> whole_shape(size_t i) const;
  /// This rank's slice of each whole tensor of `whole` that is a split parameter's (others as they are).
  models::NamedTensors slices(const models::NamedTensors& whole) const;

  models::NamedTensors params_;
  std::vector<std::vector<int64_t>> shapes_;  // each parameter's slice (the model's may be emptied by ZeRO-3)
  std::vector<std::optional<models::TpRule>> rules_;
  std::map<std::string, size_t> index_;
  std::vector<int64_t> owners_;  // world ranks
  const Mesh* mesh_;
  ShardedParameters* state_pieces_ = nullptr;  // dist.zero >= 2: the optimizer steps ZeRO's pieces
  ShardedParameters* param_pieces_ = nullptr;  // dist.zero = 3: the parameters are ZeRO's pieces
};

}  // namespace keel::dist
