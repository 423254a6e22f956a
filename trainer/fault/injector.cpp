#include "trainer/fault/injector.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <csignal>
#include <limits>
#include <stdexcept>
#include <thread>

#include "common/log.h"

namespace keel {
namespace {

// graph_break: the model's forward gains a branch on a tensor's value, which a trace cannot
// capture (the compile stage must refuse it or fall back to eager).
class GraphBreakModel : public models::Model {
 public:
  explicit GraphBreakModel(std::shared_ptr<models::Model> m) : m_(std::move(m)) {}
  std::string name() const override { return m_->name(); }
  models::InputSpec input_spec() const override { return m_->input_spec(); }
  torch::Tensor forward(const torch::Tensor& x) override {
    auto y = m_->forward(x);
    if (y.sum().item<double>() > 0) return y * 1.0;  // data-dependent control flow
    return y;
  }
  models::NamedTensors named_parameters() const override { return m_->named_parameters(); }
  models::NamedTensors named_buffers() const override { return m_->named_buffers(); }
  void to(const torch::Device& d) override { m_->to(d); }
  void train(bool on) override { m_->train(on); }
  // The wrapped model's blocks stay its own (issue 64: hidden, activation checkpointing recomputed
  // none of them and compile.granularity = "blocks" said gpt has no blocks). The break lies outside
  // them, in this forward.
  double train_flops_per_sample() const override { return m_->train_flops_per_sample(); }
  std::vector<std::string> block_prefixes() const override { return m_->block_prefixes(); }
  void set_block_hooks(models::BlockHooks* hooks) override { m_->set_block_hooks(hooks); }
  models::BlockStructure* block_structure() override { return m_->block_structure(); }
  void set_block_runner(models::BlockStructure::BlockRun run) override { m_->set_block_runner(std::move(run)); }
  bool set_block_compiled(models::BlockStructure::BlockCompiled run) override {
    return m_->set_block_compiled(std::move(run));
  }
  bool set_region_compiled(models::BlockStructure::RegionCompiled run) override {
    return m_->set_region_compiled(std::move(run));
  }
  bool set_root_compiled(models::BlockStructure::RootCompiled run) override {
    return m_->set_root_compiled(std::move(run));
  }

 private:
  std::shared_ptr<models::Model> m_;
};

// Flips one bit of the byte two thirds into `path`, in place (silent corruption, found by the
// checksum on the next load). In place: a temporary file beside a committed step would race
// with rank 0's cleanup of stray files. False when the file is empty or cannot be changed.
bool flip_byte_in_place(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (fd < 0) return false;
  struct stat st {};
  bool ok = ::fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && st.st_size > 0;
  const off_t at = ok ? st.st_size - st.st_size / 3 : 0;
  char c = 0;
  ok = ok && ::pread(fd, &c, 1, at) == 1;
  c ^= 0x20;
  ok = ok && ::pwrite(fd, &c, 1, at) == 1 && ::fsync(fd) == 0;
  ::close(fd);
  return ok;
}

// signal: what a launcher or an operator does to the process (kill(2), not raise(3): the signal
// is the process's, taken by whichever thread).
void send_signal(const FaultEntry& e, FaultPhase phase, int64_t step, int64_t rank) {
  logging::warn("fault injection: signal {} ({}){} in phase {} at step {} on rank {}", e.sig,
                e.sig == SIGINT    ? "SIGINT"
                : e.sig == SIGUSR1 ? "SIGUSR1"
                                   : "SIGTERM",
                e.twice ? " twice" : "", choice_name(kFaultPhases, phase), step, rank);
  ::kill(::getpid(), static_cast<int>(e.sig));
  if (e.twice) ::kill(::getpid(), static_cast<int>(e.sig));
}

}  // namespace

void FaultInjector::signal(FaultPhase phase, int64_t step) const {
  if (plan_.empty()) return;
  if (const FaultEntry* e = plan_.signal(phase, step, rank_, restart_count_)) send_signal(*e, phase, step, rank_);
}

FaultInjector::FaultInjector(const FaultConfig& cfg, const dist::World& world, torch::Device device,
                             std::chrono::milliseconds collective_timeout)
    : plan_(cfg.inject, world.size),
      rank_(world.rank),
      world_size_(world.size),
      restart_count_(world.restart_count),
      device_(device),
      collective_timeout_(collective_timeout) {}

std::shared_ptr<models::Model> FaultInjector::wrap_model(std::shared_ptr<models::Model> model) const {
  if (!plan_.fires(FaultType::GraphBreak, 1, rank_, restart_count_)) return model;
  logging::warn("fault injection: graph_break: rank {}'s model branches on a tensor value", rank_);
  return std::make_shared<GraphBreakModel>(std::move(model));
}

void FaultInjector::after_backward(int64_t step, const std::vector<torch::Tensor>& params) const {
  if (!plan_.fires(FaultType::NonfiniteGrad, step, rank_, restart_count_)) return;
  logging::warn("fault injection: nonfinite_grad at step {} on rank {}", step, rank_);
  for (const auto& p : params)
    if (p.grad().defined()) {
      p.grad().view(-1)[0] = std::numeric_limits<float>::infinity();
      return;
    }
}

void FaultInjector::before_consensus(int64_t s, dist::Collectives& coll) const {
  if (plan_.empty()) return;
  const int64_t r = rank_, rc = restart_count_;
  if (const FaultEntry* e = plan_.active(FaultType::Straggler, s, r, rc)) {
    if (s == e->step)
      logging::warn("fault injection: straggler: rank {} sleeps {} ms per step from step {}", r, e->ms, s);
    std::this_thread::sleep_for(std::chrono::milliseconds(e->ms));
  }
  signal(FaultPhase::Step, s);
  if (plan_.fires(FaultType::Crash, s, r, rc)) crash(s);
  if (plan_.fires(FaultType::Oom, s, r, rc)) {
    // 1 PiB: more than a 47-bit address space holds, so the allocation fails even where the
    // kernel overcommits memory (nothing is ever touched).
    logging::warn("fault injection: oom at step {} on rank {}: allocating 1 PiB", s, r);
    auto huge = torch::empty({int64_t{1} << 48}, torch::TensorOptions().dtype(torch::kFloat).device(device_));
  }
  if (plan_.fires(FaultType::CollectiveHang, s, r, rc)) hang(s, coll);
  if (const FaultEntry* e = plan_.any_rank(FaultType::ShapeMismatch, s, rc); e && !shape_mismatch_on_sends_) {
    // Every rank issues the same collective; the faulty rank's tensor has another shape.
    auto probe = torch::zeros({e->rank == r ? 5 : 4}, torch::TensorOptions().device(device_));
    if (e->rank == r) logging::warn("fault injection: shape_mismatch at step {}: rank {} all-reduces shape [5]", s, r);
    coll.all_reduce(probe, dist::ReduceOp::Sum, "fault probe (shape_mismatch)");
  }
}

void FaultInjector::crash(int64_t s) const {
  logging::error("fault injection: crash (SIGKILL) at step {} on rank {}", s, rank_);
  logging::flush();
  std::raise(SIGKILL);
  std::abort();  // (not reached)
}

void FaultInjector::hang(int64_t s, dist::Collectives& coll) const {
  // This rank stops taking part in collectives and waits until a peer reports its failed
  // collective through the store (or twice the collective timeout passes).
  logging::warn("fault injection: collective_hang at step {}: rank {} stops taking part in collectives ({})", s, rank_,
                dist::current_phase().describe());
  const auto deadline = std::chrono::steady_clock::now() + 2 * collective_timeout_ + std::chrono::seconds(10);
  std::string why;
  while (std::chrono::steady_clock::now() < deadline) {
    if (auto reported = coll.peer_failure()) {
      why = *reported;
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  throw std::runtime_error(
      "fault injection: collective_hang: rank " + std::to_string(rank_) + " stopped at step " + std::to_string(s) +
      (why.empty() ? std::string("; no peer reported") : "; its peers gave up: " + why.substr(0, 300)));
}

void FaultInjector::strike_at_phases(dist::Collectives& coll) {
  if (!plan_.strikes_at_phases()) return;
  hooked_ = true;
  dist::set_phase_hook([this, &coll](const dist::PhaseState& where) {
    const int64_t s = where.step;
    if (plan_.at_phase(FaultType::Crash, where.phase, s, rank_, restart_count_)) crash(s);
    if (const FaultEntry* e = plan_.at_phase(FaultType::Straggler, where.phase, s, rank_, restart_count_)) {
      if (s == e->step)
        logging::warn("fault injection: straggler: rank {} sleeps {} ms on entering {} from step {}", rank_, e->ms,
                      dist::phase_name(where.phase), s);
      std::this_thread::sleep_for(std::chrono::milliseconds(e->ms));
    }
    if (plan_.at_phase(FaultType::CollectiveHang, where.phase, s, rank_, restart_count_)) hang(s, coll);
  });
}

FaultInjector::~FaultInjector() {
  if (hooked_) dist::set_phase_hook(nullptr);
}

checkpoint::Hooks FaultInjector::checkpoint_hooks() const {
  checkpoint::Hooks h;
  bool write_failure = false, corruption = false, signal_at_save = false;
  for (const auto& e : plan_.entries()) {
    write_failure |= e.type == FaultType::CheckpointWriteFailure;
    corruption |= e.type == FaultType::CheckpointCorruption;
    signal_at_save |= e.type == FaultType::Signal && e.phase == FaultPhase::Save;
  }
  if (signal_at_save) {
    // Once per save, at this rank's first write of it (on the writer thread with checkpoint.async).
    auto sent = std::make_shared<std::atomic<int64_t>>(-1);
    h.before_write = [plan = plan_, rank = rank_, rc = restart_count_, sent](int64_t step, const std::string&,
                                                                             uint64_t) -> int {
      if (const FaultEntry* e = plan.signal(FaultPhase::Save, step, rank, rc); e && sent->exchange(step) != step)
        send_signal(*e, FaultPhase::Save, step, rank);
      return 0;
    };
  }
  if (write_failure) {
    // ENOSPC (or, with `crash`, SIGKILL) halfway through this rank's model shard of the
    // checkpoint of step `step`: its header makes it to disk, its data does not.
    auto warned = std::make_shared<std::atomic<int64_t>>(-1);
    h.before_write = [plan = plan_, rank = rank_, rc = restart_count_, warned, first = h.before_write](
                         int64_t step, const std::string& file, uint64_t offset) -> int {
      if (first) first(step, file, offset);
      if (offset < 64 || file.rfind("model-", 0) != 0) return 0;
      const FaultEntry* e = plan.find(FaultType::CheckpointWriteFailure, step, rank, rc);
      if (!e) return 0;
      if (warned->exchange(step) != step)
        logging::warn("fault injection: checkpoint_write_failure ({}) at step {} on rank {}",
                      e->crash ? "SIGKILL" : "ENOSPC", step, rank);
      if (e->crash) {
        logging::flush();
        std::raise(SIGKILL);  // a crash in the middle of a save
      }
      return ENOSPC;
    };
  }
  if (corruption) {
    h.after_commit = [plan = plan_, rank = rank_, world = world_size_, rc = restart_count_](int64_t step,
                                                                                            const std::string& dir) {
      if (!plan.fires(FaultType::CheckpointCorruption, step, rank, rc)) return;
      const std::string path = dir + "/" + checkpoint::component_file("model", rank, world);
      if (flip_byte_in_place(path)) logging::warn("fault injection: checkpoint_corruption: flipped a byte of {}", path);
    };
  }
  return h;
}

}  // namespace keel
