// amp/grad_scaler.h: dynamic loss scaling with PyTorch's GradScaler semantics.
//
// Owns: the scale and its growth tracker; scale(loss); unscale_(gradients) at most once per
// step (a second call is an error), before gradient clipping, with the inverse scale computed
// in double; the local inf/NaN verdict; update(found_inf) after the verdict has been agreed
// across ranks (the trainer passes the OR of every rank's verdict, so no rank steps alone).
// Defaults: init scale 65536, growth 2.0, backoff 0.5, growth interval 2000. The scale grows
// only when the grown value is finite.
// unscale_ uses the fused ATen kernel (_amp_foreach_non_finite_check_and_unscale_) when the
// dispatcher has one for the gradients' device (CUDA; CPU from LibTorch 2.3), and the same
// arithmetic in plain ATen ops otherwise (LibTorch 1.13 on CPU). The scale and the growth
// tracker are tensors on the gradients' device (float32 and int32, as PyTorch keeps them), moved
// there at the first unscale; update(found_inf) runs _amp_update_scale_ there, so that a step
// whose verdict stays on the device (dist.consensus = late) never makes the host wait. state()
// and scale_value() read them (the host waits): checkpoints and log lines only.
// Its checkpoint state is its component's values (checkpoint::Stateful; the trainer registers
// it as "grad_scaler").
// Thread-compatible.
#pragma once

#include <torch/torch.h>

#include <string>
#include <vector>

#include "checkpoint/stateful.h"
#include "keel/amp/config.h"

namespace keel::amp {

struct ScalerState {
  double scale = 65536.0;
  int64_t growth_tracker = 0;
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  int64_t growth_interval = 2000;
};

class GradScaler : public checkpoint::Stateful {
 public:
  explicit GradScaler(const AmpConfig& cfg);
  explicit GradScaler(ScalerState s) { load_state(s); }

  /// loss times the scale (float32), on the loss's device.
  torch::Tensor scale(const torch::Tensor& loss);
  /// Divides every defined gradient by the scale and returns true if any holds inf/NaN
  /// (this rank's verdict). Throws std::logic_error if called twice before update().
  bool unscale_(const std::vector<torch::Tensor>& params);
  /// unscale_ without reading the verdict: a float32 tensor of one element on the gradients'
  /// device (1 = inf/NaN).
  torch::Tensor unscale_on_device(const std::vector<torch::Tensor>& params);
  /// Ends the step with the verdict agreed across ranks: backs off (and resets the tracker) on
  /// inf/NaN, otherwise counts a clean step and grows after growth_interval of them.
  void update(bool found_inf);
  /// The same with the verdict as a tensor of one element (non-zero = inf/NaN), on the device.
  void update(const torch::Tensor& found_inf);
  /// update()'s host part alone (unscale_ may be called again): compile.cuda_graphs replays
  /// update()'s kernels, and the host code that ran at the capture does not run again.
  void end_step() { unscaled_ = false; }

  /// The scale (the host waits for it).
  double scale_value() const;
  /// The scale as a float32 tensor of one element, where it lives (nothing is read).
  const torch::Tensor& scale_tensor() const { return scale_; }
  /// The whole state (the host waits for the scale and the tracker).
  ScalerState state() const;
  void load_state(const ScalerState& s);
  /// Its values: {scale, growth_tracker, growth_factor, backoff_factor, growth_interval}.
  void save(checkpoint::Component& mine) const override;
  /// Restores them (a format-1 step: its shared "scaler"); a step without them (saved without
  /// loss scaling) keeps the
  /// configured initial scale, with a warning.
  void load(const checkpoint::Loaded& loaded, const checkpoint::LoadedComponent& mine) override;
  /// Values present must hold finite numbers in the ranges amp.* allows (scale > 0).
  std::string check(const checkpoint::Loaded& loaded, const checkpoint::LoadedComponent& mine) const override;
  /// Whether the fused kernel serves `device` (for logs and tests).
  static bool has_fused_unscale(c10::DeviceType device);

 private:
  void move_to(const torch::Device& device);
  torch::Tensor scale_;    // float32, one element (0-dim)
  torch::Tensor tracker_;  // int32, one element (0-dim): clean steps since the last change
  double growth_factor_ = 2.0, backoff_factor_ = 0.5;
  int64_t growth_interval_ = 2000;
  bool unscaled_ = false;
};

/// Whether any defined gradient of `params` holds inf/NaN, as a float32 tensor of one element
/// on their device (1 or 0; nothing is read by the host): one multi-tensor kernel
/// (_amp_foreach_non_finite_check_and_unscale_ with an inverse scale of 1, which leaves the
/// gradients bit-identical). A CPU float32 0 when no parameter has a gradient.
torch::Tensor nonfinite(const std::vector<torch::Tensor>& params);

/// True when amp.loss_scaling resolves to dynamic (auto: only for fp16).
bool loss_scaling_enabled(const AmpConfig& cfg);

}  // namespace keel::amp
