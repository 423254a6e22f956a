// amp/autocast.h: mixed-precision autocast as a scope object.
//
// Owns: turning autocast on for a device type and dtype for the lifetime of an Autocast object
// (nested scopes work; the cast cache is cleared when the outermost scope ends). bf16 works on
// CPU and CUDA; fp16 only on CUDA (config validation refuses fp16 on CPU).
// Uses the device-generic ATen API (at::autocast::set_autocast_enabled(device, ...)).
#pragma once

#include <ATen/autocast_mode.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

namespace keel::amp {

class Autocast {
 public:
  /// dtype: kBFloat16 or kHalf; enabled = false makes the scope a no-op.
  Autocast(c10::DeviceType device, c10::ScalarType dtype, bool enabled = true) : device_(device), enabled_(enabled) {
    if (!enabled_) return;
    prev_enabled_ = at::autocast::is_autocast_enabled(device_);
    prev_dtype_ = at::autocast::get_autocast_dtype(device_);
    at::autocast::set_autocast_enabled(device_, true);
    at::autocast::set_autocast_dtype(device_, dtype);
    at::autocast::increment_nesting();
  }
  ~Autocast() {
    if (!enabled_) return;
    if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    at::autocast::set_autocast_enabled(device_, prev_enabled_);
    at::autocast::set_autocast_dtype(device_, prev_dtype_);
  }
  Autocast(const Autocast&) = delete;
  Autocast& operator=(const Autocast&) = delete;

 private:
  c10::DeviceType device_;
  bool enabled_;
  bool prev_enabled_ = false;
  c10::ScalarType prev_dtype_ = c10::kBFloat16;
};

}  // namespace keel::amp
