// trainer/data/config.h: the [data] section. Defaults here; each key's meaning, units and range
// are written once, in the config schema (trainer/config/schema.cpp, docs/config.md).
#pragma once

#include <cstdint>
#include <string>

namespace keel {

struct DataConfig {
  std::string name = "fashion_mnist";
  std::string path = "";
  bool drop_last = true;
  bool shuffle = true;
  int64_t eval_batch_size = 1000;
  int64_t synthetic_size = 4096;
  double test_fraction = 0.1;
};

}  // namespace keel
