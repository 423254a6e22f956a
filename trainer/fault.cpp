#include "trainer/fault.h"

#include <cstdlib>

#include "trainer/config.h"

namespace keel {
namespace {

const std::vector<std::string> kImplemented = {"nonfinite_grad", "crash", "checkpoint_write_failure"};
const std::vector<std::string> kPlanned = {"collective_hang", "oom", "shape_mismatch", "checkpoint_corruption",
                                           "graph_break", "straggler"};

bool contains(const std::vector<std::string>& v, const std::string& s) {
  for (const auto& x : v)
    if (x == s) return true;
  return false;
}

}  // namespace

FaultPlan::FaultPlan(const std::vector<std::string>& entries, int64_t world_size) {
  for (const auto& text : entries) {
    auto bad = [&](const std::string& why) {
      return InputError("fault.inject entry \"" + text + "\": " + why +
                        " (format: TYPE@step=S,rank=R[,always])");
    };
    FaultEntry e;
    const auto at = text.find('@');
    if (at == std::string::npos) throw bad("missing '@'");
    e.type = text.substr(0, at);
    if (contains(kPlanned, e.type))
      throw bad("fault type '" + e.type + "' is not implemented in keel yet (implemented: nonfinite_grad, crash, checkpoint_write_failure)");
    if (!contains(kImplemented, e.type)) throw bad("unknown fault type '" + e.type + "'");
    std::string rest = text.substr(at + 1);
    size_t pos = 0;
    while (pos <= rest.size()) {
      const size_t comma = rest.find(',', pos);
      const std::string item = rest.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
      pos = comma == std::string::npos ? rest.size() + 1 : comma + 1;
      if (item == "always") {
        e.always = true;
        continue;
      }
      const auto eq = item.find('=');
      if (eq == std::string::npos) throw bad("'" + item + "' is not key=value");
      const std::string key = item.substr(0, eq), val = item.substr(eq + 1);
      char* end = nullptr;
      const long long n = std::strtoll(val.c_str(), &end, 10);
      if (val.empty() || *end != '\0' || n < 0) throw bad(key + " must be a non-negative integer");
      if (key == "step") e.step = n;
      else if (key == "rank") e.rank = n;
      else throw bad("unknown key '" + key + "'");
    }
    if (e.step < 1) throw bad("step=S (>= 1) is required");
    if (e.rank < 0) throw bad("rank=R is required");
    if (e.rank >= world_size)
      throw bad("rank " + std::to_string(e.rank) + " does not exist in a world of " + std::to_string(world_size));
    entries_.push_back(e);
  }
}

bool FaultPlan::fires(const std::string& type, int64_t step, int64_t rank, int64_t restart_count) const {
  for (const auto& e : entries_)
    if (e.type == type && e.step == step && e.rank == rank && (restart_count == 0 || e.always)) return true;
  return false;
}

}  // namespace keel
