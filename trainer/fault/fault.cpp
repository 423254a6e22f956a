#include "keel/trainer/fault/fault.h"

#include <algorithm>
#include <cstdlib>

#include "keel/common/error.h"

namespace keel {

const std::vector<std::string>& FaultPlan::types() {
  static const std::vector<std::string> t = {"collective_hang",
                                             "crash",
                                             "oom",
                                             "nonfinite_grad",
                                             "shape_mismatch",
                                             "checkpoint_write_failure",
                                             "checkpoint_corruption",
                                             "graph_break",
                                             "straggler",
                                             "signal"};
  return t;
}

const std::vector<std::string>& FaultPlan::signal_phases() {
  static const std::vector<std::string> p = {"start", "compile", "step", "eval", "save"};
  return p;
}

FaultPlan::FaultPlan(const std::vector<std::string>& entries, int64_t world_size) {
  for (const auto& text : entries) {
    auto bad = [&](const std::string& why) {
      return InputError("fault.inject entry \"" + text + "\": " + why +
                        " (format: TYPE@step=S,rank=R[,always][,restart=K][,ms=M][,crash][,phase=P][,sig=N][,twice])");
    };
    FaultEntry e;
    const auto at = text.find('@');
    if (at == std::string::npos) throw bad("missing '@'");
    e.type = text.substr(0, at);
    bool known = false;
    for (const auto& t : types()) known |= (t == e.type);
    if (!known) {
      std::string list;
      for (const auto& t : types()) list += (list.empty() ? "" : ", ") + t;
      throw bad("unknown fault type '" + e.type + "' (known: " + list + ")");
    }
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
      if (item == "crash") {
        e.crash = true;
        continue;
      }
      if (item == "twice") {
        e.twice = true;
        continue;
      }
      const auto eq = item.find('=');
      if (eq == std::string::npos) throw bad("'" + item + "' is not key=value");
      const std::string key = item.substr(0, eq), val = item.substr(eq + 1);
      if (key == "phase") {
        const auto& ph = signal_phases();
        if (std::find(ph.begin(), ph.end(), val) == ph.end())
          throw bad("phase must be one of start, compile, step, eval, save (got '" + val + "')");
        e.phase = val;
        continue;
      }
      char* end = nullptr;
      const long long n = std::strtoll(val.c_str(), &end, 10);
      if (val.empty() || *end != '\0' || n < 0) throw bad(key + " must be a non-negative integer");
      if (key == "step")
        e.step = n;
      else if (key == "rank")
        e.rank = n;
      else if (key == "restart")
        e.restart = n;
      else if (key == "ms")
        e.ms = n;
      else if (key == "sig")
        e.sig = n;
      else
        throw bad("unknown key '" + key + "'");
    }
    if (e.step < 1) throw bad("step=S (>= 1) is required");
    if (e.rank < 0) throw bad("rank=R is required");
    if (e.rank >= world_size)
      throw bad("rank " + std::to_string(e.rank) + " does not exist in a world of " + std::to_string(world_size));
    if (e.always && e.restart >= 0) throw bad("'always' and 'restart=K' exclude each other");
    if (e.crash && e.type != "checkpoint_write_failure") throw bad("'crash' applies to checkpoint_write_failure only");
    if (e.type != "signal" && (e.twice || e.phase != "step" || e.sig != 15))
      throw bad("'phase', 'sig' and 'twice' apply to signal only");
    if (e.sig != 2 && e.sig != 15) throw bad("sig must be 2 (SIGINT) or 15 (SIGTERM)");
    entries_.push_back(e);
  }
}

bool FaultPlan::in_restart(const FaultEntry& e, int64_t restart_count) {
  if (e.restart >= 0) return restart_count == e.restart;
  return restart_count == 0 || e.always;
}

const FaultEntry* FaultPlan::find(const std::string& type, int64_t step, int64_t rank, int64_t restart_count) const {
  for (const auto& e : entries_)
    if (e.type == type && e.step == step && e.rank == rank && in_restart(e, restart_count)) return &e;
  return nullptr;
}

const FaultEntry* FaultPlan::signal(const std::string& phase, int64_t step, int64_t rank, int64_t restart_count) const {
  const bool once = phase == "start" || phase == "compile";
  for (const auto& e : entries_)
    if (e.type == "signal" && e.phase == phase && (once || e.step == step) && e.rank == rank &&
        in_restart(e, restart_count))
      return &e;
  return nullptr;
}

const FaultEntry* FaultPlan::active(const std::string& type, int64_t step, int64_t rank, int64_t restart_count) const {
  for (const auto& e : entries_)
    if (e.type == type && e.step <= step && e.rank == rank && in_restart(e, restart_count)) return &e;
  return nullptr;
}

const FaultEntry* FaultPlan::any_rank(const std::string& type, int64_t step, int64_t restart_count) const {
  for (const auto& e : entries_)
    if (e.type == type && e.step == step && in_restart(e, restart_count)) return &e;
  return nullptr;
}

}  // namespace keel
