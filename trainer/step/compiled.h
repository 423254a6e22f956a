// trainer/step/compiled.h: the step of compile.mode = "inductor": each micro-batch's forward,
// loss and backward run as one AOTInductor package (DistributedModel::compiled_loss; backward()
// then hands autograd the package's gradients). A batch of a shape the package does not take
// (data.drop_last = false's last one) runs eager, counted against compile.max_recompiles.
#pragma once

#include "trainer/step/step.h"

namespace keel {

class CompiledStep : public Step {
 public:
  using Step::Step;

 protected:
  torch::Tensor micro_batch_loss(const torch::Tensor& input, const torch::Tensor& target, bool sync) override;
};

}  // namespace keel
