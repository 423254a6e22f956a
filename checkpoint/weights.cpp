#include "checkpoint/weights.h"

#include <nlohmann/json.hpp>

#include <map>
#include <set>

#include "checkpoint/io.h"
#include "checkpoint/safetensors.h"
#include "common/file.h"
#include "keel/common/error.h"
#include "keel/models/model.h"

namespace keel::checkpoint {
namespace {

constexpr const char* kIndexName = "model.safetensors.index.json";

std::string dir_of(const std::string& path) {
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? "." : path.substr(0, slash);
}

std::string shape_str(const torch::Tensor& t) {
  std::string s = "[";
  for (int64_t i = 0; i < t.dim(); ++i) s += (i ? ", " : "") + std::to_string(t.size(i));
  return s + "]";
}

// The files to read: one .safetensors, or every file an index names (a plain name in the
// index's directory: never a path that leaves it).
std::vector<std::string> files_at(const std::string& path, const std::string& what) {
  auto from_index = [&](const std::string& index_path) {
    nlohmann::json index;
    try {
      index = nlohmann::json::parse(read_regular_file(index_path, uint64_t{64} << 20));
    } catch (const std::exception& e) {
      throw InputError(what + ": " + index_path + ": not a safetensors index (" + e.what() + ")");
    }
    if (!index.is_object() || !index.contains("weight_map") || !index["weight_map"].is_object())
      throw InputError(what + ": " + index_path + ": no \"weight_map\" object");
    std::set<std::string> names;
    for (const auto& [tensor, file] : index["weight_map"].items()) {
      if (!file.is_string() || file.get<std::string>().empty() ||
          file.get<std::string>().find('/') != std::string::npos || file.get<std::string>() == "." ||
          file.get<std::string>() == "..")
        throw InputError(what + ": " + index_path + ": tensor \"" + tensor + "\" maps to " + file.dump() +
                         ", not a file name in the index's directory");
      names.insert(file.get<std::string>());
    }
    std::vector<std::string> out;
    for (const auto& n : names) out.push_back(dir_of(index_path) + "/" + n);
    return out;
  };
  if (is_directory(path)) {
    if (path_exists(path + "/" + kIndexName)) return from_index(path + "/" + kIndexName);
    if (path_exists(path + "/model.safetensors")) return {path + "/model.safetensors"};
    throw InputError(what + " = \"" + path + "\": a directory without " + kIndexName + " or model.safetensors");
  }
  if (const std::string kind = not_a_regular_file(path); !kind.empty())
    throw InputError(what + " = \"" + path + "\": " + (kind == "missing" ? "not found" : "is " + kind));
  if (path.size() >= 5 && path.compare(path.size() - 5, 5, ".json") == 0) return from_index(path);
  return {path};
}

}  // namespace

int64_t load_weights(models::Model& model, const std::string& path) { return load_weights(model, path, {}); }

std::map<std::string, std::pair<torch::Tensor, std::string>> read_weights(const std::string& path,
                                                                          const TensorRename& rename,
                                                                          const std::string& what) {
  std::map<std::string, std::pair<torch::Tensor, std::string>> found;  // name -> (tensor, file)
  for (const auto& file : files_at(path, what)) {
    SafetensorsFile f;
    try {
      f = read_safetensors(file);
    } catch (const std::exception& e) {
      throw InputError(what + ": " + std::string(e.what()));
    }
    for (auto& [file_name, t] : f.tensors) {
      const std::optional<std::string> to = rename ? rename(file_name) : file_name;
      if (!to) continue;
      const std::string& name = *to;
      if (found.count(name))
        throw InputError(what + ": tensor \"" + name + "\" is in both " + found[name].second + " and " + file);
      found[name] = {t, file};
    }
  }
  return found;
}

int64_t load_weights(models::Model& model, const std::string& path, const TensorRename& rename,
                     models::DeferredInit* deferred) {
  auto found = read_weights(path, rename, "model.init_from");
  auto targets = model.named_parameters();
  for (auto& b : model.named_buffers()) targets.push_back(b);
  std::string missing;
  int64_t loaded = 0;
  torch::NoGradGuard no_grad;
  for (auto& [name, dst] : targets) {
    auto it = found.find(name);
    if (it == found.end()) {
      missing += (missing.empty() ? "" : ", ") + name;
      continue;
    }
    const auto& [src, file] = it->second;
    if (src.sizes() != dst.sizes())
      throw InputError("model.init_from: " + file + ": \"" + name + "\" has shape " + shape_str(src) +
                       ", the model's is " + shape_str(dst));
    if (src.is_floating_point() != dst.is_floating_point())
      throw InputError("model.init_from: " + file + ": \"" + name + "\" is " +
                       std::string(c10::toString(src.scalar_type())) + ", the model's is " +
                       c10::toString(dst.scalar_type()));
    if (deferred && deferred->deferred(dst))
      deferred->from(dst, [view = src] { return view; });
    else
      dst.copy_(src);
    found.erase(it);
    ++loaded;
  }
  // Both lists at once: a renamed tensor is one of each.
  std::string extra;
  for (const auto& [name, v] : found) extra += (extra.empty() ? "" : ", ") + name;
  std::string problems;
  if (!missing.empty()) problems = "the model's " + missing + " not found in the file(s)";
  if (!extra.empty())
    problems += (problems.empty() ? "" : "; ") + std::string("tensors the model does not have: ") + extra;
  if (!problems.empty()) throw InputError("model.init_from = \"" + path + "\": " + problems);
  return loaded;
}

}  // namespace keel::checkpoint
