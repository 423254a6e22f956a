// common/text.h: small text helpers shared by the components.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace keel {

/// The lines of `text`, without their '\n'; a last line without one counts too, an empty
/// tail does not ("a\nb\n" and "a\nb" are both {"a", "b"}).
inline std::vector<std::string> split_lines(std::string_view text) {
  std::vector<std::string> lines;
  size_t a = 0;
  for (size_t b; (b = text.find('\n', a)) != std::string_view::npos; a = b + 1)
    lines.emplace_back(text.substr(a, b - a));
  if (a < text.size()) lines.emplace_back(text.substr(a));
  return lines;
}

}  // namespace keel
