// trainer/signals.h: SIGINT and SIGTERM while a run trains: a signal asks the loop to stop after
// its current step (common/stop.h's g_stop_signal), and the final checkpoint is committed before
// the handlers go. Owns the handlers and the rendezvous window in which a signal keeps its
// default action. Does not own: what the loop does when asked to stop (trainer/trainer.cpp).
#pragma once

#include <csignal>

namespace keel {

// Marks the rendezvous for the signal handler: while the process group forms there is nothing to
// save, and the store's waits do not look at g_stop_signal, so a signal then ends the process as
// its default action does.
struct AtRendezvous {
  AtRendezvous();
  ~AtRendezvous();
  AtRendezvous(const AtRendezvous&) = delete;
  AtRendezvous& operator=(const AtRendezvous&) = delete;
};

// Installs SIGINT/SIGTERM handlers for the whole of Trainer::run(): start, compile, the steps,
// evaluation, every save and the final one, up to summary.json (the rendezvous excepted, see
// above). A signal (a first or a second one) only asks the loop to stop after its current step;
// the final checkpoint is always committed (or its failure reported) before the handlers go.
class StopSignals {
 public:
  StopSignals();
  ~StopSignals();
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;

 private:
  struct sigaction old_int_ = {};
  struct sigaction old_term_ = {};
};

}  // namespace keel
