// keel/amp/config.h: the [amp] section. Defaults here; each key's meaning, units and range are
// written once, in the config schema (trainer/config/schema.cpp, docs/config.md).
#pragma once

#include <cstdint>

#include "keel/common/choices.h"

namespace keel {

/// amp.dtype: the autocast dtype (Off: full precision).
enum class AmpDtype { Off, Bf16, Fp16 };
inline constexpr Choices<AmpDtype, 3> kAmpDtypes{
    {{"off", AmpDtype::Off}, {"bf16", AmpDtype::Bf16}, {"fp16", AmpDtype::Fp16}}};

enum class LossScaling { Auto, Dynamic, Off };
inline constexpr Choices<LossScaling, 3> kLossScalings{
    {{"auto", LossScaling::Auto}, {"dynamic", LossScaling::Dynamic}, {"off", LossScaling::Off}}};

struct AmpConfig {
  AmpDtype dtype = AmpDtype::Off;
  LossScaling loss_scaling = LossScaling::Auto;
  double init_scale = 65536.0;
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  int64_t growth_interval = 2000;
};

}  // namespace keel
