#include "keel/trainer/tensorboard.h"

#include <dirent.h>
#include <unistd.h>

#include <boost/crc.hpp>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <stdexcept>

#include "keel/common/file.h"
#include "keel/common/log.h"
#include "keel/trainer/tensorboard_encode.h"

namespace keel {
namespace {

double now_s() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

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
  file_ = std::fopen(path_.c_str(), "wb");
  if (!file_) throw std::runtime_error("run.tensorboard: cannot create " + path_ + ": " + std::strerror(errno));
  write_record(tensorboard::encode_file_version(now_s()));
  flush();
}

EventWriter::~EventWriter() {
  if (file_) std::fclose(file_);
}

void EventWriter::scalars(int64_t step, const std::vector<std::pair<std::string, double>>& values) {
  write_record(tensorboard::encode_scalars(now_s(), step, values));
}

void EventWriter::resumed_at(int64_t step) { write_record(tensorboard::encode_session_start(now_s(), step)); }

void EventWriter::write_record(const std::string& bytes) {
  unsigned char header[12];
  const uint64_t n = bytes.size();
  for (int i = 0; i < 8; ++i) header[i] = static_cast<unsigned char>(n >> (8 * i));
  const uint32_t len_crc = masked_crc32c(header, 8);
  const uint32_t data_crc = masked_crc32c(bytes.data(), bytes.size());
  for (int i = 0; i < 4; ++i) header[8 + i] = static_cast<unsigned char>(len_crc >> (8 * i));
  unsigned char footer[4];
  for (int i = 0; i < 4; ++i) footer[i] = static_cast<unsigned char>(data_crc >> (8 * i));
  const bool ok = std::fwrite(header, 1, sizeof header, file_) == sizeof header &&
                  std::fwrite(bytes.data(), 1, bytes.size(), file_) == bytes.size() &&
                  std::fwrite(footer, 1, sizeof footer, file_) == sizeof footer;
  if (!ok && lost_++ == 0)
    logging::warn("run.tensorboard: cannot write to {}: {} (further events are counted as lost)", path_,
                  std::strerror(errno));
}

void EventWriter::flush() {
  if (std::fflush(file_) != 0 && lost_++ == 0)
    logging::warn("run.tensorboard: cannot write to {}: {}", path_, std::strerror(errno));
}

}  // namespace keel
