// Stand-in for a LibTorch header that Debian's libtorch-dev does not ship but
// torch/csrc/distributed/c10d/reducer.hpp includes. It declares only what reducer.hpp uses
// (distributed autograd, which keel does not use). CMake puts this directory on the include
// path only when the real header is missing (cmake/KeelDeps.cmake).
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <memory>

namespace torch {
namespace distributed {
namespace autograd {

class DistAutogradContext {
 public:
  using GradCallback = std::function<bool(at::Tensor&)>;
  virtual ~DistAutogradContext() = default;
};

using ContextPtr = std::shared_ptr<DistAutogradContext>;

}  // namespace autograd
}  // namespace distributed
}  // namespace torch
