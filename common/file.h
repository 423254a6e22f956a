// common/file.h: opening the files keel reads (configs, data, models, checkpoints, caches).
//
// Owns: the one check every input path gets before a byte is read: it must be a regular file
// (after links), so that a directory, FIFO, socket or device (/dev/zero) is refused at once
// with a message naming the path and what it is, never read without bound or waited on.
// The open itself never blocks (O_NONBLOCK until the kind is known).
// Failures are std::runtime_error naming the path; callers turn them into their own error
// class (InputError for the user's files, FormatError for checkpoint files).
#pragma once

#include <cstdint>
#include <string>

namespace keel {

/// A read-only descriptor of the regular file `path` (the caller closes it); its size in `size`.
int open_regular_file(const std::string& path, uint64_t& size);

/// The whole of the regular file `path`, refused when larger than `max_bytes`.
std::string read_regular_file(const std::string& path, uint64_t max_bytes);

/// "" when `path` is a regular file, else what it is ("a directory", "a FIFO", "missing", ...).
std::string not_a_regular_file(const std::string& path);

/// mkdir -p `path` (mode 0755). "" on success, else a message naming the directory that could
/// not be made and why; the caller raises its own error class with it.
std::string make_dirs(const std::string& path);

}  // namespace keel
