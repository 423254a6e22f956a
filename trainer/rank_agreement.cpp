#include "trainer/rank_agreement.h"

#include <torch/version.h>
#include <nlohmann/json.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <set>
#include <string>
#include <vector>

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

std::string as_string(const std::vector<uint8_t>& v) { return std::string(v.begin(), v.end()); }
std::vector<uint8_t> as_bytes(const std::string& s) { return std::vector<uint8_t>(s.begin(), s.end()); }

}  // namespace

void agree_on_config(const dist::Group& group, const Config& cfg) {
  const auto& store = group.store();
  if (!store || !group.pg()) return;
  const std::string base = "keel/" + std::to_string(group.world().restart_count) + "/job/";
  const auto mine = job_of(cfg);
  const std::string text = mine.dump();
  store->set(base + std::to_string(group.rank()), as_bytes(text));
  if (group.rank() == 0) {
    std::string verdict, first_key;
    std::vector<std::string> values;  // "<value> on rank r"
    int64_t other_ranks = 0;
    std::set<std::string> differing;
    for (int64_t r = 1; r < group.size(); ++r) {
      const auto theirs = nlohmann::ordered_json::parse(as_string(store->get(base + std::to_string(r))));
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
    if (!first_key.empty()) {
      verdict = "the ranks were started with different configurations: " + first_key + " = ";
      for (size_t k = 0; k < values.size(); ++k) verdict += (k ? ", " : "") + values[k];
      if (differing.size() > 1) verdict += " (" + std::to_string(differing.size() - 1) + " more key(s) differ)";
      verdict += "; " + std::to_string(other_ranks) + " of " + std::to_string(group.size() - 1) +
                 " other rank(s) differ from rank 0. Start every rank with the same config and command line.";
    }
    store->set(base + "verdict", as_bytes(verdict));
  }
  const std::string verdict = as_string(store->get(base + "verdict"));
  if (!verdict.empty()) throw InputError(verdict);
}

}  // namespace keel
