// dist/recompute.h: the third transform of dist/transform_plan.h: activation checkpointing,
// each wrapped block's activations freed after its forward and recomputed in backward. It comes
// after the tensor-parallel shard (a block recomputes its own shard) and before compile (the
// package sees the recompute). Today no config key asks for it: it records "off".
#pragma once

#include "dist/transform_plan.h"
#include "keel/models/model.h"

namespace keel::dist {

/// Wraps `model`'s blocks for recomputation when `enabled` (today never), recorded in `plan`.
void wrap_recompute(models::Model& model, bool enabled, TransformPlan& plan);

}  // namespace keel::dist
