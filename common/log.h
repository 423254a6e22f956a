// common/log.h: keel's log, used by every layer.
//
// Owns: the formatting front end (fmt format strings, checked at compile time) and the level
// test. Does not own: the sink, pattern and level, which common/log_sink.cpp keeps in spdlog
// (stderr, "[time] [rank r/N] [level] message", flush on warn).
//
// Why a front end of our own: LibTorch 2.x ships fmt 12 inside its include folder and its
// headers include it, while Debian's spdlog 1.10 is built on fmt 9; the two cannot meet in one
// translation unit. keel's sources format with LibTorch's fmt (header-only) and hand finished
// lines to the one translation unit that includes spdlog (compiled without LibTorch's include
// path). The two fmt versions live in distinct inline namespaces (fmt::v9, fmt::v12).
//
// Thread-safe: write() may be called from any thread (spdlog's _mt sink).
#pragma once

#include <string>
#include <string_view>
#include <utility>

#ifndef FMT_HEADER_ONLY
#define FMT_HEADER_ONLY 1
#endif
#include <fmt/format.h>

#include "keel/common/log_level.h"

namespace keel::logging {

template <class... A>
void log(Level level, fmt::format_string<A...> f, A&&... a) {
  if (enabled(level)) write(level, fmt::format(f, std::forward<A>(a)...));
}
template <class... A>
void debug(fmt::format_string<A...> f, A&&... a) {
  log(Level::debug, f, std::forward<A>(a)...);
}
template <class... A>
void info(fmt::format_string<A...> f, A&&... a) {
  log(Level::info, f, std::forward<A>(a)...);
}
template <class... A>
void warn(fmt::format_string<A...> f, A&&... a) {
  log(Level::warn, f, std::forward<A>(a)...);
}
template <class... A>
void error(fmt::format_string<A...> f, A&&... a) {
  log(Level::error, f, std::forward<A>(a)...);
}

}  // namespace keel::logging
