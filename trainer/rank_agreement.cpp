#include "trainer/rank_agreement.h"

#include <torch/version.h>
#include <nlohmann/json.hpp>

#include <set>
#include <string>
#include <vector>

#include "keel/dist/collectives.h"
#include "keel/version.h"

namespace keel {
namespace {

// Keys that may differ between ranks: how much a rank logs, its share of its node's cores,
// where rank 0 writes the run's outputs (no other rank writes there), and the network interface
// of its host (hosts name their NICs differently).
const std::set<std::string> kMayDiffer = {"run.log_level", "run.all_ranks_log", "run.progress",  "run.threads",
                                          "run.name",      "run.dir",           "dist.interface"};

nlohmann::ordered_json job_of(const Config& cfg) {
  nlohmann::ordered_json j;
  j["keel version"] = KEEL_VERSION;
  j["LibTorch version"] = TORCH_VERSION;
  for (const auto& f : config_schema())
    if (!kMayDiffer.count(f.dotted())) j[f.dotted()] = to_toml_literal(f.get(cfg));
  return j;
}

// The message every rank stops with: the first key (in rank 0's order) that differs on some
// rank, each rank's value of it, and how many ranks and keys differ.
std::string verdict(const std::vector<nlohmann::ordered_json>& jobs) {
  const auto& mine = jobs.front();
  std::string first_key;
  std::vector<std::string> values;  // "<value> on rank r"
  int64_t other_ranks = 0;
  std::set<std::string> differing;
  for (size_t r = 1; r < jobs.size(); ++r) {
    const auto& theirs = jobs[r];
    bool differs = false;
    for (auto it = mine.begin(); it != mine.end(); ++it) {
      const auto other = theirs.contains(it.key()) ? theirs[it.key()].get<std::string>() : std::string("(absent)");
      if (other == it.value().get<std::string>()) continue;
      differs = true;
      differing.insert(it.key());
      if (first_key.empty()) {
        first_key = it.key();
        values.push_back(it.value().get<std::string>() + " on rank 0");
      }
      if (it.key() == first_key) values.push_back(other + " on rank " + std::to_string(r));
    }
    other_ranks += differs;
  }
  if (first_key.empty()) return "the ranks were started with different configurations (a key only some ranks have)";
  std::string v = "the ranks were started with different configurations: " + first_key + " = ";
  for (size_t k = 0; k < values.size(); ++k) v += (k ? ", " : "") + values[k];
  if (differing.size() > 1) v += " (" + std::to_string(differing.size() - 1) + " more key(s) differ)";
  return v + "; " + std::to_string(other_ranks) + " of " + std::to_string(jobs.size() - 1) +
         " other rank(s) differ from rank 0. Start every rank with the same config and command line.";
}

}  // namespace

void agree_on_config(const std::shared_ptr<dist::Group>& group, const Config& cfg) {
  if (!group->pg()) return;
  // Its own Collectives without validation: dist.validate is one of the keys being compared,
  // and this exchange must be the same on every rank whatever the configs say.
  dist::Collectives coll(group, Validate::Off);
  const std::string mine = job_of(cfg).dump();
  const auto d = dist::agree(
      coll, dist::fingerprint(std::string_view(mine)), [&] { return mine; }, "config agreement");
  if (!d) return;
  std::vector<nlohmann::ordered_json> jobs;
  for (const auto& text : d.details) jobs.push_back(nlohmann::ordered_json::parse(text));
  throw InputError(verdict(jobs));
}

}  // namespace keel
