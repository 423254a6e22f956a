// trainer/metrics.h: what a run writes for people and scripts to read.
//
// Owns: <run.dir>/metrics.jsonl (one JSON object per line, flushed per line so a crash loses at
// most the line being written), summary.json (written atomically), and small helpers (median,
// mkdir -p). Does not own: what goes into them (trainer/trainer.cpp decides).
#pragma once

#include <nlohmann/json.hpp>

#include <cstdio>
#include <string>
#include <vector>

namespace keel {

class JsonlWriter {
 public:
  JsonlWriter() = default;
  /// Opens `path` for appending (creates it). Throws InputError naming the file on failure.
  explicit JsonlWriter(const std::string& path);
  ~JsonlWriter();
  JsonlWriter(const JsonlWriter&) = delete;
  JsonlWriter& operator=(const JsonlWriter&) = delete;
  JsonlWriter(JsonlWriter&& o) noexcept : f_(o.f_) { o.f_ = nullptr; }
  JsonlWriter& operator=(JsonlWriter&& o) noexcept;
  bool is_open() const { return f_ != nullptr; }
  void write(const nlohmann::json& j);

 private:
  std::FILE* f_ = nullptr;
};

/// Median of `v` (mean of the middle two for even sizes); NaN when empty.
double median(std::vector<double> v);

/// Writes `text` to `path` atomically: temp file in the same directory, fsync, rename.
void write_file_atomic(const std::string& path, const std::string& text);

/// mkdir -p; throws InputError naming the directory on failure.
void make_dirs(const std::string& path);

}  // namespace keel
