#include "checkpoint/meta.h"

#include <algorithm>
#include <cstdint>

#include "keel/dist/world.h"

namespace keel::checkpoint {

bool plain_name(const std::string& n) {
  return !n.empty() && n.find('/') == std::string::npos && n != "." && n != ".." && n.find('\0') == std::string::npos;
}

std::string component_name_problem(const std::string& n) {
  if (n.empty() || n.size() > 64) return "must have 1 to 64 characters";
  for (const char c : n)
    if (!((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_')) return "may hold only a-z, 0-9 and _";
  return "";
}

namespace {

nlohmann::json parse_json(const std::string& text, const std::string& path) {
  try {
    return nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    throw FormatError(path + ": not valid JSON: " + e.what());
  }
}

// One component's record in a format 2 meta.json: {"values": {...}, "tensors": {name: {"dtype",
// "shape"}}, "owned": [names of tensors], "files": [names listed in "files"]}.
void check_component(const nlohmann::json& meta, const std::string& name, const nlohmann::json& c,
                     const std::string& path) {
  const std::string where = path + ": components." + name.substr(0, 64);
  if (const std::string p = component_name_problem(name); !p.empty())
    throw FormatError(path + ": component name \"" + name.substr(0, 100) + "\" " + p);
  if (!c.is_object()) throw FormatError(where + " is not an object");
  if (c.contains("values") && !c["values"].is_object()) throw FormatError(where + ".values is not an object");
  if (c.contains("tensors")) {
    if (!c["tensors"].is_object()) throw FormatError(where + ".tensors is not an object");
    for (auto it = c["tensors"].begin(); it != c["tensors"].end(); ++it) {
      const auto& t = it.value();
      bool ok = t.is_object() && t.contains("dtype") && t["dtype"].is_string() && t.contains("shape") &&
                t["shape"].is_array() && t["shape"].size() <= 64;
      for (size_t k = 0; ok && k < t["shape"].size(); ++k)
        ok = t["shape"][k].is_number_integer() && t["shape"][k].get<int64_t>() >= 0;
      if (!ok)
        throw FormatError(where + ".tensors[\"" + it.key().substr(0, 200) +
                          "\"] is not {\"dtype\": string, \"shape\": [integers >= 0]}");
    }
  }
  for (const char* list : {"owned", "files"}) {
    if (!c.contains(list)) continue;
    if (!c[list].is_array()) throw FormatError(where + "." + list + " is not a list");
    for (const auto& n : c[list]) {
      const bool ok =
          n.is_string() &&
          (list[0] == 'o' ? c.contains("tensors") && c["tensors"].contains(n.get<std::string>())
                          : plain_name(n.get<std::string>()) && meta["files"].contains(n.get<std::string>()));
      if (!ok)
        throw FormatError(where + "." + list + " names " + n.dump().substr(0, 200) + ", which " +
                          (list[0] == 'o' ? "is not one of its tensors" : "meta.json's files do not list"));
    }
  }
}

void check_components(const nlohmann::json& meta, const std::string& path) {
  if (!meta.contains("components") || !meta["components"].is_object())
    throw FormatError(path + ": missing or malformed \"components\"");
  for (auto it = meta["components"].begin(); it != meta["components"].end(); ++it)
    check_component(meta, it.key(), it.value(), path);
}

}  // namespace

nlohmann::json parse_meta(const std::string& text, const std::string& path, const std::string& dir_name) {
  nlohmann::json meta = parse_json(text, path);
  if (!meta.is_object() || !meta.contains("files") || !meta["files"].is_object())
    throw FormatError(path + ": missing or malformed \"files\"");
  const auto format = meta.value("format", nlohmann::json());
  const auto version = meta.value("format_version", nlohmann::json());
  if (format != "keel-checkpoint" || (version != 1 && version != 2))
    throw FormatError(path + ": \"format\" / \"format_version\" are not keel-checkpoint / 1 or 2 (" + format.dump() +
                      " / " + version.dump() + "): written by a newer keel, or not a keel checkpoint");
  // Integers in range, never trusted: a world size sizes every loop of the loader.
  auto integer = [&](const char* key, int64_t lo, int64_t hi) {
    const auto v = meta.value(key, nlohmann::json());
    if (!v.is_number_integer() || (v.is_number_unsigned() && v.get<uint64_t>() > uint64_t(INT64_MAX)) ||
        v.get<int64_t>() < lo || v.get<int64_t>() > hi)
      throw FormatError(path + ": \"" + key + "\" must be an integer in [" + std::to_string(lo) + ", " +
                        std::to_string(hi) + "], got " + v.dump());
    return v.get<int64_t>();
  };
  const int64_t step = integer("step", 0, INT64_MAX);
  // Each rank of the saving job wrote at least its rank file.
  integer("world_size", 1, std::min<int64_t>(dist::kMaxWorldSize, static_cast<int64_t>(meta["files"].size())));
  // The directory's name, when it is step_<N>, is the step meta.json says.
  if (dir_name.size() > 5 && dir_name.rfind("step_", 0) == 0 &&
      dir_name.find_first_not_of("0123456789", 5) == std::string::npos && dir_name.substr(5) != std::to_string(step))
    throw FormatError(path + ": \"step\" is " + std::to_string(step) + " in the directory " + dir_name);
  for (auto it = meta["files"].begin(); it != meta["files"].end(); ++it) {
    if (!plain_name(it.key()))
      throw FormatError(path + ": file entry \"" + it.key() + "\" points outside the step directory");
    const auto& f = it.value();
    if (!f.is_object() || !f.contains("sha256") || !f["sha256"].is_string() || !f.contains("bytes") ||
        !f["bytes"].is_number_unsigned())
      throw FormatError(path + ": file entry \"" + it.key() + "\" lacks sha256 / bytes");
  }
  if (version == 1) {
    if (meta.contains("state") && !meta["state"].is_object()) throw FormatError(path + ": \"state\" is not an object");
  } else {
    check_components(meta, path);
  }
  return meta;
}

std::map<std::string, std::string> parse_index(const std::string& text, const std::string& path,
                                               const std::set<std::string>& shard_names) {
  const nlohmann::json index = parse_json(text, path);
  if (!index.is_object() || !index.contains("weight_map") || !index["weight_map"].is_object())
    throw FormatError(path + ": no weight_map");
  std::map<std::string, std::string> out;
  const auto& map = index["weight_map"];
  for (auto it = map.begin(); it != map.end(); ++it) {
    if (!it.value().is_string()) throw FormatError(path + ": weight_map[\"" + it.key() + "\"] is not a file name");
    const std::string file = it.value().get<std::string>();
    if (!plain_name(file))
      throw FormatError(path + ": weight_map[\"" + it.key().substr(0, 200) + "\"] = \"" + file.substr(0, 200) +
                        "\" points outside the checkpoint directory");
    if (!shard_names.count(file))
      throw FormatError(path + ": weight_map[\"" + it.key().substr(0, 200) + "\"] = \"" + file.substr(0, 200) +
                        "\" is not one of this component's files in the step");
    out.emplace(it.key(), file);
  }
  return out;
}

}  // namespace keel::checkpoint
