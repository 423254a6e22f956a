#include "trainer/app/log.h"

#include <algorithm>
#include <string>

#include "common/log.h"

namespace keel {

void init_logging(const RunConfig& cfg, int64_t rank, int64_t world) {
  auto level = cfg.log_level;
  if (rank != 0 && !cfg.all_ranks_log) level = std::max(level, logging::Level::warn);
  logging::configure("[rank " + std::to_string(rank) + "/" + std::to_string(world) + "]", level);
}

}  // namespace keel
