// keel/common/log_level.h: the log levels, shared by common/log.h and its spdlog sink (this header
// includes nothing, so that the sink can include it without LibTorch's fmt).
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace keel::logging {

// Values equal spdlog::level::level_enum's (the sink casts).
enum class Level { trace = 0, debug = 1, info = 2, warn = 3, error = 4, off = 6 };

/// Sets the line prefix ("[rank r/N]") and the level; the first call creates the sink.
void configure(const std::string& rank_prefix, Level level);
/// Parses "trace" | "debug" | "info" | "warn" | "error" | "off"; anything else is off.
Level parse_level(std::string_view name);
bool enabled(Level level);
void write(Level level, std::string_view line);
void flush();
/// The last lines written (at most 20, oldest first, with their level's name): what a flight
/// record's dump keeps of this rank's log.
std::vector<std::string> last_lines();

}  // namespace keel::logging
