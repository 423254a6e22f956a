// trainer/app/doctor.h: `keel doctor RUN_DIR`: reads every rank's flight record
// (<run.dir>/flight/rank<R>.json, dist/flight.h; several hosts' copied into one folder, in any
// sub-folders) and says which rank hung, where and why: the first operation at which the ranks
// diverged, which ranks never entered it and which are stuck in it, which differ in op or shape
// (both shown), the phase each rank was in, the rank that died (no record), and the likeliest
// cause in words. --json for scripts.
#pragma once

#include <nlohmann/json.hpp>

#include <string>
#include <vector>

namespace keel::doctor {

struct Report {
  nlohmann::json json;  // what --json prints
  std::string text;     // what a person reads
};

/// The diagnosis of the dumps read (one per rank; a rank's newest when there are several).
Report diagnose(const std::vector<nlohmann::json>& dumps);
/// Reads every rank<R>.json under `dir` (recursively; an earlier run's, under previous/, are
/// skipped) and diagnoses them. Throws InputError naming `dir` when it holds none.
Report diagnose_dir(const std::string& dir);

}  // namespace keel::doctor
