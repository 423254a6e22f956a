// common/stop.h: the stop signal a run was asked to end by, for the waits outside the loop.
#pragma once

#include <atomic>
#include <stdexcept>
#include <string>

namespace keel {

/// The signal (SIGINT, SIGTERM) that asked this process to stop; 0 while none did. Set by the
/// trainer's handlers (trainer/signals.cpp; a lock-free atomic, async-signal-safe), read by the
/// loop after each step and by long waits before it (the compile cache's entry lock).
inline std::atomic<int> g_stop_signal{0};

/// Thrown by a wait before training that a stop signal ended: nothing was trained, so there is
/// nothing to save; `keel train` exits 128 + signo.
class Stopped : public std::runtime_error {
 public:
  Stopped(int signo, const std::string& what) : std::runtime_error(what), signo(signo) {}
  int signo;
};

}  // namespace keel
