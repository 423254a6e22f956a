// trainer/tensorboard.h: TensorBoard event files (run.tensorboard), written by rank 0 under
// <run.dir>/tb/.
//
// Owns: the event-file format. A file is a sequence of records, each [uint64 length][masked
// CRC32C of those 8 bytes][an Event message][masked CRC32C of it] (little-endian), the first
// holding the file version "brain.Event:2"; the messages are wire-compatible with TensorFlow's
// (trainer/tensorboard_event.proto), encoded by protobuf, the CRC32C by Boost.CRC.
// Each record is written whole or not at all: one write at the file's known end, and a write
// cut short (a full disk) is cut off again, so that no torn record stays in the middle of the
// file (TensorBoard's reader stops at one and reads nothing after it). Lost records are
// counted and warned about once; once space returns, later records are written as usual.
// Does not own: which values are logged (the trainer's log_step) or when files are flushed.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

namespace keel {

class EventWriter {
 public:
  /// Creates `dir` and a new event file in it, events.out.tfevents.<unix time>.<host>, its time
  /// after every event file already there (TensorBoard reads the files of a directory in name
  /// order). Throws std::runtime_error when the directory or the file cannot be made.
  explicit EventWriter(const std::string& dir);
  ~EventWriter();
  EventWriter(const EventWriter&) = delete;
  EventWriter& operator=(const EventWriter&) = delete;

  /// One event holding scalars (tag, value) at `step`.
  void scalars(int64_t step, const std::vector<std::pair<std::string, double>>& values);
  /// A resumed run restarts at `step`: TensorBoard drops the events of steps >= `step` that
  /// an earlier run wrote (as keel truncates metrics.jsonl).
  void resumed_at(int64_t step);
  /// Every record reaches the OS as it is written (no user-space buffer); kept for the
  /// trainer's calls.
  void flush();
  const std::string& path() const { return path_; }
  /// Records that could not be written (a full disk): counted, warned about once, not fatal.
  /// Nothing of a lost record stays in the file.
  int64_t records_lost() const { return lost_; }

 private:
  void write_record(const std::string& bytes);
  std::string path_;
  int fd_ = -1;
  int64_t end_ = 0;    // bytes of whole records in the file: where the next record goes
  bool torn_ = false;  // bytes of a cut record may lie past end_ (the cut-off failed): retried
  int64_t lost_ = 0;
};

/// TFRecord's masked CRC32C: ((crc >> 15) | (crc << 17)) + 0xa282ead8.
uint32_t masked_crc32c(const void* data, size_t n);

}  // namespace keel
