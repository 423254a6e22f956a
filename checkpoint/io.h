// checkpoint/io.h: file I/O for checkpoints.
//
// Owns: whole-file reads and read-only mappings that name the file in every error, and the
// directory helpers a checkpoint root needs. The atomic writer and SHA-256 are common/'s
// (common/atomic_file.h), brought into this namespace below.
// Failures are std::runtime_error with the path and strerror.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/atomic_file.h"

namespace keel::checkpoint {

using keel::AtomicFile;
using keel::fsync_dir;
using keel::Sha256;
using keel::write_atomic;
using keel::WriteCheck;
using keel::WrittenFile;

/// SHA-256 of a whole file, streamed (hex).
std::string sha256_file(const std::string& path);

/// The most a checkpoint's metadata file (meta.json, an index) may hold: enough for the
/// largest world keel supports (2^18 ranks, a few files each), far below what would exhaust
/// memory or take long to read.
constexpr uint64_t kMaxMetadataBytes = uint64_t{256} << 20;

/// Reads a whole metadata file (JSON text) of at most kMaxMetadataBytes; throws
/// std::runtime_error naming the file and the cause when it cannot, when it is larger, or
/// when it holds a NUL byte (no JSON text does).
std::string read_metadata(const std::string& path);

/// A file mapped into memory (private, copy-on-write: writes never reach the file), unmapped
/// when the last reference goes. Throws std::runtime_error naming the file when it cannot.
class MappedFile {
 public:
  static std::shared_ptr<MappedFile> open(const std::string& path);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  /// SHA-256 of the contents (hex).
  std::string sha256() const;

 private:
  MappedFile() = default;
  uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

bool path_exists(const std::string& path);
bool is_directory(const std::string& path);
/// Whether `path` itself is a symbolic link (not followed).
bool is_symlink(const std::string& path);
/// Names of the entries of `dir` (not . and ..); empty when it cannot be read.
std::vector<std::string> list_dir(const std::string& dir);
/// rm -rf; errors are ignored (best effort, used for cleanup).
void remove_tree(const std::string& path);

}  // namespace keel::checkpoint
