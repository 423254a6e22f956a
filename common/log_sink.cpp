// The spdlog side of common/log.h. Compiled WITHOUT LibTorch's include folder (see
// CMakeLists.txt: keel_log_sink), so <fmt/...> here is Debian's fmt 9 that spdlog 1.10 needs.
// Includes nothing that includes LibTorch.
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <deque>
#include <mutex>
#include <string>
#include <string_view>

#include "keel/common/log_level.h"

namespace keel::logging {

namespace {
spdlog::level::level_enum to_spd(Level l) { return static_cast<spdlog::level::level_enum>(static_cast<int>(l)); }

std::shared_ptr<spdlog::logger> logger() {
  static std::shared_ptr<spdlog::logger> l = [] {
    auto made = spdlog::stderr_color_mt("keel");
    made->set_pattern("[%H:%M:%S.%e] [%^%l%$] %v");
    made->flush_on(spdlog::level::warn);
    return made;
  }();
  return l;
}
}  // namespace

void configure(const std::string& rank_prefix, Level level) {
  logger()->set_pattern("[%H:%M:%S.%e] " + rank_prefix + " [%^%l%$] %v");
  logger()->set_level(to_spd(level));
}

Level parse_level(std::string_view name) {
  const auto l = spdlog::level::from_str(std::string(name));
  return l == spdlog::level::critical ? Level::error : static_cast<Level>(static_cast<int>(l));
}

bool enabled(Level level) { return logger()->should_log(to_spd(level)); }

namespace {
std::mutex g_tail_mu;
std::deque<std::string> g_tail;  // the last lines, for last_lines()
}  // namespace

void write(Level level, std::string_view line) {
  logger()->log(to_spd(level), spdlog::string_view_t(line.data(), line.size()));
  static const char* names[] = {"trace", "debug", "info", "warn", "error", "critical", "off"};
  std::lock_guard<std::mutex> lock(g_tail_mu);
  g_tail.push_back(std::string("[") + names[static_cast<int>(level)] + "] " + std::string(line.substr(0, 1000)));
  if (g_tail.size() > 20) g_tail.pop_front();
}

std::vector<std::string> last_lines() {
  std::lock_guard<std::mutex> lock(g_tail_mu);
  return {g_tail.begin(), g_tail.end()};
}

void flush() { logger()->flush(); }

}  // namespace keel::logging
