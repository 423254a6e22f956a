#include "common/file.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>

namespace keel {
namespace {

std::string kind_of(mode_t m) {
  if (S_ISDIR(m)) return "a directory";
  if (S_ISFIFO(m)) return "a FIFO";
  if (S_ISSOCK(m)) return "a socket";
  if (S_ISCHR(m)) return "a character device";
  if (S_ISBLK(m)) return "a block device";
  return "not a regular file";
}

[[noreturn]] void fail(const std::string& path, const std::string& what) {
  throw std::runtime_error(path + ": " + what);
}

}  // namespace

std::string not_a_regular_file(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return errno == ENOENT ? "missing" : std::strerror(errno);
  return S_ISREG(st.st_mode) ? "" : kind_of(st.st_mode);
}

int open_regular_file(const std::string& path, uint64_t& size) {
  // O_NONBLOCK: opening a FIFO with no writer would otherwise wait forever.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
  if (fd < 0) fail(path, std::string("cannot open: ") + std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int e = errno;
    ::close(fd);
    fail(path, std::string("cannot stat: ") + std::strerror(e));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    fail(path, "is " + kind_of(st.st_mode) + ", not a regular file");
  }
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  size = static_cast<uint64_t>(st.st_size);
  return fd;
}

std::string read_regular_file(const std::string& path, uint64_t max_bytes) {
  uint64_t size = 0;
  const int fd = open_regular_file(path, size);
  if (size > max_bytes) {
    ::close(fd);
    fail(path, std::to_string(size) + " bytes, more than the " + std::to_string(max_bytes) + " this file may have");
  }
  std::string out(size, '\0');
  size_t off = 0;
  while (off < out.size()) {
    const ssize_t n = ::read(fd, &out[off], out.size() - off);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int e = errno;
      ::close(fd);
      fail(path, std::string("read failed: ") + std::strerror(e));
    }
    if (n == 0) break;  // the file shrank meanwhile
    off += static_cast<size_t>(n);
  }
  ::close(fd);
  out.resize(off);
  return out;
}

std::string make_dirs(const std::string& path) {
  if (path.empty()) return "";
  for (size_t pos = path.find('/', 1);; pos = path.find('/', pos + 1)) {
    const std::string cur = path.substr(0, pos);
    if (::mkdir(cur.c_str(), 0755) != 0 && errno != EEXIST)
      return cur + ": cannot create directory: " + std::strerror(errno);
    if (pos == std::string::npos) break;
  }
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) return path + ": not a directory";
  return "";
}

}  // namespace keel

namespace keel {

DirLock::~DirLock() {
  if (fd_ >= 0) ::close(fd_);  // closing the last descriptor releases the flock
}

DirLock& DirLock::operator=(DirLock&& o) noexcept {
  if (this != &o) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = o.fd_;
    o.fd_ = -1;
  }
  return *this;
}

std::string DirLock::try_lock(const std::string& dir, const std::string& who) {
  if (std::string err = make_dirs(dir); !err.empty()) return err;
  const std::string path = dir + "/.keel.lock";
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0644);
  if (fd < 0) return "cannot open " + path + ": " + std::strerror(errno);
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    return path + " is not a regular file";
  }
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int e = errno;
    std::string holder;
    if (e == EWOULDBLOCK) {
      char buf[512] = {0};
      const ssize_t n = ::pread(fd, buf, sizeof buf - 1, 0);
      holder = n > 0 ? std::string(buf, static_cast<size_t>(n)) : std::string("another process");
      while (!holder.empty() && (holder.back() == '\n' || holder.back() == '\0')) holder.pop_back();
    }
    ::close(fd);
    return e == EWOULDBLOCK ? "held by " + holder : "cannot lock " + path + ": " + std::strerror(e);
  }
  // Ours: say who holds it (best effort; the lock itself is the flock, not this text).
  const std::string text = who + "\n";
  if (::ftruncate(fd, 0) == 0) (void)!::pwrite(fd, text.data(), text.size(), 0);
  if (fd_ >= 0) ::close(fd_);
  fd_ = fd;
  return "";
}

}  // namespace keel
