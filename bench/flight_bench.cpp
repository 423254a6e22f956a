// The flight recorder's own cost per operation (bench/bench.py --flight-rounds measures it on a
// whole step): N operations of a gradient bucket's shape through on_start and on_end of a
// recorder of the default size, as the door reports them, timed on one thread. Prints JSON.
//
//   build/keel_flight_bench [N]
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>

#include "dist/flight.h"
#include "dist/phase.h"

int main(int argc, char** argv) {
  const int64_t n = argc > 1 ? std::atoll(argv[1]) : 1000000;
  keel::dist::FlightOptions o;
  o.capacity = 2000;
  o.dir = (std::filesystem::temp_directory_path() / "keel_flight_bench").string();
  keel::dist::FlightRecorder fr(o);
  keel::dist::PhaseScope phase(keel::dist::Phase::Backward, -1, 0);
  keel::dist::OpRecord r;
  r.kind = keel::dist::OpRecord::Kind::Bucket;
  r.lane = keel::dist::OpRecord::Lane::Bucket;
  r.group = "world";
  r.op = "all_reduce";
  r.what = "DDP gradient bucket";
  r.shape = {6553600};
  r.dtype = c10::ScalarType::Float;
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < n; ++i) {
    r.seq = static_cast<uint64_t>(i);
    r.phase = keel::dist::current_phase().pack();  // what the door adds to each record
    r.enqueue = r.start = std::chrono::steady_clock::now();
    fr.on_start(r);
    r.end = std::chrono::steady_clock::now();
    fr.on_end(r);
  }
  const double ns =
      std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count() / static_cast<double>(n);
  std::printf("{\"operations\": %lld, \"ns_per_operation\": %.1f, \"capacity\": 2000}\n", static_cast<long long>(n),
              ns);
  return 0;
}
