#include "keel/trainer/metrics.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>

#include "keel/common/atomic_file.h"
#include "keel/common/log.h"
#include "keel/trainer/config/config.h"

namespace keel {

JsonlWriter::JsonlWriter(const std::string& path) : path_(path) {
  fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (fd_ < 0) throw std::runtime_error(path + ": cannot open for writing: " + std::strerror(errno));
}

JsonlWriter::~JsonlWriter() {
  if (fd_ >= 0) ::close(fd_);
}

JsonlWriter::JsonlWriter(JsonlWriter&& o) noexcept : fd_(o.fd_), path_(std::move(o.path_)), lost_(o.lost_) {
  o.fd_ = -1;
}

JsonlWriter& JsonlWriter::operator=(JsonlWriter&& o) noexcept {
  if (this != &o) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = o.fd_;
    path_ = std::move(o.path_);
    lost_ = o.lost_;
    o.fd_ = -1;
  }
  return *this;
}

bool JsonlWriter::write(const nlohmann::json& j) {
  if (fd_ < 0) return false;
  const std::string line = j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
  struct stat st {};
  const off_t before = ::fstat(fd_, &st) == 0 ? st.st_size : -1;
  size_t off = 0;
  int err = 0;
  while (off < line.size()) {
    const ssize_t n = ::write(fd_, line.data() + off, line.size() - off);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      err = n < 0 ? errno : ENOSPC;
      break;
    }
    off += static_cast<size_t>(n);
  }
  if (off == line.size()) return true;
  // Part of the line may be on disk: cut it off, so that the file stays one object per line.
  if (off > 0 && before >= 0 && S_ISREG(st.st_mode)) (void)::ftruncate(fd_, before);
  if (lost_++ == 0)
    logging::warn(
        "{}: a line could not be written ({}); the file stays well-formed, but lines are being "
        "lost (summary.json counts them in metrics_lines_lost)",
        path_, std::strerror(err));
  return false;
}

double median(std::vector<double> v) {
  if (v.empty()) return std::nan("");
  const size_t n = v.size(), mid = n / 2;
  std::nth_element(v.begin(), v.begin() + mid, v.end());
  double hi = v[mid];
  if (n % 2) return hi;
  double lo = *std::max_element(v.begin(), v.begin() + mid);
  return 0.5 * (lo + hi);
}

void truncate_metrics(const std::string& path, int64_t step) {
  std::ifstream in(path);
  if (!in) return;
  std::string kept, line;
  while (std::getline(in, line)) {
    try {
      auto j = nlohmann::json::parse(line);
      if (j.value("step", int64_t{0}) > step) continue;
    } catch (const std::exception&) {
      continue;  // a line cut by the crash
    }
    kept += line + "\n";
  }
  write_atomic(path, kept);
}

std::string format_duration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  const int64_t s = static_cast<int64_t>(seconds + 0.5);
  char buf[32];
  if (s >= 3600)
    std::snprintf(buf, sizeof buf, "%ldh%02ldm", long(s / 3600), long(s % 3600 / 60));
  else
    std::snprintf(buf, sizeof buf, "%ldm%02lds", long(s / 60), long(s % 60));
  return buf;
}

void StragglerWatch::observe(const std::vector<double>& c) {
  const auto world = static_cast<int64_t>(streak_.size());
  if (world < 2 || static_cast<int64_t>(c.size()) != world) return;
  const double m_all = median(c);
  for (int64_t r = 0; r < world; ++r) {
    const double m = world == 2 ? c[1 - r] : m_all;
    streak_[r] = c[r] > 1.5 * m && c[r] > m + 5.0 ? streak_[r] + 1 : 0;
    if (streak_[r] == 20)
      logging::warn(
          "rank {} is consistently slower: its forward+backward took {:.1f} ms vs {:.1f} ms (median of the "
          "other ranks) for 20 steps in a row; every rank waits for it (rank_compute_ms in metrics.jsonl)",
          r, c[r], m);
  }
}

}  // namespace keel
