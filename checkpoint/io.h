// checkpoint/io.h: durable file I/O for checkpoints.
//
// Owns: streaming SHA-256 (OpenSSL EVP), an atomic file writer (temp name in the target
// directory, checksum while writing, fsync, rename; the temp file is removed on failure),
// fsync of a directory, and whole-file reads that name the file in every error.
// Failures are std::runtime_error with the path and strerror.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace keel::checkpoint {

class Sha256 {
 public:
  Sha256();
  ~Sha256();
  Sha256(const Sha256&) = delete;
  Sha256& operator=(const Sha256&) = delete;
  void update(const void* data, size_t n);
  /// Lower-case hex digest; the object is finished afterwards.
  std::string hex();

 private:
  struct Ctx;
  std::unique_ptr<Ctx> ctx_;
};

/// SHA-256 of a whole file, streamed (hex).
std::string sha256_file(const std::string& path);

struct WrittenFile {
  std::string name;     // file name within its directory
  uint64_t bytes = 0;
  std::string sha256;   // hex
};

/// Writes `path` atomically. Bytes go to "<path>.tmp.<pid>"; commit() fsyncs and renames it
/// into place. Destroying an uncommitted writer removes the temp file.
class AtomicFile {
 public:
  explicit AtomicFile(std::string path);
  ~AtomicFile();
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;
  void write(const void* data, size_t n);
  /// Makes every later write() fail with `errno_value` after `after_bytes` more bytes (fault
  /// injection: ENOSPC, EIO; a negative value kills the process with SIGKILL there instead).
  void fail_after(uint64_t after_bytes, int errno_value);
  WrittenFile commit();

 private:
  void write_raw(const char* p, size_t n);
  std::string path_, tmp_;
  int fd_ = -1;
  Sha256 sha_;
  uint64_t bytes_ = 0;
  uint64_t fail_at_ = UINT64_MAX;
  int fail_errno_ = 0;
};

/// Writes `text` to `path` atomically (AtomicFile) and returns its size and checksum.
WrittenFile write_atomic(const std::string& path, const std::string& text);

/// fsync of a directory, so that renames inside it are durable.
void fsync_dir(const std::string& dir);

/// Reads a whole file; throws std::runtime_error naming it when it cannot.
std::string read_all(const std::string& path);

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
