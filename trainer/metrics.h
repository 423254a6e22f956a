// trainer/metrics.h: what a run writes for people and scripts to read.
//
// Owns: <run.dir>/metrics.jsonl (one JSON object per line, each appended whole or not at all:
// a failed write, e.g. a full disk, is rolled back so that no torn line stays; lost lines are
// counted and the first loss is logged at once), summary.json (written atomically), and small
// helpers (median, mkdir -p). Does not own: what goes into them (trainer/trainer.cpp decides).
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

/// Writes `text` to `path` atomically: temp file in the same directory, fsync, rename. Throws
/// std::runtime_error naming the file (a failure of the disk, not of the user's input).
void write_file_atomic(const std::string& path, const std::string& text);

/// mkdir -p; throws InputError naming the directory on failure.
void make_dirs(const std::string& path);

}  // namespace keel
