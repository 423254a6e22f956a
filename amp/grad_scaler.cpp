#include "amp/grad_scaler.h"

#include <ATen/core/dispatch/Dispatcher.h>

#include <cmath>
#include <stdexcept>

namespace keel::amp {

bool loss_scaling_enabled(const AmpConfig& cfg) {
  return cfg.loss_scaling == "dynamic" || (cfg.loss_scaling == "auto" && cfg.dtype == "fp16");
}

GradScaler::GradScaler(const AmpConfig& cfg) {
  s_.scale = cfg.init_scale;
  s_.growth_factor = cfg.growth_factor;
  s_.backoff_factor = cfg.backoff_factor;
  s_.growth_interval = cfg.growth_interval;
}

bool GradScaler::has_fused_unscale(c10::DeviceType device) {
  auto op = c10::Dispatcher::singleton().findSchema({"aten::_amp_foreach_non_finite_check_and_unscale_", ""});
  if (!op) return false;
  return op->hasKernelForDispatchKey(c10::computeDispatchKey(c10::nullopt, c10::nullopt, c10::Device(device)));
}

bool GradScaler::unscale_(const std::vector<torch::Tensor>& params) {
  if (unscaled_)
    throw std::logic_error("GradScaler::unscale_() has already been called in this step; it may be called at most "
                           "once per step, before gradient clipping and the optimizer step");
  unscaled_ = true;
  // PyTorch computes the inverse in double, then uses it in float32.
  const float inv = static_cast<float>(1.0 / s_.scale);
  std::vector<torch::Tensor> grads;
  for (const auto& p : params)
    if (p.grad().defined()) grads.push_back(p.grad());
  if (grads.empty()) return false;
  const auto device = grads.front().device();
  if (has_fused_unscale(device.type())) {
    auto found = torch::zeros({1}, torch::TensorOptions().dtype(torch::kFloat).device(device));
    auto inv_t = torch::full({1}, inv, torch::TensorOptions().dtype(torch::kFloat).device(device));
    at::_amp_foreach_non_finite_check_and_unscale_(grads, found, inv_t);
    return found.item<float>() != 0.0f;
  }
  bool found = false;
  for (auto& g : grads) {
    found = found || !torch::isfinite(g).all().item<bool>();
    g.mul_(inv);
  }
  return found;
}

void GradScaler::update(bool found_inf) {
  // _amp_update_scale_'s arithmetic, on the host (the verdict is a host value after the
  // cross-rank agreement), in float32 like PyTorch's scale tensor.
  float scale = static_cast<float>(s_.scale);
  if (found_inf) {
    scale = static_cast<float>(scale * s_.backoff_factor);
    s_.growth_tracker = 0;
  } else if (s_.growth_tracker + 1 == s_.growth_interval) {
    const float grown = static_cast<float>(scale * s_.growth_factor);
    if (std::isfinite(grown)) scale = grown;
    s_.growth_tracker = 0;
  } else {
    ++s_.growth_tracker;
  }
  s_.scale = scale;
  unscaled_ = false;
}

}  // namespace keel::amp
