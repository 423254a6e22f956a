#include "amp/grad_scaler.h"

#include <ATen/core/dispatch/Dispatcher.h>

#include <cmath>
#include <cstdio>
#include <stdexcept>

#include "common/log.h"

namespace keel::amp {
namespace {

std::string fmt_bound(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}

}  // namespace

bool loss_scaling_enabled(const AmpConfig& cfg) {
  return cfg.loss_scaling == LossScaling::Dynamic ||
         (cfg.loss_scaling == LossScaling::Auto && cfg.dtype == AmpDtype::Fp16);
}

namespace {

// Multiplies every defined gradient of `params` by `inv_scale` (one element; undefined = 1) and returns whether any
// held inf/NaN, as a float32 tensor of one element on their device (a 0 when none has a gradient): the fused kernel
// where the device has one, the same arithmetic in plain ATen ops elsewhere.
torch::Tensor check_and_unscale(const std::vector<torch::Tensor>& params, const torch::Tensor& inv_scale) {
  std::vector<torch::Tensor> grads;
  for (const auto& p : params)
    if (p.grad().defined()) grads.push_back(p.grad());
  if (grads.empty())  // on the parameters' device all the same, so that no verdict needs a copy
    return torch::zeros({1}, torch::TensorOptions()
                                 .dtype(torch::kFloat)
                                 .device(params.empty() ? torch::Device(torch::kCPU) : params.front().device()));
  const auto opts = torch::TensorOptions().dtype(torch::kFloat).device(grads.front().device());
  auto found = torch::zeros({1}, opts);
  const torch::Tensor inv = inv_scale.defined() ? inv_scale.to(opts.device()) : torch::ones({1}, opts);
  if (GradScaler::has_fused_unscale(opts.device().type())) {
    at::_amp_foreach_non_finite_check_and_unscale_(grads, found, inv);
    return found;
  }
  for (auto& g : grads) {
    found = torch::maximum(found, torch::isfinite(g).all().logical_not().to(torch::kFloat).reshape({1}));
    g.mul_(inv);
  }
  return found;
}

}  // namespace

torch::Tensor nonfinite(const std::vector<torch::Tensor>& params) {
  return check_and_unscale(params, torch::Tensor());  // an inverse scale of 1, made on the device
}

GradScaler::GradScaler(const AmpConfig& cfg) {
  ScalerState s;
  s.scale = cfg.init_scale;
  s.growth_factor = cfg.growth_factor;
  s.backoff_factor = cfg.backoff_factor;
  s.growth_interval = cfg.growth_interval;
  load_state(s);
}

void GradScaler::load_state(const ScalerState& s) {
  const torch::Device device = scale_.defined() ? scale_.device() : torch::Device(torch::kCPU);
  scale_ = torch::full({}, s.scale, torch::kFloat).to(device);
  tracker_ = torch::full({}, s.growth_tracker, torch::kInt).to(device);
  growth_factor_ = s.growth_factor;
  backoff_factor_ = s.backoff_factor;
  growth_interval_ = s.growth_interval;
}

ScalerState GradScaler::state() const {
  ScalerState s;
  s.scale = scale_value();
  s.growth_tracker = tracker_.item<int>();
  s.growth_factor = growth_factor_;
  s.backoff_factor = backoff_factor_;
  s.growth_interval = growth_interval_;
  return s;
}

double GradScaler::scale_value() const { return scale_.item<float>(); }

void GradScaler::move_to(const torch::Device& device) {
  if (scale_.device() == device) return;
  scale_ = scale_.to(device);
  tracker_ = tracker_.to(device);
}

torch::Tensor GradScaler::scale(const torch::Tensor& loss) {
  move_to(loss.device());
  return loss * scale_;
}

bool GradScaler::has_fused_unscale(c10::DeviceType device) {
  auto op = c10::Dispatcher::singleton().findSchema({"aten::_amp_foreach_non_finite_check_and_unscale_", ""});
  if (!op) return false;
  return op->hasKernelForDispatchKey(c10::computeDispatchKey(c10::nullopt, c10::nullopt, c10::Device(device)));
}

torch::Tensor GradScaler::unscale_on_device(const std::vector<torch::Tensor>& params) {
  if (unscaled_)
    throw std::logic_error(
        "GradScaler::unscale_() has already been called in this step; it may be called at most "
        "once per step, before gradient clipping and the optimizer step");
  unscaled_ = true;
  for (const auto& p : params)
    if (p.grad().defined()) {
      move_to(p.grad().device());
      break;
    }
  // PyTorch computes the inverse in double, then uses it in float32.
  return check_and_unscale(params, scale_.to(torch::kDouble).reciprocal().to(torch::kFloat).reshape({1}));
}

bool GradScaler::unscale_(const std::vector<torch::Tensor>& params) {
  return unscale_on_device(params).item<float>() != 0.0f;
}

void GradScaler::update(bool found_inf) { update(torch::full({1}, found_inf ? 1.0f : 0.0f, torch::kFloat)); }

void GradScaler::update(const torch::Tensor& found_inf) {
  const auto found = found_inf.to(scale_.device()).to(torch::kFloat).reshape({1});
  static const bool fused = [] {
    auto op = c10::Dispatcher::singleton().findSchema({"aten::_amp_update_scale_", ""});
    return op && op->hasKernelForDispatchKey(c10::DispatchKey::CPU);
  }();
  if (fused || !scale_.device().is_cpu()) {
    at::_amp_update_scale_(scale_, tracker_, found, growth_factor_, backoff_factor_, growth_interval_);
  } else {
    // _amp_update_scale_'s arithmetic in plain ATen ops (LibTorch without its CPU kernel).
    const bool inf = found.item<float>() != 0;
    const int tracker = tracker_.item<int>();
    const float scale = scale_.item<float>();
    if (inf) {
      scale_.fill_(static_cast<float>(scale * backoff_factor_));
      tracker_.fill_(0);
    } else if (tracker + 1 == growth_interval_) {
      const float grown = static_cast<float>(scale * growth_factor_);
      if (std::isfinite(grown)) scale_.fill_(grown);
      tracker_.fill_(0);
    } else {
      tracker_.fill_(tracker + 1);
    }
  }
  unscaled_ = false;
}

namespace {

// Its values: the component's own (format 2), or format 1's shared "scaler" object.
nlohmann::json scaler_values(const checkpoint::Loaded& loaded, const checkpoint::LoadedComponent& mine) {
  return loaded.format_version >= 2 ? mine.values : mine.values.value("scaler", nlohmann::json());
}

}  // namespace

void GradScaler::save(checkpoint::Component& mine) const {
  const ScalerState s = this->state();
  mine.values = {{"scale", s.scale},
                 {"growth_tracker", s.growth_tracker},
                 {"growth_factor", s.growth_factor},
                 {"backoff_factor", s.backoff_factor},
                 {"growth_interval", s.growth_interval}};
}

void GradScaler::load(const checkpoint::Loaded& loaded, const checkpoint::LoadedComponent& mine) {
  const nlohmann::json j = scaler_values(loaded, mine);
  if (!j.is_object() || !j.contains("scale")) {
    logging::warn("checkpoint {} has no loss-scaler state; starting from amp.init_scale", loaded.path);
    return;
  }
  ScalerState ss;
  ss.scale = j.at("scale").get<double>();
  ss.growth_tracker = j.at("growth_tracker").get<int64_t>();
  ss.growth_factor = j.at("growth_factor").get<double>();
  ss.backoff_factor = j.at("backoff_factor").get<double>();
  ss.growth_interval = j.at("growth_interval").get<int64_t>();
  load_state(ss);
}

std::string GradScaler::check(const checkpoint::Loaded& loaded, const checkpoint::LoadedComponent& mine) const {
  const nlohmann::json j = scaler_values(loaded, mine);
  if (j.is_null() || (j.is_object() && j.empty())) return "";  // none saved: load() warns, starts afresh
  if (!j.is_object()) return "values are not an object";
  auto number = [&](const char* key, double lo, double hi, bool integer) -> std::string {
    const auto& v = j.value(key, nlohmann::json());
    const bool ok = (integer ? v.is_number_integer() : v.is_number()) && std::isfinite(v.get<double>()) &&
                    v.get<double>() >= lo && v.get<double>() <= hi;
    return ok ? ""
              : std::string("values.") + key + " = " + v.dump() + " is not " + (integer ? "an integer" : "a number") +
                    " in [" + fmt_bound(lo) + ", " + fmt_bound(hi) + "]";
  };
  for (const auto& problem : {number("scale", 1e-30, 3e38, false), number("growth_tracker", 0, 1e15, true),
                              number("growth_factor", 1, 1e6, false), number("backoff_factor", 1e-6, 1, false),
                              number("growth_interval", 1, 1e12, true)})
    if (!problem.empty()) return problem;
  return "";
}

}  // namespace keel::amp
