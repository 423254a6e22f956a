// keel/common/choices.h: the names of a config choice and its enum, in one table.
//
// A section's header declares `enum class E` and `inline constexpr Choices<E, N> kE{...}`; the
// config schema parses the string once (trainer/config/schema.cpp) and code compares enums.
#pragma once

#include <array>
#include <cstddef>
#include <string_view>

namespace keel {

template <class E>
struct Choice {
  const char* name;
  E value;
};

template <class E, std::size_t N>
using Choices = std::array<Choice<E>, N>;

/// The name of `v` in `table` ("?" if it is not there).
template <class E, std::size_t N>
constexpr const char* choice_name(const Choices<E, N>& table, E v) {
  for (const auto& c : table)
    if (c.value == v) return c.name;
  return "?";
}

/// The value named `name`; false if none is.
template <class E, std::size_t N>
constexpr bool parse_choice(const Choices<E, N>& table, std::string_view name, E& out) {
  for (const auto& c : table)
    if (name == c.name) return out = c.value, true;
  return false;
}

}  // namespace keel
