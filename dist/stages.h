// dist/stages.h: the first transform of dist/transform_plan.h: the model split into pipeline
// stages over the mesh's pp axis, this rank keeping its own stage. Today pp is 1 (the config
// offers no other; Mesh::build refuses a shape that does not divide the world): the stage is the
// whole model. The pipelined schedule that runs stages is a Step (trainer/step/step.h).
#pragma once

#include <memory>

#include "dist/mesh.h"
#include "dist/transform_plan.h"
#include "keel/models/model.h"

namespace keel::dist {

/// This rank's stage of `model` (pp = 1: `model` itself), recorded in `plan`.
std::shared_ptr<models::Model> split_into_stages(std::shared_ptr<models::Model> model, const Mesh& mesh,
                                                 TransformPlan& plan);

}  // namespace keel::dist
