#include "dist/tensor_parallel.h"

#include <stdexcept>
#include <string>

namespace keel::dist {

void shard_tensor_parallel(models::Model& model, const Mesh& mesh, TransformPlan& plan) {
  if (mesh.tp() != 1)
    throw std::logic_error("shard_tensor_parallel: tp = " + std::to_string(mesh.tp()) + " for model " + model.name() +
                           ": tensor parallelism is not implemented yet (only tp = 1)");
  plan.applied(Transform::TensorParallel, "none (tp 1)");
}

}  // namespace keel::dist
