#include "keel/amp/grad_scaler.h"

#include <ATen/core/dispatch/Dispatcher.h>

#include <cmath>
#include <cstdio>
#include <stdexcept>

#include "keel/common/log.h"

namespace keel::amp {
namespace {

std::string fmt_bound(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}

}  // namespace


bool loss_scaling_enabled(const AmpConfig& cfg) {
  return cfg.loss_scaling == LossScaling::Dynamic || (cfg.loss_scaling == LossScaling::Auto && cfg.dtype == AmpDtype::Fp16);
}

namespace {

// Multiplies every defined gradient of `params` by `inv` and returns whether any held inf/NaN, as
// a float32 tensor of one element on their device (a CPU 0 when none has a gradient): the fused
// kernel where the device has one, the same arithmetic in plain ATen ops elsewhere.
torch::Tensor check_and_unscale(const std::vector<torch::Tensor>& params, float inv) {
  std::vector<torch::Tensor> grads;
  for (const auto& p : params)
    if (p.grad().defined()) grads.push_back(p.grad());
  if (grads.empty()) return torch::zeros({1}, torch::kFloat);
  const auto opts = torch::TensorOptions().dtype(torch::kFloat).device(grads.front().device());
  auto found = torch::zeros({1}, opts);
  if (GradScaler::has_fused_unscale(opts.device().type())) {
    at::_amp_foreach_non_finite_check_and_unscale_(grads, found, torch::full({1}, inv, opts));
    return found;
  }
  for (auto& g : grads) {
    found = torch::maximum(found, torch::isfinite(g).all().logical_not().to(torch::kFloat).reshape({1}));
    g.mul_(inv);
  }
  return found;
}

}  // namespace

torch::Tensor nonfinite(const std::vector<torch::Tensor>& params) { return check_and_unscale(params, 1.0f); }

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
  return check_and_unscale(params, static_cast<float>(1.0 / s_.scale)).item<float>() != 0.0f;
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

void GradScaler::save(checkpoint::State& state) const {
  state.shared["scaler"] = {{"scale", s_.scale},
                            {"growth_tracker", s_.growth_tracker},
                            {"growth_factor", s_.growth_factor},
                            {"backoff_factor", s_.backoff_factor},
                            {"growth_interval", s_.growth_interval}};
}

void GradScaler::load(const checkpoint::Loaded& loaded) {
  const auto& shared = loaded.state.shared;
  if (!shared.contains("scaler") || !shared["scaler"].is_object()) {
    logging::warn("checkpoint {} has no loss-scaler state; starting from amp.init_scale", loaded.path);
    return;
  }
  const auto& j = shared["scaler"];
  ScalerState ss;
  ss.scale = j.at("scale").get<double>();
  ss.growth_tracker = j.at("growth_tracker").get<int64_t>();
  ss.growth_factor = j.at("growth_factor").get<double>();
  ss.backoff_factor = j.at("backoff_factor").get<double>();
  ss.growth_interval = j.at("growth_interval").get<int64_t>();
  load_state(ss);
}

std::string GradScaler::check(const checkpoint::Loaded& loaded) const {
  const auto& shared = loaded.state.shared;
  if (!shared.contains("scaler") || !shared["scaler"].is_object()) return "";
  const auto& j = shared["scaler"];
  auto number = [&](const char* key, double lo, double hi, bool integer) -> std::string {
    const auto& v = j.value(key, nlohmann::json());
    const bool ok = (integer ? v.is_number_integer() : v.is_number()) && std::isfinite(v.get<double>()) &&
                    v.get<double>() >= lo && v.get<double>() <= hi;
    return ok ? "" : std::string("state.scaler.") + key + " = " + v.dump() + " is not " + (integer ? "an integer" : "a number") +
                         " in [" + fmt_bound(lo) + ", " + fmt_bound(hi) + "]";
  };
  for (const auto& problem : {number("scale", 1e-30, 3e38, false), number("growth_tracker", 0, 1e15, true),
                              number("growth_factor", 1, 1e6, false), number("backoff_factor", 1e-6, 1, false),
                              number("growth_interval", 1, 1e12, true)})
    if (!problem.empty()) return problem;
  return "";
}

}  // namespace keel::amp
