#include "trainer/fault/fault.h"

#include <algorithm>
#include <cstdlib>

#include "keel/common/error.h"

namespace keel {

namespace {

template <class E, std::size_t N>
std::string names(const Choices<E, N>& table) {
  std::string list;
  for (const auto& c : table) list += (list.empty() ? "" : ", ") + std::string(c.name);
  return list;
}

}  // namespace

FaultPlan::FaultPlan(const std::vector<std::string>& entries, int64_t world_size) {
  for (const auto& text : entries) {
    auto bad = [&](const std::string& why) {
      return InputError(
          "fault.inject entry \"" + text + "\": " + why +
          " (format: TYPE@step=S,rank=R[,always][,restart=K][,ms=M][,crash][,phase=P][,sig=N][,twice][,at=A])");
    };
    FaultEntry e;
    const auto at = text.find('@');
    if (at == std::string::npos) throw bad("missing '@'");
    const std::string type = text.substr(0, at);
    if (!parse_choice(kFaultTypes, type, e.type))
      throw bad("unknown fault type '" + type + "' (known: " + names(kFaultTypes) + ")");
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
        if (!parse_choice(kFaultPhases, val, e.phase))
          throw bad("phase must be one of " + names(kFaultPhases) + " (got '" + val + "')");
        continue;
      }
      if (key == "at") {
        e.at = dist::phase_of(val);
        if (e.at == dist::Phase::Idle || e.at == dist::Phase::Setup || e.at == dist::Phase::Finish)
          throw bad(
              "at must be one of forward, backward, consensus, optimizer, eval, checkpoint_save, "
              "checkpoint_commit (got '" +
              val + "')");
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
    if (e.crash && e.type != FaultType::CheckpointWriteFailure)
      throw bad("'crash' applies to checkpoint_write_failure only");
    if (e.type != FaultType::Signal && (e.twice || e.phase != FaultPhase::Step || e.sig != 15))
      throw bad("'phase', 'sig' and 'twice' apply to signal only");
    if (e.sig != 2 && e.sig != 10 && e.sig != 15)
      throw bad(
          "sig must be 2 (SIGINT), 10 (SIGUSR1: the flight record is dumped and the run goes on) or 15 (SIGTERM)");
    if (e.at != dist::Phase::Idle && e.type != FaultType::CollectiveHang && e.type != FaultType::Crash &&
        e.type != FaultType::Straggler)
      throw bad("'at' applies to collective_hang, crash and straggler only");
    entries_.push_back(e);
  }
}

bool FaultPlan::in_restart(const FaultEntry& e, int64_t restart_count) {
  if (e.restart >= 0) return restart_count == e.restart;
  return restart_count == 0 || e.always;
}

const FaultEntry* FaultPlan::find(FaultType type, int64_t step, int64_t rank, int64_t restart_count) const {
  for (const auto& e : entries_)
    if (e.type == type && e.step == step && e.rank == rank && e.at == dist::Phase::Idle && in_restart(e, restart_count))
      return &e;
  return nullptr;
}

const FaultEntry* FaultPlan::signal(FaultPhase phase, int64_t step, int64_t rank, int64_t restart_count) const {
  const bool once = phase == FaultPhase::Start || phase == FaultPhase::Compile;
  for (const auto& e : entries_)
    if (e.type == FaultType::Signal && e.phase == phase && (once || e.step == step) && e.rank == rank &&
        in_restart(e, restart_count))
      return &e;
  return nullptr;
}

const FaultEntry* FaultPlan::active(FaultType type, int64_t step, int64_t rank, int64_t restart_count) const {
  for (const auto& e : entries_)
    if (e.type == type && e.step <= step && e.rank == rank && e.at == dist::Phase::Idle && in_restart(e, restart_count))
      return &e;
  return nullptr;
}

const FaultEntry* FaultPlan::at_phase(FaultType type, dist::Phase phase, int64_t step, int64_t rank,
                                      int64_t restart_count) const {
  for (const auto& e : entries_)
    if (e.type == type && e.at == phase && e.rank == rank &&
        (type == FaultType::Straggler ? e.step <= step : e.step == step) && in_restart(e, restart_count))
      return &e;
  return nullptr;
}

bool FaultPlan::strikes_at_phases() const {
  return std::any_of(entries_.begin(), entries_.end(), [](const FaultEntry& e) { return e.at != dist::Phase::Idle; });
}

const FaultEntry* FaultPlan::any_rank(FaultType type, int64_t step, int64_t restart_count) const {
  for (const auto& e : entries_)
    if (e.type == type && e.step == step && in_restart(e, restart_count)) return &e;
  return nullptr;
}

}  // namespace keel
