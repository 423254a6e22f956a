#include "dist/stages.h"

#include <stdexcept>
#include <string>

namespace keel::dist {

std::shared_ptr<models::Model> split_into_stages(std::shared_ptr<models::Model> model, const Mesh& mesh,
                                                 TransformPlan& plan) {
  if (mesh.pp() != 1)
    throw std::logic_error("split_into_stages: pp = " + std::to_string(mesh.pp()) +
                           ": pipeline stages are not implemented yet (only pp = 1)");
  plan.applied(Transform::Stages, "whole model (pp 1)");
  return model;
}

}  // namespace keel::dist
