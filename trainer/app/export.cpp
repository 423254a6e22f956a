#include "trainer/app/export.h"

#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "checkpoint/safetensors.h"
#include "checkpoint/weights.h"
#include "common/atomic_file.h"
#include "common/file.h"
#include "keel/checkpoint/checkpoint.h"
#include "keel/common/error.h"

namespace keel {
namespace {

namespace fs = std::filesystem;

// The step's meta.json, after every checksum of the step verified.
nlohmann::json verified_meta(const std::string& step_dir, const std::string& who) {
  const std::string meta_path = step_dir + "/meta.json";
  if (!not_a_regular_file(meta_path).empty())
    throw InputError(who + ": " + step_dir + " is not a committed checkpoint step (no meta.json)");
  nlohmann::json meta;
  try {
    meta = nlohmann::json::parse(read_regular_file(meta_path, uint64_t{256} << 20));
  } catch (const std::exception& e) {
    throw std::runtime_error(who + ": " + meta_path + " cannot be read: " + e.what());
  }
  if (const auto problems = checkpoint::verify_step(step_dir); !problems.empty()) {
    std::string all;
    for (const auto& p : problems) all += "\n  " + p;
    throw std::runtime_error(who + ": " + step_dir + " does not verify:" + all);
  }
  return meta;
}

// --hf: the Hugging Face config.json the model component recorded.
nlohmann::json hf_config_of(const nlohmann::json& meta, const std::string& step_dir) {
  // The model component's values (format 2), or format 1's shared state.
  const auto components = meta.value("components", nlohmann::json::object());
  const auto model = components.is_object() ? components.value("model", nlohmann::json::object()) : nlohmann::json();
  const auto state = meta.contains("components")
                         ? (model.is_object() ? model.value("values", nlohmann::json::object()) : nlohmann::json())
                         : meta.value("state", nlohmann::json::object());
  if (!state.is_object() || !state.contains("hf_config") || !state["hf_config"].is_object())
    throw InputError("keel export --hf: " + step_dir +
                     " was not saved by a gpt2 or llama run (meta.json records no hf_config of the model); --hf "
                     "exports the Hugging Face families (model.name = gpt2 | llama); without --hf keel export "
                     "writes any model's tensors under keel's names");
  nlohmann::json cfg = state["hf_config"];
  cfg.erase("torch_dtype");
  cfg["dtype"] = "float32";  // what keel's checkpoints hold; export_model sets --dtype's
  return cfg;
}

// The output directory must be new or empty: an export never replaces files. Nor may it look
// like a step of a checkpoint directory (step_<N> beside committed steps): the next run on that
// directory would take it for an uncommitted step and remove it.
void check_out(const std::string& out_dir, const std::string& who) {
  std::error_code ec;
  fs::path out = fs::path(out_dir).lexically_normal();
  if (out.filename().empty()) out = out.parent_path();
  const std::string name = out.filename().string();
  if (name.size() > 5 && name.rfind("step_", 0) == 0 && name.find_first_not_of("0123456789", 5) == std::string::npos) {
    const std::string parent = out.has_parent_path() ? out.parent_path().string() : ".";
    for (const auto& s : checkpoint::list_steps(parent))
      if (s.committed)
        throw InputError(who + ": " + out_dir + " is named as a step of the checkpoint directory " + parent +
                         ", where the next run would take it for an uncommitted step and remove it; export "
                         "elsewhere");
  }
  if (!fs::exists(out_dir, ec)) return;
  if (!fs::is_directory(out_dir, ec)) throw InputError(who + ": " + out_dir + " exists and is not a directory");
  if (!fs::is_empty(out_dir, ec)) throw InputError(who + ": " + out_dir + " is not empty; give a new directory");
}

using Shard = std::vector<std::pair<std::string, torch::Tensor>>;

std::vector<Shard> cut_shards(const std::map<std::string, std::pair<torch::Tensor, std::string>>& tensors,
                              uint64_t max_bytes) {
  std::vector<Shard> shards(1);
  uint64_t bytes = 0;
  for (const auto& [name, t] : tensors) {
    const uint64_t n = t.first.nbytes();
    if (!shards.back().empty() && bytes + n > max_bytes) shards.emplace_back(), bytes = 0;
    shards.back().emplace_back(name, t.first.contiguous());
    bytes += n;
  }
  return shards;
}

std::vector<std::string> write_export(const std::vector<Shard>& shards, const nlohmann::json* cfg,
                                      const std::string& dir) {
  std::vector<std::string> files;
  const std::map<std::string, std::string> metadata = {{"format", "pt"}};
  if (shards.size() == 1) {
    checkpoint::write_safetensors(dir + "/model.safetensors", shards[0], metadata);
    files.push_back("model.safetensors");
  } else {
    nlohmann::json index = {{"metadata", {{"total_size", 0}}}, {"weight_map", nlohmann::json::object()}};
    uint64_t total = 0;
    for (size_t i = 0; i < shards.size(); ++i) {
      char name[64];
      std::snprintf(name, sizeof name, "model-%05zu-of-%05zu.safetensors", i + 1, shards.size());
      checkpoint::write_safetensors(dir + "/" + name, shards[i], metadata);
      files.push_back(name);
      for (const auto& [n, t] : shards[i]) {
        index["weight_map"][n] = name;
        total += t.nbytes();
      }
    }
    index["metadata"]["total_size"] = total;
    write_atomic(dir + "/model.safetensors.index.json", index.dump(2) + "\n");
    files.push_back("model.safetensors.index.json");
  }
  if (cfg) {
    write_atomic(dir + "/config.json", cfg->dump(2) + "\n");
    files.push_back("config.json");
  }
  fsync_dir(dir);
  return files;
}

}  // namespace

uint64_t parse_shard_size(const std::string& text) {
  static const std::vector<std::pair<std::string, double>> units = {
      {"KiB", 1024.0}, {"MiB", 1048576.0}, {"GiB", 1073741824.0}, {"KB", 1e3}, {"MB", 1e6}, {"GB", 1e9}, {"B", 1.0}};
  for (const auto& [unit, scale] : units) {
    if (text.size() <= unit.size() || text.compare(text.size() - unit.size(), unit.size(), unit) != 0) continue;
    const std::string number = text.substr(0, text.size() - unit.size());
    size_t used = 0;
    double v = 0;
    try {
      v = std::stod(number, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used == number.size() && v * scale >= 1 && v * scale < 1e18) return static_cast<uint64_t>(v * scale);
    break;
  }
  throw InputError("--max-shard-size = \"" + text + "\": give a size such as 5GB, 500MB or 64KiB");
}

torch::ScalarType parse_export_dtype(const std::string& text) {
  if (text == "float32") return torch::kFloat;
  if (text == "bfloat16") return torch::kBFloat16;
  if (text == "float16") return torch::kHalf;
  throw InputError("--dtype = \"" + text + "\": give float32, bfloat16 or float16");
}

std::vector<std::string> export_model(const std::string& step_dir, const std::string& out, uint64_t max_shard_bytes,
                                      bool hf, torch::ScalarType dtype) {
  const std::string who = hf ? "keel export --hf" : "keel export";
  std::string out_dir = out;
  while (out_dir.size() > 1 && out_dir.back() == '/') out_dir.pop_back();
  const nlohmann::json meta = verified_meta(step_dir, who);
  nlohmann::json cfg = hf ? hf_config_of(meta, step_dir) : nlohmann::json();
  check_out(out_dir, who);
  auto tensors = checkpoint::read_weights(step_dir, {}, who);
  if (dtype != torch::kFloat) {
    // Floating-point tensors only (an integer buffer keeps its dtype), rounded to nearest.
    for (auto& [name, t] : tensors)
      if (t.first.is_floating_point()) t.first = t.first.to(dtype);
    if (hf) cfg["dtype"] = dtype == torch::kBFloat16 ? "bfloat16" : "float16";
  }
  const auto shards = cut_shards(tensors, max_shard_bytes);
  const std::string tmp = out_dir + ".partial." + std::to_string(::getpid());
  std::error_code ec;
  fs::remove_all(tmp, ec);
  if (const std::string err = make_dirs(tmp); !err.empty()) throw std::runtime_error(who + ": " + err);
  try {
    auto files = write_export(shards, hf ? &cfg : nullptr, tmp);
    if (fs::exists(out_dir, ec)) fs::remove(out_dir);  // the empty directory check_out allowed
    fs::rename(tmp, out_dir);
    const fs::path parent = fs::absolute(out_dir).parent_path();
    fsync_dir(parent.string());
    for (auto& f : files) f = out_dir + "/" + f;
    return files;
  } catch (const std::exception& e) {
    fs::remove_all(tmp, ec);
    throw std::runtime_error(who + ": writing " + out_dir + ": " + e.what());
  }
}

}  // namespace keel
