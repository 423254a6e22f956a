#include "keel/models/model.h"

#include "dist/phase.h"

namespace keel::models {

torch::Tensor BlockStructure::block_enter(size_t i, const torch::Tensor& x) {
  if (!on_stage(i)) return x;
  dist::set_block(static_cast<int32_t>(i));
  return block_hooks ? block_hooks->enter(i, x) : x;
}

torch::Tensor BlockStructure::block_leave(size_t i, const torch::Tensor& y) {
  if (!on_stage(i)) return y;
  torch::Tensor out = block_hooks ? block_hooks->leave(i, y) : y;
  dist::set_block(-1);
  return out;
}

}  // namespace keel::models
