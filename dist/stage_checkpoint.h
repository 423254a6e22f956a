// dist/stage_checkpoint.h: a pipelined model's parameters and optimizer state in a checkpoint as
// the whole model's (issue 66 item 5): the names, shapes and files of a pp = 1 run, so that a step
// saved at one pp resumes at any other (and at any dp, zero, tp that resumes from a pp = 1 step),
// and `keel export --hf` and `keel inspect` see no difference.
//
// Owns: which rank writes each parameter: the pp rank of the first stage that holds it (the root's
// parameters, held by the first and the last stage alike, by the first's), and in that stage's
// data-parallel group the placement's owner (dist/placement.h: balanced by bytes, so that the dp
// ranks share the writing as they do at pp = 1). At tp = 1 a stage's parameters are whole on every
// rank that holds them (no gather); at tp > 1 they are slices, which dist/tp_checkpoint.h makes
// whole within the stage (over_tensor_parallel). A load copies into the parameters this rank's stages hold (the others'
// are freed: StageModel::release_others), and gives the optimizer their state. At dist.zero >= 2
// the state (and at 3 the parameters) go through ZeRO's pieces, at tp > 1 through the slices. Does not own: the split
// (dist/stages.h), the files (checkpoint/).
#pragma once

#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "dist/mesh.h"
#include "dist/sharded_parameters.h"
#include "dist/stages.h"

namespace keel::dist {

class StageParameters final : public ShardedParameters {
 public:
  /// `stages`: this rank's (split_into_stages); `mesh` (connected) must outlive this.
  StageParameters(std::shared_ptr<StageModel> stages, const Mesh& mesh);

  models::NamedTensors whole_owned_parameters() override;
  void load_pieces(const models::NamedTensors& whole) override;
  models::NamedTensors parameter_shapes() const override;
  models::NamedTensors whole_state(const models::NamedTensors& piece_state,
                                   const std::map<std::string, std::string>& fields) override;
  models::NamedTensors piece_state(const models::NamedTensors& whole_state) const override;
  /// The stage's data-parallel placement (over the parameters its stages hold) decides which rank
  /// of the stage's dp group writes each; at dist.zero >= 2 the optimizer state (and at 3 the
  /// parameters) go through ZeRO's `pieces` (dist/fsdp.h) first.
  void over_data_parallel(const Placement& placement, ShardedParameters* pieces) override;
  std::vector<std::string> optimizer_parameters() const override;
  /// parallel.tp > 1: the stage's parameters are tensor-parallel slices, made whole (and cut back)
  /// by `slices` (dist/tp_checkpoint.h, over the parameters this rank's stages hold), which then
  /// picks each one's writer in the stage's dp x tp ranks; this keeps the choice of stage (the
  /// root's parameters written by the first stage's ranks only).
  void over_tensor_parallel(std::shared_ptr<ShardedParameters> slices);

 private:
  /// Whether this rank's stages are the ones that write parameter `name` (the root's: the first).
  bool stage_writes(const std::string& name) const;

  /// The parameter (or "<parameter>.<field>" of its state) `name` names, or "".
  std::string parameter_of(const std::string& name) const;

  std::shared_ptr<StageModel> stages_;
  const Mesh* mesh_;
  std::set<std::string> all_;                  // the whole model's parameters
  std::set<std::string> held_;                 // those this rank's stages hold
  std::set<std::string> root_;                 // the root's (held by the first and the last stage)
  std::set<std::string> written_;              // those of them this rank writes (without `slices_`)
  std::shared_ptr<ShardedParameters> slices_;  // over_tensor_parallel()
  ShardedParameters* state_pieces_ = nullptr;  // dist.zero >= 2 (at tp = 1): the optimizer steps ZeRO's pieces
  ShardedParameters* param_pieces_ = nullptr;  // dist.zero = 3: the parameters are ZeRO's pieces
};

}  // namespace keel::dist
