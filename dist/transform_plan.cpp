#include "dist/transform_plan.h"

#include <stdexcept>

namespace keel::dist {

const char* transform_name(Transform t) {
  switch (t) {
    case Transform::Stages:
      return "stages";
    case Transform::TensorParallel:
      return "tensor parallel";
    case Transform::Recompute:
      return "recompute";
    case Transform::Compile:
      return "compile";
    case Transform::DataParallel:
      return "data parallel";
  }
  return "?";
}

void TransformPlan::applied(Transform t, std::string what) {
  if (complete())
    throw std::logic_error(std::string("transform plan: ") + transform_name(t) + " after the last transform (" +
                           transform_name(kTransformOrder.back()) + ")");
  const Transform next = kTransformOrder[steps_.size()];
  if (t != next)
    throw std::logic_error(std::string("transform plan: ") + transform_name(t) + " applied where " +
                           transform_name(next) +
                           " comes next (the order is stages, tensor parallel, recompute, "
                           "compile, data parallel)");
  steps_.emplace_back(t, std::move(what));
}

std::string TransformPlan::describe() const {
  std::string s;
  for (const auto& [t, what] : steps_) s += (s.empty() ? "" : " -> ") + std::string(transform_name(t)) + ": " + what;
  return s;
}

}  // namespace keel::dist
