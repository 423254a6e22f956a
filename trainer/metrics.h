// trainer/metrics.h: what a run writes for people and scripts to read.
//
// Owns: <run.dir>/metrics.jsonl (one JSON object per line, each appended whole or not at all:
// a failed write, e.g. a full disk, is rolled back so that no torn line stays; lost lines are
// counted and the first loss is logged at once), and small helpers (median, the metrics file's
// truncation on resume, durations, the straggler watch). Does not own: what goes into them (trainer/trainer.cpp
// decides).
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace keel {

class JsonlWriter {
 public:
  JsonlWriter() = default;
  /// Opens `path` for appending (creates it). Throws std::runtime_error naming the file.
  explicit JsonlWriter(const std::string& path);
  ~JsonlWriter();
  JsonlWriter(const JsonlWriter&) = delete;
  JsonlWriter& operator=(const JsonlWriter&) = delete;
  JsonlWriter(JsonlWriter&& o) noexcept;
  JsonlWriter& operator=(JsonlWriter&& o) noexcept;
  bool is_open() const { return fd_ >= 0; }
  /// Appends one line; false when it could not be written whole (nothing of it stays).
  bool write(const nlohmann::json& j);
  /// Lines that could not be written.
  int64_t lines_lost() const { return lost_; }

 private:
  int fd_ = -1;
  std::string path_;
  int64_t lost_ = 0;
};

/// Median of `v` (mean of the middle two for even sizes); NaN when empty.
double median(std::vector<double> v);

/// Keeps the lines of the metrics file `path` up to `step` (a resumed run rewrites what
/// followed; a line cut by a crash is dropped). No-op when the file does not exist.
void truncate_metrics(const std::string& path, int64_t step);

/// "1h05m", "3m07s"; "?" for a negative or non-finite value.
std::string format_duration(double seconds);

/// Watches the ranks' forward+backward times (rank 0, every step): a rank that is consistently
/// slower than the others sets the pace of the whole job, so after 20 steps in a row at more
/// than 1.5x (and 5 ms over) the median of the others it is named in a warning.
/// O(world) per step: one median (the other rank's time for 2 ranks).
class StragglerWatch {
 public:
  explicit StragglerWatch(int64_t world = 1) : streak_(static_cast<size_t>(world), 0) {}
  void observe(const std::vector<double>& rank_compute_ms);

 private:
  std::vector<int64_t> streak_;
};

}  // namespace keel
