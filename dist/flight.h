// dist/flight.h: the flight recorder (dist.flight_recorder): the last N operations through every
// door of the mesh, kept in a ring per rank and written to <run.dir>/flight/rank<R>.json when it
// matters, for `keel doctor` (trainer/app/doctor.h) to say which rank hung, where and why.
//
// Owns: the ring (fixed slots, allocated once; one short lock per operation), the stamps of each
// entry (group, lane and sequence number, op, dtype, shape, bytes, phase, step, enqueue, start and
// end times, state), the dump (JSON, written atomically: a temporary file renamed over the last
// one), and a watchdog thread that dumps while the issuing thread is blocked: on SIGUSR1 (and the
// run goes on), on SIGINT/SIGTERM (common/stop.h's g_stop_signal), on an operation open longer than
// dist.timeout_s, on a peer's failure reported through the store. The issuing thread dumps on a
// failure it sees (on_failure) and the trainer on an exception that ends the run. An operation
// the device finishes (NCCL: OpRecord::device) stays "enqueued" after the host is done with it,
// until its work's result comes from the backend's watchdog: completed, timed out or failed (the
// last two dumped). A callback on that result, holding the recorder weakly, marks it; nothing
// holds the work or its tensors.
// Does not own: the door (keel/dist/collectives.h), the phase (dist/phase.h), reading the
// dumps (trainer/app/doctor.h).
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "keel/dist/collectives.h"

namespace keel::dist {

class Mesh;

struct FlightOptions {
  int64_t capacity = 2000;  // dist.flight_recorder
  std::string dir;          // where rank<R>.json goes: <run.dir>/flight
  int64_t rank = 0, world_size = 1;
  int64_t restart = 0;  // the launcher's restart count (TORCHELASTIC_RESTART_COUNT)
  std::string host;
  std::chrono::milliseconds stall{0};  // an operation open this long is dumped once (0: never)
};

class FlightRecorder : public OpObserver {
 public:
  /// Starts the watchdog and takes SIGUSR1 (put back by the destructor).
  explicit FlightRecorder(FlightOptions options);
  ~FlightRecorder() override;
  FlightRecorder(const FlightRecorder&) = delete;
  FlightRecorder& operator=(const FlightRecorder&) = delete;

  /// Observes every distinct door of `mesh` (each axis's Collectives, the world's among them),
  /// so that each operation is recorded once, and notes each group's world ranks and this rank's
  /// coordinates for the dump.
  void install(const Mesh& mesh);

  void on_start(const OpRecord& op) override;
  void on_end(const OpRecord& op) override;
  void on_failure(const OpRecord& op, const std::string& error) override;

  /// Writes the dump now (atomically), adding `reason` (and `error`) to its events. Never throws;
  /// false when it could not be written (said on stderr).
  bool dump(const std::string& reason, const std::string& error = "") noexcept;
  /// The watchdog asks `peer_failure` about once a second whether a peer reported a failure
  /// (Collectives::peer_failure) and dumps once when one did: a rank blocked elsewhere (a hung
  /// computation) still writes its record.
  void watch_peers(std::function<std::optional<std::string>()> peer_failure);
  /// The watchdog stops asking the store about peers (before the end of the run tears it down).
  void stop_polling() { polling_.store(false); }
  std::string path() const;
  /// Operations recorded so far (the ring holds the last `capacity`).
  uint64_t recorded() const;

 private:
  struct Entry;
  struct Impl;
  std::shared_ptr<Impl> impl_;  // (held weakly by the device results' callbacks)
  std::atomic<bool> polling_{true};
  void watch();
};

/// SIGUSR1's flag (set by the recorder's handler; async-signal-safe).
bool take_dump_request();

}  // namespace keel::dist
