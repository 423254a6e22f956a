#include "checkpoint/io.h"

#include "common/file.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <openssl/evp.h>

#include <cerrno>
#include <csignal>
#include <algorithm>
#include <cstring>
#include <exception>
#include <stdexcept>
#include <thread>

namespace keel::checkpoint {
namespace {

[[noreturn]] void fail(const std::string& path, const std::string& what, int e) {
  throw std::runtime_error(path + ": " + what + ": " + std::strerror(e));
}

}  // namespace

struct Sha256::Ctx {
  EVP_MD_CTX* md = nullptr;
};

Sha256::Sha256() : ctx_(std::make_unique<Ctx>()) {
  ctx_->md = EVP_MD_CTX_new();
  if (!ctx_->md || EVP_DigestInit_ex(ctx_->md, EVP_sha256(), nullptr) != 1)
    throw std::runtime_error("OpenSSL: cannot initialise SHA-256");
}

Sha256::~Sha256() {
  if (ctx_->md) EVP_MD_CTX_free(ctx_->md);
}

void Sha256::update(const void* data, size_t n) {
  if (n && EVP_DigestUpdate(ctx_->md, data, n) != 1) throw std::runtime_error("OpenSSL: SHA-256 update failed");
}

std::string Sha256::hex() {
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  if (EVP_DigestFinal_ex(ctx_->md, md, &len) != 1) throw std::runtime_error("OpenSSL: SHA-256 final failed");
  static const char* digits = "0123456789abcdef";
  std::string out;
  for (unsigned int i = 0; i < len; ++i) out += digits[md[i] >> 4], out += digits[md[i] & 15];
  return out;
}

std::string sha256_file(const std::string& path) { return MappedFile::open(path)->sha256(); }

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

void AtomicFile::fail_after(uint64_t after_bytes, int errno_value) {
  fail_at_ = bytes_ + after_bytes;
  fail_errno_ = errno_value;
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
    size_t chunk = std::min<size_t>(n - off, 64u << 20);
    if (bytes_ + chunk > fail_at_) {
      chunk = static_cast<size_t>(fail_at_ - bytes_);
      if (chunk == 0) {
        if (fail_errno_ < 0) std::raise(SIGKILL);  // a crash in the middle of a save
        fail(path_, "write failed (fault injection)", fail_errno_);
      }
    }
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

// Opens a regular file for reading (common/file.h: the kind is checked before anything can
// block); its size in `size`.
int open_regular(const std::string& path, size_t& size) {
  uint64_t n = 0;
  const int fd = open_regular_file(path, n);
  size = static_cast<size_t>(n);
  return fd;
}

std::string read_all(const std::string& path) { return read_regular_file(path, UINT64_MAX); }

std::shared_ptr<MappedFile> MappedFile::open(const std::string& path) {
  size_t size = 0;
  const int fd = open_regular(path, size);
  std::shared_ptr<MappedFile> m(new MappedFile());
  m->size_ = size;
  if (m->size_ > 0) {
    // No MAP_POPULATE: on a writable private mapping it would copy every page up front; read
    // faults map the page-cache pages themselves.
    void* p = ::mmap(nullptr, m->size_, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
      int e = errno;
      ::close(fd);
      fail(path, "mmap failed", e);
    }
    m->data_ = static_cast<uint8_t*>(p);
    ::madvise(p, m->size_, MADV_SEQUENTIAL | MADV_WILLNEED);
  }
  ::close(fd);
  return m;
}

MappedFile::~MappedFile() {
  if (data_) ::munmap(data_, size_);
}

std::string MappedFile::sha256() const {
  Sha256 h;
  h.update(data_, size_);
  return h.hex();
}

bool path_exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

bool is_symlink(const std::string& path) {
  struct stat st {};
  return ::lstat(path.c_str(), &st) == 0 && S_ISLNK(st.st_mode);
}

bool is_directory(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

std::vector<std::string> list_dir(const std::string& dir) {
  std::vector<std::string> out;
  DIR* d = ::opendir(dir.c_str());
  if (!d) return out;
  while (dirent* e = ::readdir(d)) {
    std::string n = e->d_name;
    if (n != "." && n != "..") out.push_back(n);
  }
  ::closedir(d);
  return out;
}

void remove_tree(const std::string& path) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) return;
  if (S_ISDIR(st.st_mode)) {
    for (const auto& n : list_dir(path)) remove_tree(path + "/" + n);
    ::rmdir(path.c_str());
  } else {
    ::unlink(path.c_str());
  }
}

}  // namespace keel::checkpoint
