#include "trainer/metrics.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>

#include "common/atomic_file.h"
#include "common/log.h"
#include "keel/trainer/config/config.h"
#include "trainer/tensorboard.h"

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

StepRecord& StepRecord::add(std::string key, std::string tag, nlohmann::json value) {
  fields.push_back({std::move(key), std::move(tag), std::move(value)});
  return *this;
}

double StepRecord::number(const std::string& key) const {
  for (const auto& f : fields)
    if (f.key == key && f.value.is_number()) return f.value.get<double>();
  return std::nan("");
}

RunMetrics::RunMetrics() = default;
RunMetrics::~RunMetrics() = default;
RunMetrics::RunMetrics(RunMetrics&&) noexcept = default;
RunMetrics& RunMetrics::operator=(RunMetrics&&) noexcept = default;

void RunMetrics::open(const Options& o) {
  o_ = o;
  if (o.main) {
    const std::string path = o.dir + "/metrics.jsonl";
    if (o.resumed_from)
      truncate_metrics(path, *o.resumed_from);  // a resumed run rewrites what followed
    else
      std::remove(path.c_str());  // a fresh run starts a fresh file
    jsonl_ = JsonlWriter(path);
    if (o.tensorboard) {
      try {
        tb_ = std::make_unique<EventWriter>(o.dir + "/tb");
        if (o.resumed_from) tb_->resumed_at(*o.resumed_from + 1);  // TensorBoard drops what follows, too
      } catch (const std::runtime_error& e) {
        logging::warn("{}: training goes on without TensorBoard events", e.what());
      }
    }
  }
  show_progress_ = o.progress && o.main;
  stragglers_ = StragglerWatch(o.world);
  step_times_.reserve(static_cast<size_t>(std::clamp<int64_t>(o.steps_left, 0, static_cast<int64_t>(kStepTimesKept))));
}

void RunMetrics::set_mfu(double flops_per_sample, double peak_tflops, int64_t global_batch, int64_t world) {
  flops_per_sample_ = flops_per_sample;
  peak_tflops_ = peak_tflops;
  global_batch_ = global_batch;
  world_ = world;
}

void RunMetrics::step_time(double ms) {
  if (step_times_.size() < kStepTimesKept)
    step_times_.push_back(ms);
  else
    step_times_[static_cast<size_t>(steps_timed_) % kStepTimesKept] = ms;
  ema_ms_ = steps_timed_ == 0 ? ms : 0.9 * ema_ms_ + 0.1 * ms;
  ++steps_timed_;
}

void RunMetrics::observe_ranks(const std::vector<double>& rank_compute_ms) { stragglers_.observe(rank_compute_ms); }

// The median of the last 100 step times: what ETA and MFU use (robust to one slow step).
double RunMetrics::recent_median_ms() const {
  const size_t n = std::min<size_t>(step_times_.size(), 100);
  std::vector<double> recent;
  recent.reserve(n);
  const size_t end = static_cast<size_t>(steps_timed_);  // the next slot of the ring
  for (size_t k = 1; k <= n; ++k) recent.push_back(step_times_[(end - k) % step_times_.size()]);
  return median(recent);
}

double RunMetrics::median_step_ms() const {
  // The first 5 steps are warm-up (allocator, caches, lazy init); after the ring wrapped they
  // are overwritten already.
  const size_t warm = step_times_.size() > 5 && steps_timed_ <= static_cast<int64_t>(kStepTimesKept) ? 5 : 0;
  return median(std::vector<double>(step_times_.begin() + static_cast<std::ptrdiff_t>(warm), step_times_.end()));
}

void RunMetrics::record(StepRecord& rec, int64_t total) {
  const double typical_ms = recent_median_ms();
  eta_s_ = static_cast<double>(total - rec.step) * typical_ms / 1000.0;
  rec.add("eta_s", "", eta_s_);
  if (peak_tflops_ > 0 && typical_ms > 0) {
    // Achieved FLOP/s of the job over what its ranks' devices can do.
    mfu_ = flops_per_sample_ * static_cast<double>(global_batch_) / (typical_ms / 1000.0) /
           (peak_tflops_ * 1e12 * static_cast<double>(world_));
    rec.add("mfu", "train/mfu", *mfu_);
  }
  if (o_.main) {
    nlohmann::json line = nlohmann::json::object();
    line["step"] = rec.step;
    std::vector<std::pair<std::string, double>> tb;
    for (const auto& f : rec.fields) {
      if (!f.key.empty()) line[f.key] = f.value;
      if (!f.tag.empty() && f.value.is_number()) tb.emplace_back(f.tag, f.value.get<double>());
    }
    jsonl_.write(line);
    if (tb_) tb_->scalars(rec.step, tb);
  }
  if (show_progress_) {
    std::printf("\r\033[Kstep %ld/%ld | loss %.4f | %.1f it/s | ETA %s", long(rec.step), long(total),
                rec.number("loss"), 1000.0 / ema_ms_, format_duration((total - rec.step) * ema_ms_ / 1000.0).c_str());
    std::fflush(stdout);
  }
  if (rec.step % o_.log_interval == 0 || rec.step == total) {
    if (tb_) tb_->flush();
    log_line(rec, total);
  }
}

// Every rank (the logger shows rank 0's unless run.all_ranks_log).
void RunMetrics::log_line(const StepRecord& rec, int64_t total) const {
  logging::log(show_progress_ ? logging::Level::debug : logging::Level::info,
               "step {}/{} | loss {:.4f} | lr {:.3g} | {:.1f} ms/step | {:.0f} samples/s{} | ETA {}", rec.step, total,
               rec.number("loss"), rec.number("lr"), rec.number("step_ms"), rec.number("samples_per_s"),
               mfu_ ? fmt::format(" | MFU {:.1f}%", *mfu_ * 100.0) : std::string(), format_duration(eta_s_));
}

void RunMetrics::finish() {
  if (show_progress_) std::printf("\n");
  if (tb_) tb_->flush();
}

}  // namespace keel
