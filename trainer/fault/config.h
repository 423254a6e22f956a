// trainer/fault/config.h: the [fault] section (trainer/fault/fault.h parses the entries).
#pragma once

#include <string>
#include <vector>

namespace keel {

struct FaultConfig {
  std::vector<std::string> inject;  // TYPE@step=S,rank=R entries (docs/faults.md)
};

}  // namespace keel
