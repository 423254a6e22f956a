// common/clock.h: the one clock keel measures durations with (steady, never adjusted).
#pragma once

#include <chrono>

namespace keel {

using Clock = std::chrono::steady_clock;

/// Milliseconds since `t0`.
inline double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

}  // namespace keel
