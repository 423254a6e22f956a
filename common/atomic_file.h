// common/atomic_file.h: files that appear whole or not at all.
//
// Owns: the atomic writer keel uses for every file it produces (checkpoint shards, meta.json,
// config.toml, summary.json, plots, the compile cache): bytes go to a temporary name in the
// target directory with their SHA-256 computed on the way, then fsync and rename; the temp
// file is removed on failure. And fsync of a directory, so that renames inside it are durable.
// Failures are std::runtime_error with the path and strerror.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "common/sha256.h"

namespace keel {

struct WrittenFile {
  std::string name;  // file name within its directory
  uint64_t bytes = 0;
  std::string sha256;  // hex
};

/// Called before each write(2) with the bytes already written; a non-zero return is the errno
/// that write fails with (a seam for tests and fault injection).
using WriteCheck = std::function<int(uint64_t offset)>;

/// Writes `path` atomically. Bytes go to "<path>.tmp.<pid>"; commit() fsyncs and renames it
/// into place. Destroying an uncommitted writer removes the temp file.
class AtomicFile {
 public:
  explicit AtomicFile(std::string path);
  ~AtomicFile();
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;
  void write(const void* data, size_t n);
  /// Asks `check` before each write(2) (see WriteCheck); empty = none.
  void before_write(WriteCheck check) { check_ = std::move(check); }
  WrittenFile commit();

 private:
  void write_raw(const char* p, size_t n);
  std::string path_, tmp_;
  int fd_ = -1;
  Sha256 sha_;
  uint64_t bytes_ = 0;
  WriteCheck check_;
};

/// Writes `text` to `path` atomically (AtomicFile) and returns its size and checksum.
WrittenFile write_atomic(const std::string& path, const std::string& text);

/// fsync of a directory, so that renames inside it are durable.
void fsync_dir(const std::string& dir);

}  // namespace keel
