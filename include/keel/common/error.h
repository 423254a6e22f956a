// keel/common/error.h: the error every layer raises for bad user input.
//
// Owns: InputError. The CLI maps it to exit code 2 (bad config, command line, data or model
// files); every other exception is a failure while running and exits 1.
#pragma once

#include <stdexcept>

namespace keel {

/// A problem with the user's input (config file, command line, data files): reported with a
/// message naming the key or file, and mapped to exit code 2 by the CLI.
class InputError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

}  // namespace keel
