// Precompiled header for keel's own targets: LibTorch's headers dominate compile time
// (~20 s per translation unit on the 2-core build machine); compiling them once saves minutes.
#pragma once
#include <torch/torch.h>

#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>
