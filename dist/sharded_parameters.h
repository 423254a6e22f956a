// dist/sharded_parameters.h: how a checkpoint holds a model whose parameters are split between
// ranks: as the whole parameters an unsplit run holds (the same names, shapes and files), each
// rank writing those it owns and reading back its own parts, so that a step saved at one layout
// resumes at any other (docs/checkpoints.md).
//
// Implemented by dist.zero >= 2 (dist/fsdp.h: 1-D pieces of flat units), tensor parallelism
// (dist/tp_checkpoint.h: slices along a dimension) and pipeline stages (dist/stage_checkpoint.h:
// the parameters of some blocks). Does not own: the files (checkpoint/), which
// component asks (trainer/state.h's ModelState, trainer/optim.h's OptimizerState).
#pragma once

#include <map>
#include <string>
#include <vector>

#include "keel/models/model.h"

namespace keel::dist {

class Placement;

class ShardedParameters {
 public:
  virtual ~ShardedParameters() = default;
  /// Collective: host copies of the whole parameters this rank writes (every parameter is
  /// written by exactly one rank of the world).
  virtual models::NamedTensors whole_owned_parameters() = 0;
  /// Local: this rank's parts from whole parameters (by name; a name it has no part of, or
  /// another tensor, is ignored).
  virtual void load_pieces(const models::NamedTensors& whole) = 0;
  /// Every parameter as a whole tensor of its dtype and shape on the meta device, for checking a
  /// checkpoint against them.
  virtual models::NamedTensors parameter_shapes() const = 0;
  /// Collective: the optimizer state of this rank's parts ("<parameter>.<field>"; `fields` maps
  /// each field to "param", shaped like the part, or "scalar", an int64 count) -> the whole
  /// parameters' state of those this rank writes.
  virtual models::NamedTensors whole_state(const models::NamedTensors& piece_state,
                                           const std::map<std::string, std::string>& fields) = 0;
  /// Local, the reverse: whole parameters' state -> this rank's parts of it (a tensor that is not
  /// shaped like its whole parameter is passed on as it is, for the loader to name).
  virtual models::NamedTensors piece_state(const models::NamedTensors& whole_state) const = 0;
  /// A split made outside data parallelism (tensor parallelism) learns, once the data-parallel
  /// transform is made, how that splits what each rank holds: `placement` (over the same
  /// parameters: each one's writer is then on its data-parallel owner) and, where ZeRO holds
  /// pieces (dist.zero >= 2: optimizer state; 3: parameters too), `pieces` to go through.
  /// Local. The default (data parallelism's own splits) ignores it.
  virtual void over_data_parallel(const Placement& placement, ShardedParameters* pieces) {
    (void)placement, (void)pieces;
  }
  /// Every parameter a step's optimizer state records, where a rank's optimizer updates only some
  /// of them (pipeline stages: the whole model's); empty where it updates a part of each (tensor
  /// parallelism, ZeRO: the data-parallel placement names them all).
  virtual std::vector<std::string> optimizer_parameters() const { return {}; }
};

}  // namespace keel::dist
