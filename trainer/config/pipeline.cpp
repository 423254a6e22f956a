#include "trainer/config/pipeline.h"

#include <sstream>
#include <stdexcept>

#include "keel/common/error.h"

namespace keel {

int64_t pipeline_virtual_stages(const ParallelConfig& p) {
  if (p.pp_virtual_stages > 0) return p.pp_virtual_stages;
  return p.pp_schedule == "gpipe" || p.pp_schedule == "1f1b" ? 1 : 2;
}

dist::pipeline::Schedule pipeline_schedule(const Config& cfg) {
  const ParallelConfig& p = cfg.parallel;
  const int64_t v = pipeline_virtual_stages(p);
  try {
    dist::pipeline::Schedule s = dist::pipeline::make_schedule(
        p.pp_schedule, static_cast<int>(p.pp), static_cast<int>(cfg.train.grad_accum), static_cast<int>(v));
    // Every schedule a run takes is checked and simulated first: a micro-batch without its
    // backward, or an order that would deadlock, never reaches the ranks.
    try {
      dist::pipeline::validate(s);
    } catch (const std::logic_error& e) {
      throw std::invalid_argument(std::string("the schedule is malformed: ") + e.what());
    }
    const dist::pipeline::SimResult sim = dist::pipeline::simulate(s);
    if (sim.deadlock) throw std::invalid_argument("the schedule would deadlock:\n" + sim.blocked);
    return s;
  } catch (const std::invalid_argument& e) {
    throw InputError("config: parallel.pp_schedule = \"" + p.pp_schedule + "\" at parallel.pp = " +
                     std::to_string(p.pp) + " with train.grad_accum = " + std::to_string(cfg.train.grad_accum) +
                     " micro-batches and parallel.pp_virtual_stages = " + std::to_string(v) +
                     (p.pp_virtual_stages == 0 ? " (the schedule's own)" : "") + ": " + e.what());
  }
}

std::vector<int64_t> pipeline_split_points(const ParallelConfig& p) {
  if (p.pp_split == "even") return {};
  const int64_t stages = p.pp * pipeline_virtual_stages(p);
  auto fail = [&](const std::string& why) {
    throw InputError("config: parallel.pp_split = \"" + p.pp_split + "\": " + why +
                     " (\"even\", or the first block of each stage after the first, comma-separated and increasing)");
  };
  std::vector<int64_t> points;
  std::stringstream in(p.pp_split);
  std::string item;
  while (std::getline(in, item, ',')) {
    size_t used = 0;
    int64_t b = -1;
    try {
      b = std::stoll(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used == 0 || item.find_first_not_of(" ", used) != std::string::npos) fail("\"" + item + "\" is not a block");
    if (b < 1 || (!points.empty() && b <= points.back()))
      fail("block " + std::to_string(b) + " does not come after " +
           (points.empty() ? std::string("block 0") : "block " + std::to_string(points.back())));
    points.push_back(b);
  }
  if (static_cast<int64_t>(points.size()) != stages - 1)
    fail(std::to_string(points.size()) + " boundaries for " + std::to_string(stages) +
         " stages (parallel.pp x the virtual stages per rank); it needs " + std::to_string(stages - 1));
  return points;
}

std::string describe_schedule(const Config& cfg) {
  const dist::pipeline::Schedule s = pipeline_schedule(cfg);
  const dist::pipeline::SimResult sim = dist::pipeline::simulate(s);
  std::ostringstream os;
  os << "actions: F forward, B backward, I input gradient, W weight gradients, SEND_F/RECV_F an activation, "
        "SEND_B/RECV_B its gradient; \"2F0\" = stage 2's forward of micro-batch 0\n";
  os << s.table();
  if (sim.deadlock) {
    os << "the simulator found a deadlock:\n" << sim.blocked << "\n";
    return os.str();
  }
  os << "simulated (one action per rank per tick, sends asynchronous, FIFO per pair of ranks): no deadlock, "
     << sim.ticks << " ticks, " << sim.bubble
     << " of the ranks' ticks without compute (a send or a receive takes a tick here); peak micro-batches in "
        "flight per rank:";
  for (int x : sim.peak_in_flight) os << ' ' << x;
  os << "\n";
  return os.str();
}

}  // namespace keel
