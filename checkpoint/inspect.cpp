#include "checkpoint/inspect.h"

#include <algorithm>
#include <cstdio>
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
    // The graph stored with the step (checkpoint.save_graph), as meta.json lists it.
    nlohmann::json graph = nlohmann::json::array();
    for (const char* name : {"graph.pt", "graph.pt2", "graph.json"})
      if (meta["files"].contains(name))
        graph.push_back({{"file", name},
                         {"bytes", meta["files"][name].value("bytes", uint64_t{0})},
                         {"sha256", meta["files"][name].value("sha256", std::string())}});
    if (!graph.empty()) j["graph"] = graph;
    // Who holds the optimizer state: each rank's file, its tensors and bytes, and with
    // dist.zero >= 1 the parameters whose state that rank owns.
    if (meta.contains("optimizer") && meta["optimizer"].is_object()) {
      const auto& o = meta["optimizer"];
      const int64_t world = j["world_size"].get<int64_t>();
      nlohmann::json ranks = nlohmann::json::array();
      for (int64_t r = 0; r < world && r < 4096; ++r) {
        const std::string file = optimizer_file(r, world);
        int64_t tensors = 0, params = 0;
        uint64_t bytes = 0;
        for (const auto& t : j["tensors"])
          if (t["file"] == file) ++tensors, bytes += t["bytes"].get<uint64_t>();
        if (o.contains("owners") && o["owners"].is_object())
          for (const auto& [name, owner] : o["owners"].items()) params += owner == r;
        ranks.push_back({{"rank", r}, {"file", file}, {"tensors", tensors}, {"bytes", bytes}, {"parameters", params}});
      }
      j["optimizer"] = {
          {"zero", o.value("zero", int64_t{0})}, {"partitioned", o.value("partitioned", false)}, {"ranks", ranks}};
    }
  } catch (const std::exception&) {
  }
  return j;
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
    if (s.contains("graph"))
      for (const auto& g : s["graph"]) {
        const std::string f = g["file"].get<std::string>();
        os << "  graph: " << f << ", " << human_bytes(g["bytes"].get<uint64_t>()) << ", sha256 "
           << g["sha256"].get<std::string>() << " ("
           << (f == "graph.pt"    ? "the traced TorchScript module"
               : f == "graph.pt2" ? "the AOTInductor package of the training step"
                                  : "its manifest")
           << ")\n";
      }
    if (s.contains("optimizer")) {
      const auto& o = s["optimizer"];
      const bool part = o["partitioned"].get<bool>();
      os << "  optimizer state: dist.zero = " << o["zero"].get<int64_t>()
         << (part ? ", partitioned by parameter (each rank wrote the state it owns)"
                  : ", replicated on every rank (each rank wrote a share)")
         << "\n";
      for (const auto& r : o["ranks"]) {
        os << "    rank " << r["rank"].get<int64_t>() << ": ";
        if (part) os << "owns " << r["parameters"].get<int64_t>() << " parameter(s), ";
        os << r["tensors"].get<int64_t>() << " tensor(s), " << human_bytes(r["bytes"].get<uint64_t>()) << " in "
           << r["file"].get<std::string>() << "\n";
      }
    }
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
