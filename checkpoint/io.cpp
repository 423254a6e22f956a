#include "checkpoint/io.h"

#include "common/file.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
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

std::string sha256_file(const std::string& path) { return MappedFile::open(path)->sha256(); }

// Opens a regular file for reading (common/file.h: the kind is checked before anything can
// block); its size in `size`.
int open_regular(const std::string& path, size_t& size) {
  uint64_t n = 0;
  const int fd = open_regular_file(path, n);
  size = static_cast<size_t>(n);
  return fd;
}

std::string read_metadata(const std::string& path) {
  std::string text = read_regular_file(path, kMaxMetadataBytes);
  if (const size_t nul = text.find('\0'); nul != std::string::npos)
    throw std::runtime_error(path + ": not JSON text (a NUL byte at offset " + std::to_string(nul) + " of " +
                             std::to_string(text.size()) + ")");
  return text;
}

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
