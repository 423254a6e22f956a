#include "common/atomic_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <exception>
#include <stdexcept>
#include <thread>

namespace keel {
namespace {

[[noreturn]] void fail(const std::string& path, const std::string& what, int e) {
  throw std::runtime_error(path + ": " + what + ": " + std::strerror(e));
}

}  // namespace

AtomicFile::AtomicFile(std::string path) : path_(std::move(path)) {
  tmp_ = path_ + ".tmp." + std::to_string(::getpid());
  fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd_ < 0) fail(tmp_, "cannot create", errno);
}

AtomicFile::~AtomicFile() {
  if (fd_ >= 0) {
    ::close(fd_);
    ::unlink(tmp_.c_str());
  }
}

void AtomicFile::write(const void* data, size_t n) {
  // Large buffers: each chunk is hashed on a helper thread while it is being written, so the
  // checksum costs (almost) no extra time; SHA-256 stays sequential (chunk order is kept).
  constexpr size_t kChunk = 16u << 20;
  const char* p = static_cast<const char*>(data);
  if (n >= 2 * kChunk) {
    for (size_t off = 0; off < n; off += kChunk) {
      const size_t len = std::min(kChunk, n - off);
      std::exception_ptr hash_error;
      std::thread hasher([&] {
        try {
          sha_.update(p + off, len);
        } catch (...) {
          hash_error = std::current_exception();
        }
      });
      try {
        write_raw(p + off, len);
        // Start the disk write of this chunk now, so the final fsync has less left to do.
        ::sync_file_range(fd_, static_cast<off_t>(bytes_ - len), static_cast<off_t>(len), SYNC_FILE_RANGE_WRITE);
      } catch (...) {
        hasher.join();
        throw;
      }
      hasher.join();
      if (hash_error) std::rethrow_exception(hash_error);
    }
    return;
  }
  sha_.update(p, n);
  write_raw(p, n);
}

void AtomicFile::write_raw(const char* p, size_t n) {
  size_t off = 0;
  while (off < n) {
    const size_t chunk = std::min<size_t>(n - off, 64u << 20);
    if (check_)
      if (const int e = check_(bytes_)) fail(path_, "write failed", e);
    ssize_t w = ::write(fd_, p + off, chunk);
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) fail(path_, "write failed", errno);
    off += static_cast<size_t>(w);
    bytes_ += static_cast<uint64_t>(w);
  }
}

WrittenFile AtomicFile::commit() {
  if (::fsync(fd_) != 0) fail(path_, "fsync failed", errno);
  if (::close(fd_) != 0) {
    fd_ = -1;
    int e = errno;
    ::unlink(tmp_.c_str());
    fail(path_, "close failed", e);
  }
  fd_ = -1;
  if (::rename(tmp_.c_str(), path_.c_str()) != 0) {
    int e = errno;
    ::unlink(tmp_.c_str());
    fail(path_, "rename failed", e);
  }
  WrittenFile f;
  f.name = path_.substr(path_.rfind('/') + 1);
  f.bytes = bytes_;
  f.sha256 = sha_.hex();
  return f;
}

WrittenFile write_atomic(const std::string& path, const std::string& text) {
  AtomicFile f(path);
  f.write(text.data(), text.size());
  return f.commit();
}

void fsync_dir(const std::string& dir) {
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) fail(dir, "cannot open directory", errno);
  const int rc = ::fsync(fd);
  const int e = errno;
  ::close(fd);
  if (rc != 0 && e != EINVAL) fail(dir, "fsync of the directory failed", e);
}

}  // namespace keel
