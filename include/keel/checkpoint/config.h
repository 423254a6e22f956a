// keel/checkpoint/config.h: the [checkpoint] section. Defaults here; each key's meaning, units and
// range are written once, in the config schema (trainer/config/schema.cpp, docs/config.md).
#pragma once

#include <cstdint>
#include <string>

namespace keel {

struct CheckpointConfig {
  std::string dir = "";
  int64_t interval = 0;
  int64_t keep = 3;
  bool async = false;
  std::string resume_from = "";
  bool save_graph = false;
};

}  // namespace keel
