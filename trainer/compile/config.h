// trainer/compile/config.h: the [compile] section. Defaults here; each key's meaning, units and
// range are written once, in the config schema (trainer/config/schema.cpp, docs/config.md).
#pragma once

#include <cstdint>
#include <string>

#include "keel/common/choices.h"

namespace keel {

enum class CompileMode { Off, Trace };
inline constexpr Choices<CompileMode, 2> kCompileModes{{{"off", CompileMode::Off}, {"trace", CompileMode::Trace}}};

struct CompileConfig {
  CompileMode mode = CompileMode::Off;
  bool fullgraph = false;
  bool deterministic = false;
  int64_t max_recompiles = 8;
  std::string cache_dir = "";
  bool cuda_graphs = false;
};

}  // namespace keel
