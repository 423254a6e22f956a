#include "trainer/step/compiled.h"

#include "amp/grad_scaler.h"
#include "trainer/run.h"

namespace keel {

torch::Tensor CompiledStep::micro_batch_loss(const torch::Tensor& input, const torch::Tensor& target, bool sync) {
  // The GradScaler's scale, for a package that scales its gradients inside (amp.dtype = fp16).
  const torch::Tensor scale = update_.scaler ? update_.scaler->scale_tensor() : torch::Tensor();
  if (auto compiled = net_.dmodel->compiled_loss(input, target, sync, scale)) return *compiled;
  return eager_loss(input, target, sync);
}

}  // namespace keel
