// trainer/compile/config.h: the [compile] section. Defaults here; each key's meaning, units and
// range are written once, in the config schema (trainer/config/schema.cpp, docs/config.md).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "keel/common/choices.h"

namespace keel {

enum class CompileMode { Off, Trace, Inductor };
inline constexpr Choices<CompileMode, 3> kCompileModes{
    {{"off", CompileMode::Off}, {"trace", CompileMode::Trace}, {"inductor", CompileMode::Inductor}}};

struct CompileConfig {
  CompileMode mode = CompileMode::Off;
  bool fullgraph = false;
  bool deterministic = false;
  int64_t max_recompiles = 8;
  std::string cache_dir = "";
  bool cuda_graphs = false;
  bool max_autotune = false;  // inductor: autotune kernels (a slower compile)
  std::string python = "";    // inductor: the packaging step's Python; "" = $KEEL_PYTHON, else keel's venv
  std::vector<std::string>
      libraries;  // inductor: shared libraries of custom ops (TORCH_LIBRARY), loaded here and there
};

}  // namespace keel
