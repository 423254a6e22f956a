#include "checkpoint/meta.h"

#include <algorithm>
#include <cstdint>

#include "keel/dist/world.h"

namespace keel::checkpoint {

bool plain_name(const std::string& n) {
  return !n.empty() && n.find('/') == std::string::npos && n != "." && n != ".." && n.find('\0') == std::string::npos;
}

namespace {

nlohmann::json parse_json(const std::string& text, const std::string& path) {
  try {
    return nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    throw FormatError(path + ": not valid JSON: " + e.what());
  }
}

}  // namespace

nlohmann::json parse_meta(const std::string& text, const std::string& path, const std::string& dir_name) {
  nlohmann::json meta = parse_json(text, path);
  if (!meta.is_object() || !meta.contains("files") || !meta["files"].is_object())
    throw FormatError(path + ": missing or malformed \"files\"");
  const auto format = meta.value("format", nlohmann::json());
  const auto version = meta.value("format_version", nlohmann::json());
  if (format != "keel-checkpoint" || version != 1)
    throw FormatError(path + ": \"format\" / \"format_version\" are not keel-checkpoint / 1 (" + format.dump() + " / " +
                      version.dump() + ")");
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
  // Each rank of the saving job wrote at least a model and an optimizer shard.
  integer("world_size", 1, std::min<int64_t>(dist::kMaxWorldSize, static_cast<int64_t>(meta["files"].size()) / 2));
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
  if (meta.contains("state") && !meta["state"].is_object()) throw FormatError(path + ": \"state\" is not an object");
  if (meta.contains("optimizer")) {
    const auto& o = meta["optimizer"];
    const int64_t world = meta["world_size"].get<int64_t>();
    if (!o.is_object()) throw FormatError(path + ": \"optimizer\" is not an object");
    const auto zero = o.value("zero", nlohmann::json());
    if (!zero.is_number_integer() || zero.get<int64_t>() < 0 || zero.get<int64_t>() > 3)
      throw FormatError(path + ": \"optimizer.zero\" must be 0, 1, 2 or 3, got " + zero.dump());
    // The optimizer's fields and which parameters have them (checkpoint::State::optimizer_fields).
    if (o.contains("fields") != o.contains("state"))
      throw FormatError(path + ": \"optimizer\" has one of \"fields\" and \"state\" without the other");
    if (o.contains("fields")) {
      if (!o["fields"].is_object()) throw FormatError(path + ": \"optimizer.fields\" is not an object");
      for (auto it = o["fields"].begin(); it != o["fields"].end(); ++it)
        if (it.value() != "scalar" && it.value() != "param")
          throw FormatError(path + ": optimizer.fields[\"" + it.key() + "\"] must be \"scalar\" or \"param\", got " +
                            it.value().dump().substr(0, 100));
      if (!o["state"].is_object()) throw FormatError(path + ": \"optimizer.state\" is not an object");
      for (auto it = o["state"].begin(); it != o["state"].end(); ++it) {
        const auto& f = it.value();
        if (!f.is_array()) throw FormatError(path + ": optimizer.state[\"" + it.key() + "\"] is not a list of fields");
        for (const auto& x : f)
          if (!x.is_string() || !o["fields"].contains(x.get<std::string>()))
            throw FormatError(path + ": optimizer.state[\"" + it.key() + "\"] names " + x.dump().substr(0, 100) +
                              ", which is not one of optimizer.fields");
        // Every field or none: a partial state cannot be resumed.
        if (!f.empty() && f.size() != o["fields"].size())
          throw FormatError(path + ": optimizer.state[\"" + it.key() + "\"] has " + f.dump() + ", not every field of " +
                            o["fields"].dump() + " (partial optimizer state)");
      }
    }
    if (o.contains("owners")) {
      if (!o["owners"].is_object()) throw FormatError(path + ": \"optimizer.owners\" is not an object");
      for (auto it = o["owners"].begin(); it != o["owners"].end(); ++it)
        if (!it.value().is_number_integer() || it.value().get<int64_t>() < 0 || it.value().get<int64_t>() >= world)
          throw FormatError(path + ": optimizer.owners[\"" + it.key() + "\"] must be a rank in [0, " +
                            std::to_string(world) + "), got " + it.value().dump());
    }
  }
  return meta;
}

std::map<std::string, std::string> parse_optimizer_index(const std::string& text, const std::string& path,
                                                         const std::set<std::string>& shard_names) {
  const nlohmann::json index = parse_json(text, path);
  if (!index.is_object() || !index.contains("weight_map") || !index["weight_map"].is_object())
    throw FormatError(path + ": no weight_map");
  std::map<std::string, std::string> out;
  const auto& map = index["weight_map"];
  for (auto it = map.begin(); it != map.end(); ++it) {
    if (!it.value().is_string()) throw FormatError(path + ": weight_map[\"" + it.key() + "\"] is not a file name");
    const std::string file = it.value().get<std::string>();
    if (!shard_names.count(file))
      throw FormatError(path + ": weight_map[\"" + it.key() + "\"] = \"" + file.substr(0, 200) +
                        "\" is not an optimizer file of this step");
    out.emplace(it.key(), file);
  }
  return out;
}

void check_index(const std::string& text, const std::string& path, const std::set<std::string>& shard_names,
                 const std::set<std::string>& model_tensors) {
  const nlohmann::json index = parse_json(text, path);
  if (!index.is_object() || !index.contains("weight_map") || !index["weight_map"].is_object())
    throw FormatError(path + ": no weight_map");
  const auto& map = index["weight_map"];
  for (auto it = map.begin(); it != map.end(); ++it) {
    if (!it.value().is_string()) throw FormatError(path + ": weight_map[\"" + it.key() + "\"] is not a file name");
    const std::string file = it.value().get<std::string>();
    if (!plain_name(file))
      throw FormatError(path + ": weight_map[\"" + it.key() + "\"] = \"" + file +
                        "\" points outside the checkpoint directory");
    if (!shard_names.count(file))
      throw FormatError(path + ": weight_map[\"" + it.key() + "\"] names " + file +
                        ", which is not a shard of this step");
    if (!model_tensors.count(it.key()))
      throw FormatError(path + ": weight_map lists \"" + it.key() + "\", which no shard holds");
  }
  if (map.size() != model_tensors.size())
    throw FormatError(path + ": weight_map lists " + std::to_string(map.size()) + " tensors, the shards hold " +
                      std::to_string(model_tensors.size()));
}

}  // namespace keel::checkpoint
