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

/// An exclusive advisory lock on the directory `dir`, held through `<dir>/.keel.lock` with
/// flock(2): the kernel releases it when the process ends, however it ends (SIGKILL too), so a
/// lock is never stale. The holder writes who it is into the file (pid, host, what) for the
/// message of a run that finds it taken.
class DirLock {
 public:
  DirLock() = default;
  ~DirLock();
  DirLock(DirLock&& o) noexcept : fd_(o.fd_) { o.fd_ = -1; }
  DirLock& operator=(DirLock&& o) noexcept;
  DirLock(const DirLock&) = delete;
  DirLock& operator=(const DirLock&) = delete;
  /// Creates `dir` if needed and takes its lock without waiting. "" on success; otherwise why
  /// not: "held by <who the holder wrote>" when another process holds it, or the error.
  /// `who` is written into the lock file on success.
  std::string try_lock(const std::string& dir, const std::string& who);
  bool held() const { return fd_ >= 0; }

 private:
  int fd_ = -1;
};

}  // namespace keel
