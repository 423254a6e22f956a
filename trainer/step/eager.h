// trainer/step/eager.h: the step that runs the model's module, eager or TorchScript
// (compile.mode = off, trace, script; and inductor's eager fallback): its forward under
// autocast, then the run's loss, per micro-batch. Everything else is Step's.
#pragma once

#include "trainer/step/step.h"

namespace keel {

class EagerStep : public Step {
 public:
  using Step::Step;

 protected:
  torch::Tensor micro_batch_loss(const torch::Tensor& input, const torch::Tensor& target, bool sync) override {
    return eager_loss(input, target, sync);
  }
};

}  // namespace keel
