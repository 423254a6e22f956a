#include "checkpoint/inspect.h"

#include <algorithm>
#include <cstdio>
#include <set>
#include <sstream>
#include <stdexcept>

#include "checkpoint/checkpointer.h"

namespace keel::checkpoint {
namespace {

std::string human_bytes(uint64_t b) {
  char buf[32];
  if (b >= (1ull << 30))
    std::snprintf(buf, sizeof buf, "%.2f GiB", b / double(1ull << 30));
  else if (b >= (1ull << 20))
    std::snprintf(buf, sizeof buf, "%.2f MiB", b / double(1ull << 20));
  else if (b >= 1024)
    std::snprintf(buf, sizeof buf, "%.1f KiB", b / 1024.0);
  else
    std::snprintf(buf, sizeof buf, "%lu B", static_cast<unsigned long>(b));
  return buf;
}

// Each component of the step: its values, its tensors by rank file (and how many of them that
// rank owns), its whole files. Format 1 steps: the stems of their tensor files.
nlohmann::json components_of(const nlohmann::json& meta, const nlohmann::json& tensors, int64_t world) {
  nlohmann::json out = nlohmann::json::array();
  nlohmann::json records = meta.value("components", nlohmann::json::object());
  if (meta.value("format_version", int64_t{0}) < 2)
    for (const auto& t : tensors) {
      const std::string f = t["file"].get<std::string>();
      const size_t dash = f.find('-');
      if (dash != std::string::npos && f.rfind("rank-", 0) != 0) records[f.substr(0, dash)] = nlohmann::json::object();
    }
  for (auto it = records.begin(); it != records.end(); ++it) {
    const std::string c = it.key();
    const auto& rec = it.value();
    std::set<std::string> owned;
    for (const auto& n : rec.value("owned", nlohmann::json::array())) owned.insert(n.get<std::string>());
    nlohmann::json ranks = nlohmann::json::array();
    for (int64_t r = 0; r < world && r < 4096 && (rec.contains("tensors") || !rec.contains("values")); ++r) {
      const std::string file = component_file(c, r, world);
      int64_t n = 0, own = 0;
      uint64_t bytes = 0;
      for (const auto& t : tensors)
        if (t["file"] == file)
          ++n, own += owned.count(t["name"].get<std::string>()), bytes += t["bytes"].get<uint64_t>();
      ranks.push_back({{"rank", r}, {"file", file}, {"tensors", n}, {"owned", own}, {"bytes", bytes}});
    }
    // Each rank's own tensors of the component, in its rank file as "rank.<r>.<component>.<name>"
    // (rank 0's counted: every rank saves the same component's).
    const std::string per_rank_prefix = "rank.0." + c + ".";
    int64_t per_rank = 0;
    for (const auto& t : tensors)
      if (t["file"] == "rank-00000.safetensors" && t["name"].get<std::string>().rfind(per_rank_prefix, 0) == 0)
        ++per_rank;
    nlohmann::json files = nlohmann::json::array();
    const nlohmann::json values = rec.value("values", nlohmann::json::object());
    for (const auto& f : rec.value("files", nlohmann::json::array())) {
      if (!f.is_string()) continue;
      const std::string name = f.get<std::string>();
      const nlohmann::json all = meta.value("files", nlohmann::json::object());
      const nlohmann::json listed =
          all.is_object() && all.contains(name) && all[name].is_object() ? all[name] : nlohmann::json::object();
      nlohmann::json e = {{"file", name},
                          {"bytes", listed.value("bytes", uint64_t{0})},
                          {"sha256", listed.value("sha256", std::string())}};
      // A component may describe its files in its values ("files": {name: what it is}).
      if (values.contains("files") && values["files"].is_object() &&
          values["files"].value(name, nlohmann::json()).is_string())
        e["what"] = values["files"][name];
      files.push_back(e);
    }
    out.push_back({{"name", c},
                   {"values", values},
                   {"tensors", rec.value("tensors", nlohmann::json::object()).size()},
                   {"owned", owned.size()},
                   {"per_rank", per_rank},
                   {"ranks", ranks},
                   {"files", files}});
  }
  return out;
}

nlohmann::json inspect_step(const StepInfo& s) {
  nlohmann::json j = {{"step", s.step},
                      {"path", s.path},
                      {"committed", s.committed},
                      {"verified", false},
                      {"problems", nlohmann::json::array()},
                      {"tensors", nlohmann::json::array()}};
  // The tensors of every safetensors file present, committed or not.
  uint64_t total = 0;
  std::vector<std::string> names = list_dir(s.path);
  std::sort(names.begin(), names.end());
  for (const auto& n : names) {
    if (n.size() < 12 || n.compare(n.size() - 12, 12, ".safetensors") != 0) continue;
    try {
      auto f = read_safetensors(s.path + "/" + n, "", /*load_tensors=*/false);
      total += f.bytes;
      for (const auto& t : f.header.tensors)
        j["tensors"].push_back(
            {{"name", t.name}, {"dtype", t.dtype}, {"shape", t.shape}, {"bytes", t.end - t.begin}, {"file", n}});
    } catch (const std::exception& e) {
      j["problems"].push_back(e.what());
    }
  }
  j["bytes"] = total;
  if (!s.committed) {
    j["problems"].push_back("no meta.json: never committed (ignored by resume, removed by the next save)");
    return j;
  }
  for (const auto& p : verify_step(s.path)) j["problems"].push_back(p);
  j["verified"] = j["problems"].empty();
  try {
    auto meta = nlohmann::json::parse(read_metadata(s.path + "/meta.json"));
    j["world_size"] = meta.value("world_size", int64_t{0});
    j["created_utc"] = meta.value("created_utc", std::string());
    j["keel_version"] = meta.value("keel_version", std::string());
    j["torch_version"] = meta.value("torch_version", std::string());
    j["format_version"] = meta.value("format_version", int64_t{0});
    j["components"] = components_of(meta, j["tensors"], j["world_size"].get<int64_t>());
  } catch (const std::exception&) {
  }
  return j;
}

// A component's values on one line: a long value (a map of every parameter's owner) is shown by
// its size.
std::string summary_of(const nlohmann::json& values) {
  if (!values.is_object()) return values.dump().substr(0, 160);
  std::string out;
  for (auto it = values.begin(); it != values.end(); ++it) {
    std::string v = it.value().dump();
    if (v.size() > 48)
      v = it.value().is_object()  ? "{" + std::to_string(it.value().size()) + " entries}"
          : it.value().is_array() ? "[" + std::to_string(it.value().size()) + " items]"
                                  : v.substr(0, 45) + "...";
    out += (out.empty() ? "" : ", ") + it.key() + ": " + v;
  }
  return "{" + out + "}";
}

void format_component(std::ostringstream& os, const nlohmann::json& c) {
  const std::string name = c["name"].get<std::string>();
  const std::string values = summary_of(c["values"]);
  os << "  component " << name << ": " << c["tensors"].get<size_t>() << " tensor(s)";
  if (c["owned"].get<size_t>() > 0) os << ", " << c["owned"].get<size_t>() << " owned by the rank that wrote them";
  if (c.value("per_rank", int64_t{0}) > 0)
    os << ", " << c["per_rank"].get<int64_t>() << " of each rank's own (in its rank-<r>.safetensors)";
  os << "; values " << values << "\n";
  for (const auto& r : c["ranks"]) {
    os << "    rank " << r["rank"].get<int64_t>() << ": " << r["tensors"].get<int64_t>() << " tensor(s)";
    if (c["owned"].get<size_t>() > 0) os << " (owns " << r["owned"].get<int64_t>() << ")";
    os << ", " << human_bytes(r["bytes"].get<uint64_t>()) << " in " << r["file"].get<std::string>() << "\n";
  }
  for (const auto& f : c["files"]) {
    os << "  " << name << ": " << f["file"].get<std::string>() << ", " << human_bytes(f["bytes"].get<uint64_t>())
       << ", sha256 " << f["sha256"].get<std::string>();
    if (f.contains("what")) os << " (" << f["what"].get<std::string>() << ")";
    os << "\n";
  }
}

}  // namespace

nlohmann::json inspect(const std::string& dir) {
  if (!is_directory(dir)) throw std::runtime_error(dir + ": no such directory");
  nlohmann::json out = {{"dir", dir}, {"steps", nlohmann::json::array()}};
  auto steps = list_steps(dir);
  if (steps.empty()) {
    // A step directory itself?
    std::string trimmed = dir;
    while (trimmed.size() > 1 && trimmed.back() == '/') trimmed.pop_back();
    const std::string name = trimmed.substr(trimmed.rfind('/') + 1);
    if (name.rfind("step_", 0) == 0) {
      StepInfo s;
      try {
        s.step = std::stoll(name.substr(5));
      } catch (const std::exception&) {
      }
      s.path = trimmed;
      s.committed = path_exists(trimmed + "/meta.json");
      steps.push_back(s);
    } else {
      throw std::runtime_error(dir + ": neither a checkpoint directory (no step_<N> inside) nor a step directory");
    }
  }
  for (const auto& s : steps) out["steps"].push_back(inspect_step(s));
  return out;
}

std::string format_inspect(const nlohmann::json& r) {
  std::ostringstream os;
  os << r["dir"].get<std::string>() << ": " << r["steps"].size() << " step(s)\n";
  for (const auto& s : r["steps"]) {
    os << "\nstep " << s["step"].get<int64_t>() << "  " << s["path"].get<std::string>() << "\n  "
       << (s["committed"].get<bool>() ? "committed" : "NOT committed") << ", "
       << (s["verified"].get<bool>() ? "checksums verified" : "NOT verified");
    if (s.contains("world_size")) os << ", saved by " << s["world_size"].get<int64_t>() << " rank(s)";
    if (s.contains("created_utc")) os << " at " << s["created_utc"].get<std::string>();
    os << ", " << human_bytes(s["bytes"].get<uint64_t>()) << " of tensors\n";
    for (const auto& p : s["problems"]) os << "  problem: " << p.get<std::string>() << "\n";
    if (s.contains("components"))
      for (const auto& c : s["components"]) format_component(os, c);
    for (const auto& t : s["tensors"]) {
      std::string shape = "[";
      for (size_t i = 0; i < t["shape"].size(); ++i)
        shape += (i ? ", " : "") + std::to_string(t["shape"][i].get<int64_t>());
      shape += "]";
      char line[512];
      std::snprintf(line, sizeof line, "    %-44s %-5s %-18s %10s  %s\n", t["name"].get<std::string>().c_str(),
                    t["dtype"].get<std::string>().c_str(), shape.c_str(),
                    human_bytes(t["bytes"].get<uint64_t>()).c_str(), t["file"].get<std::string>().c_str());
      os << line;
    }
  }
  return os.str();
}

}  // namespace keel::checkpoint
