#include "trainer/tensorboard.h"

#include <dirent.h>
#include <fcntl.h>
#include <unistd.h>

#include <boost/crc.hpp>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <stdexcept>

#include "common/file.h"
#include "common/log.h"
#include "trainer/tensorboard_encode.h"

namespace keel {
namespace {

double now_s() { return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count(); }

std::string hostname() {
  char buf[256] = {0};
  if (::gethostname(buf, sizeof buf - 1) != 0) return "localhost";
  std::string h = buf;
  for (auto& c : h)
    if (c == '/') c = '_';
  return h;
}

// The newest <unix time> among the event files already in `dir` (0 when none).
int64_t newest_event_time(const std::string& dir) {
  int64_t newest = 0;
  if (DIR* d = ::opendir(dir.c_str())) {
    const std::string prefix = "events.out.tfevents.";
    while (const dirent* e = ::readdir(d)) {
      const std::string n = e->d_name;
      if (n.rfind(prefix, 0) != 0) continue;
      newest = std::max<int64_t>(newest, std::atoll(n.c_str() + prefix.size()));
    }
    ::closedir(d);
  }
  return newest;
}

}  // namespace

uint32_t masked_crc32c(const void* data, size_t n) {
  boost::crc_optimal<32, 0x1EDC6F41, 0xFFFFFFFF, 0xFFFFFFFF, true, true> crc;  // CRC-32C (Castagnoli)
  crc.process_bytes(data, n);
  const uint32_t c = crc.checksum();
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

EventWriter::EventWriter(const std::string& dir) {
  if (const std::string err = make_dirs(dir); !err.empty()) throw std::runtime_error("run.tensorboard: " + err);
  const int64_t t = std::max<int64_t>(static_cast<int64_t>(std::time(nullptr)), newest_event_time(dir) + 1);
  path_ = dir + "/events.out.tfevents." + std::to_string(t) + "." + hostname();
  fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd_ < 0) throw std::runtime_error("run.tensorboard: cannot create " + path_ + ": " + std::strerror(errno));
  write_record(tensorboard::encode_file_version(now_s()));
}

EventWriter::~EventWriter() {
  if (fd_ < 0) return;
  if (torn_) (void)::ftruncate(fd_, static_cast<off_t>(end_));
  ::close(fd_);
}

void EventWriter::scalars(int64_t step, const std::vector<std::pair<std::string, double>>& values) {
  write_record(tensorboard::encode_scalars(now_s(), step, values));
}

void EventWriter::resumed_at(int64_t step) { write_record(tensorboard::encode_session_start(now_s(), step)); }

void EventWriter::write_record(const std::string& bytes) {
  if (fd_ < 0) return;
  // [uint64 length][masked CRC32C of it][data][masked CRC32C of data], little-endian, in one
  // buffer: one write puts the record down whole.
  std::string record(12 + bytes.size() + 4, '\0');
  auto put32 = [&](size_t at, uint32_t v) {
    for (int i = 0; i < 4; ++i) record[at + i] = static_cast<char>(static_cast<unsigned char>(v >> (8 * i)));
  };
  const uint64_t n = bytes.size();
  for (int i = 0; i < 8; ++i) record[i] = static_cast<char>(static_cast<unsigned char>(n >> (8 * i)));
  put32(8, masked_crc32c(record.data(), 8));
  std::memcpy(&record[12], bytes.data(), bytes.size());
  put32(12 + bytes.size(), masked_crc32c(bytes.data(), bytes.size()));

  size_t off = 0;
  int err = 0;
  while (off < record.size()) {
    const ssize_t w = ::pwrite(fd_, record.data() + off, record.size() - off, static_cast<off_t>(end_ + off));
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) {
      err = w < 0 ? errno : ENOSPC;
      break;
    }
    off += static_cast<size_t>(w);
  }
  if (off == record.size()) {
    end_ += static_cast<int64_t>(record.size());
    // Bytes of an earlier cut record that could not be cut off may lie past the new end.
    if (torn_ && ::ftruncate(fd_, static_cast<off_t>(end_)) == 0) torn_ = false;
    return;
  }
  // Part of the record may be on disk: cut it off, so that the file holds whole records only.
  // Should the cut itself fail, the next record goes to end_ all the same, over those bytes.
  if (off > 0 && ::ftruncate(fd_, static_cast<off_t>(end_)) != 0) torn_ = true;
  if (lost_++ == 0)
    logging::warn(
        "run.tensorboard: a record could not be written to {} ({}); the event file stays whole, but "
        "events are being lost (counted; later events are written once there is space again)",
        path_, std::strerror(err));
}

void EventWriter::flush() {}

}  // namespace keel
