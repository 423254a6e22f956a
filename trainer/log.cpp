#include "trainer/log.h"

#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

namespace keel {

void init_logging(const RunConfig& cfg, int64_t rank, int64_t world) {
  auto logger = spdlog::get("keel");
  if (!logger) {
    logger = spdlog::stderr_color_mt("keel");
    spdlog::set_default_logger(logger);
  }
  logger->set_pattern("[%H:%M:%S.%e] [rank " + std::to_string(rank) + "/" + std::to_string(world) +
                      "] [%^%l%$] %v");
  auto level = spdlog::level::from_str(cfg.log_level);
  if (rank != 0 && !cfg.all_ranks_log) level = std::max(level, spdlog::level::warn);
  logger->set_level(level);
  logger->flush_on(spdlog::level::warn);
}

}  // namespace keel
