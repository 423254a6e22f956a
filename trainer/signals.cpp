#include "trainer/signals.h"

#include <atomic>

#include "common/stop.h"
#include "keel/trainer/trainer.h"

namespace keel {
namespace {

// g_stop_signal: common/stop.h. While the process group forms (the rendezvous) there is nothing to save, and the
// store's waits do not look at g_stop_signal: a signal then ends the process as its default action does.
std::atomic<bool> g_at_rendezvous{false};

extern "C" void on_stop_signal(int signo) {
  if (g_at_rendezvous.load()) {
    ::signal(signo, SIG_DFL);  // async-signal-safe
    ::raise(signo);
    return;
  }
  g_stop_signal.store(signo);
}

}  // namespace

AtRendezvous::AtRendezvous() { g_at_rendezvous.store(true); }
AtRendezvous::~AtRendezvous() { g_at_rendezvous.store(false); }

StopSignals::StopSignals() {
  struct sigaction sa {};
  sa.sa_handler = on_stop_signal;
  sa.sa_flags = SA_RESTART;  // a write or a socket read in flight goes on, never fails with EINTR
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, &old_int_);
  sigaction(SIGTERM, &sa, &old_term_);
  g_stop_signal.store(0);
}

StopSignals::~StopSignals() {
  sigaction(SIGINT, &old_int_, nullptr);
  sigaction(SIGTERM, &old_term_, nullptr);
}

void request_stop(int signo) { g_stop_signal.store(signo); }

}  // namespace keel
