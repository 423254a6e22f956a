// trainer/metrics.h: what a run reports for people and scripts to read, as one component.
//
// Owns: RunMetrics, which the loop calls once per step with the step's record (StepRecord: each
// scalar once, with its metrics.jsonl key and its TensorBoard tag); from that one record it writes
// <run.dir>/metrics.jsonl (one JSON object per line, each appended whole or not at all: a failed
// write, e.g. a full disk, is rolled back so that no torn line stays; lost lines are counted),
// the TensorBoard event file (run.tensorboard), the progress line and the log line, and keeps the
// step times behind the summary's median, the ETA and MFU; the straggler watch; small helpers
// (median, the metrics file's truncation on resume, durations). Does not own: which scalars a step
// has (trainer/trainer.cpp builds the record), summary.json (trainer.h's Summary).
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace keel {

class EventWriter;

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

/// One step's scalars, made once by the loop. Each field names its metrics.jsonl key and its
/// TensorBoard tag; either may be empty where that output does not show the field (metrics.jsonl
/// has the epoch and each rank's compute time, TensorBoard the skipped-step count and the ranks'
/// spread).
struct StepRecord {
  struct Field {
    std::string key, tag;
    nlohmann::json value;  // a number (TensorBoard takes it as a double), or anything for metrics.jsonl alone
  };
  int64_t step = 0;
  std::vector<Field> fields;

  StepRecord& add(std::string key, std::string tag, nlohmann::json value);
  /// The field with metrics.jsonl key `key` as a double; NaN when absent or not a number.
  double number(const std::string& key) const;
};

/// The run's reports (see the file comment). Rank 0 writes the files and the lines; every rank
/// keeps its step times (the summary's median).
class RunMetrics {
 public:
  struct Options {
    std::string dir;                      // run.dir
    bool main = false;                    // rank 0: writes metrics.jsonl, TensorBoard, the log lines
    bool tensorboard = false;             // run.tensorboard
    bool progress = false;                // run.progress on a terminal: a live line instead of log lines
    int64_t log_interval = 1;             // train.log_interval
    int64_t world = 1;                    // the straggler watch's ranks
    std::optional<int64_t> resumed_from;  // a resumed run rewrites what followed this step
    int64_t steps_left = 0;               // planned steps of this run (reserves the step times)
  };
  RunMetrics();
  ~RunMetrics();
  RunMetrics(RunMetrics&&) noexcept;
  RunMetrics& operator=(RunMetrics&&) noexcept;

  /// Opens metrics.jsonl (and the event file) on rank 0. Throws std::runtime_error naming the file.
  void open(const Options& o);
  /// MFU = flops_per_sample x global_batch per recent median step time over peak_tflops x world;
  /// flops_per_sample = 0: no MFU.
  void set_mfu(double flops_per_sample, double peak_tflops, int64_t global_batch, int64_t world);
  /// A step's wall time (every rank, every step).
  void step_time(double ms);
  /// Rank 0: the ranks' forward+backward times of a step, for the straggler watch.
  void observe_ranks(const std::vector<double>& rank_compute_ms);
  /// The step's record: adds eta_s and mfu (from the recent step times), then writes metrics.jsonl,
  /// TensorBoard, the progress line and, every log_interval steps and at `total`, the log line.
  void record(StepRecord& rec, int64_t total);
  /// The end: the progress line's newline, TensorBoard flushed.
  void finish();

  int64_t steps_timed() const { return steps_timed_; }
  int64_t lines_lost() const { return jsonl_.lines_lost(); }
  /// The median step time over the run, the first 5 steps (warm-up) excluded.
  double median_step_ms() const;
  double eta_s() const { return eta_s_; }
  std::optional<double> mfu() const { return mfu_; }
  double peak_tflops() const { return peak_tflops_; }

 private:
  double recent_median_ms() const;
  void log_line(const StepRecord& rec, int64_t total) const;

  Options o_;
  JsonlWriter jsonl_;
  std::unique_ptr<EventWriter> tb_;
  bool show_progress_ = false;
  // Every step time up to kStepTimesKept, then the most recent ones (a ring), so that memory
  // stays bounded however many steps are planned.
  static constexpr size_t kStepTimesKept = size_t{1} << 20;
  std::vector<double> step_times_;
  int64_t steps_timed_ = 0;
  double ema_ms_ = 0;
  double flops_per_sample_ = 0, peak_tflops_ = 0;
  int64_t global_batch_ = 0, world_ = 1;
  double eta_s_ = 0;
  std::optional<double> mfu_;  // at the last record
  StragglerWatch stragglers_;
};

}  // namespace keel
