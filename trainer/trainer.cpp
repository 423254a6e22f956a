// The training loop: the order of a step's parts, and nothing else. The run is built by
// trainer/run.h (place -> compile -> distribute, data, optimizer), its checkpoints by
// trainer/checkpoints.h and its outputs by trainer/report.h; a step's forward, backward, update
// and evaluation are trainer/step/step.h's. Each part of a step is a named member below, in the
// order a step runs them.
#include "keel/trainer/trainer.h"

#include <ATen/record_function.h>
#ifdef KEEL_WITH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#endif

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <memory>
#include <optional>
#include <string>

#include "common/clock.h"
#include "common/log.h"
#include "common/stop.h"
#include "keel/common/error.h"
#include "keel/dist/collectives.h"
#include "trainer/checkpoints.h"
#include "trainer/report.h"
#include "trainer/run.h"
#include "trainer/setup.h"
#include "trainer/signals.h"
#include "trainer/step/step.h"

namespace keel {
namespace {

// Bits of the per-step consensus (dist::Collectives::step_sync).
constexpr uint32_t kFlagStop = 1u << 0;               // this rank received SIGINT/SIGTERM
constexpr uint32_t kFlagCheckpointWritten = 1u << 1;  // this rank's async checkpoint write is done
constexpr uint32_t kFlagBadInput = 1u << 2;           // this rank's batches held a bad target (Step::bad_input)

// run.sync_debug: CUDA's sync debug mode while a steady step runs (the previous mode after).
class SyncDebugScope {
 public:
  /// `pause`: off for the scope (a legitimate wait inside a checked step), whatever `mode` says.
  explicit SyncDebugScope(SyncDebug mode, bool pause = false) {
#ifdef KEEL_WITH_CUDA
    auto& w = c10::cuda::warning_state();
    if (pause ? w.get_sync_debug_mode() == c10::cuda::SyncDebugMode::L_DISABLED : mode == SyncDebug::Off) return;
    prev_ = static_cast<int>(w.get_sync_debug_mode());
    auto next = mode == SyncDebug::Warn ? c10::cuda::SyncDebugMode::L_WARN : c10::cuda::SyncDebugMode::L_ERROR;
    if (pause) next = c10::cuda::SyncDebugMode::L_DISABLED;
    w.set_sync_debug_mode(next);
#endif
  }
  ~SyncDebugScope() {
#ifdef KEEL_WITH_CUDA
    if (prev_ >= 0) c10::cuda::warning_state().set_sync_debug_mode(static_cast<c10::cuda::SyncDebugMode>(prev_));
#endif
  }
  SyncDebugScope(const SyncDebugScope&) = delete;
  SyncDebugScope& operator=(const SyncDebugScope&) = delete;

 private:
  int prev_ = -1;
};

// dist.flight_recorder's recorder for this rank (null when 0), writing under <run.dir>/flight.
std::unique_ptr<dist::FlightRecorder> make_flight_recorder(const Config& cfg, const dist::World& world) {
  if (cfg.dist.flight_recorder <= 0) return nullptr;
  dist::FlightOptions o;
  o.capacity = cfg.dist.flight_recorder;
  o.dir = cfg.run.dir + "/flight";
  o.rank = world.rank;
  o.world_size = world.size;
  o.restart = world.restart_count;
  char host[256] = {0};
  ::gethostname(host, sizeof host - 1);
  o.host = host;
  o.stall = std::chrono::seconds(cfg.dist.timeout_s);
  return std::make_unique<dist::FlightRecorder>(std::move(o));
}

std::string message_of(const std::exception& e) {
  const auto* c10 = dynamic_cast<const c10::Error*>(&e);
  const std::string what = c10 ? c10->what_without_backtrace() : e.what();
  return what.substr(0, 4096);
}

}  // namespace

class Trainer::Loop {
 public:
  Loop(const Config& cfg, const dist::World& world, const Callbacks& cb, dist::FlightRecorder* flight)
      : run_(cfg, world, cb, flight),
        ckpts_(run_.job, run_.net, run_.data, run_.update, run_.progress),
        report_(run_.job, run_.net, run_.data, run_.update, run_.progress, run_.graphs, ckpts_.resumed_from()),
        step_(make_step(run_)) {}
  Summary run();

 private:
  // One step, in order: begin (data, forward, backward, the verdict, the consensus exchanged),
  // update, then finish (the consensus read, logs, evaluation, checkpoint), which with
  // dist.consensus = late comes after the next step's begin.
  InFlight begin_step(int64_t step);
  void resolve_step(InFlight& f);
  void finish_step(InFlight& f, std::optional<Clock::time_point> next_t0);
  bool needs_host(int64_t step) const;
  std::optional<EvalResult> maybe_evaluate(int64_t step);
  // The end.
  void finish();
  std::runtime_error out_of_memory(const std::string& what, bool committed_step) const;

  Run run_;                      // the set-up: config, mesh, model, data, optimizer
  RunCheckpoints ckpts_;         // checkpoint.dir: saves, commits, the resume
  RunReport report_;             // metrics, logs, profiler, summary
  std::unique_ptr<Step> step_;   // eager or compiled: forward, backward, update, evaluation
  int stop_signal_ = 0;          // the signal that stopped the run (every rank the same, after finish())
  bool stopped_ = false;         // the step consensus said some rank was asked to stop
  bool stop_requested_ = false;  // ... read in a step's finish: the loop ends after the step in hand
  int64_t current_step_ = 0;     // the step begun last (with a late consensus, one ahead of steps_done)
};

Summary Trainer::Loop::run() {
  const Progress& progress = run_.progress;
  report_.loop_begins();
  try {
    std::optional<InFlight> late;  // dist.consensus = late: the step the host has not read yet
    for (int64_t step = progress.steps_done + 1; step <= progress.total_steps; ++step) {
      // run.sync_debug: from step 6 (warm-up done: the allocators' pools, the scale moved to
      // the device), except the steps the host must see (evaluation, checkpoints, the last).
      std::optional<SyncDebugScope> sync_debug;
      if (run_.job.device.is_cuda() && step - report_.steps_at_loop() > 5 && !needs_host(step))
        sync_debug.emplace(run_.job.cfg.run.sync_debug);
      InFlight cur = begin_step(step);
      if (late) {  // read one step late, before this step's update
        finish_step(*late, cur.t0);
        late.reset();
      }
      step_->update(cur);
      if (StepProfiler* p = report_.profiler()) p->after_step(cur.r.step);
      if (run_.update.late && !stop_requested_ && !needs_host(step)) {
        late = std::move(cur);
        continue;
      }
      finish_step(cur, std::nullopt);
      if (stop_requested_) {  // every rank stops after the same step
        stopped_ = true;      // the signal's number, which may be another rank's, is agreed in finish()
        break;
      }
    }
  } catch (const c10::Error& e) {
    const std::string what = e.what_without_backtrace();
    if (!is_out_of_memory(what)) throw;
    throw out_of_memory(what.substr(0, what.find('\n')), true);
  } catch (const std::bad_alloc&) {
    throw out_of_memory("std::bad_alloc", false);
  }
  finish();
  // summary.json while this job still holds run.dir's lock.
  Summary s = report_.summary(ckpts_, stop_signal_);
  if (run_.job.world.is_main()) write_atomic(run_.job.cfg.run.dir + "/summary.json", s.to_json().dump(2) + "\n");
  return s;
}

// A step's start: data, forward, backward (gradients all-reduced on the last micro-batch),
// unscale and this rank's verdict (Step::launch), then the cross-rank consensus exchanged (one
// all-gather) and, with dist.consensus = step, read at once.
InFlight Trainer::Loop::begin_step(int64_t step) {
  InFlight f;
  f.t0 = Clock::now();
  StepResult& r = f.r;
  r.step = current_step_ = step;
  if (StepProfiler* p = report_.profiler()) p->before_step(r.step);
  run_.job.coll->set_step(r.step);
  run_.job.mesh.set_step(r.step);
  const Launched launched = step_->launch(r);
  run_.job.faults->before_consensus(r.step, *run_.job.coll);
  const double compute_ms = ms_since(f.t0);
  uint32_t flags = 0;
  if (g_stop_signal.load()) flags |= kFlagStop;
  if (ckpts_.written_uncommitted()) flags |= kFlagCheckpointWritten;
  if (!step_->bad_input().empty()) flags |= kFlagBadInput;
  // One all-gather per step: every rank is at this step with the same gradient plan, the
  // mean loss, and whether any rank saw inf/NaN (then no rank steps).
  {
    RECORD_USER_SCOPE("keel::consensus");
    dist::PhaseScope phase(dist::Phase::Consensus);
    const uint64_t plan = step_->plan();
    if (run_.update.late) {
      f.record = run_.job.coll->exchange_step(r.step, plan, launched.loss, launched.nonfinite, compute_ms, flags,
                                              launched.share);
    } else {
      r.local_loss = launched.loss_now;
      r.consensus = run_.job.coll->step_sync(r.step, plan, r.local_loss, launched.nonfinite_now, compute_ms, flags,
                                             launched.share);
      resolve_step(f);
    }
  }
  return f;
}

// The consensus read: the same loss, verdict and flags on every rank, or CollectiveMismatch.
void Trainer::Loop::resolve_step(InFlight& f) {
  StepResult& r = f.r;
  if (f.record) r.consensus = run_.job.coll->resolve(f.record, &r.local_loss);  // else: step_sync's already
  // An async checkpoint is committed once every rank has written its share.
  if (ckpts_.pending() && (r.consensus.all_flags & kFlagCheckpointWritten)) {
    SyncDebugScope pause(SyncDebug::Off, /*pause=*/true);  // the commit's agreement waits, rarely
    ckpts_.commit();
  }
  // A bad target on some rank: every rank fails with the first such rank's message, exit 2.
  if (r.consensus.any_flags & kFlagBadInput)
    throw InputError(dist::first_error(*run_.job.coll, step_->bad_input(), "training targets").message);
  r.loss = r.consensus.mean_loss;
  r.skipped = r.consensus.any_nonfinite;
  r.stop = (r.consensus.any_flags & kFlagStop) != 0;
  if (run_.job.world.is_main()) report_.metrics().observe_ranks(r.consensus.rank_compute_ms);
  if (r.skipped && !run_.update.scaler && !run_.job.cfg.train.skip_nonfinite)
    throw std::runtime_error("non-finite training loss or gradients at step " + std::to_string(r.step) +
                             " (local loss " + std::to_string(r.local_loss) +
                             "); no rank applied the update; lower train.lr, set train.grad_clip, or set "
                             "train.skip_nonfinite = true to skip such steps");
  f.resolved = true;
}

// A step's end: the consensus read (when late, the host first reads it here), the time, the
// counters, then evaluation, the log line and the checkpoint the step is due. `next_t0`: when
// the next step began (late: a step's time is from its start to the next one's).
void Trainer::Loop::finish_step(InFlight& f, std::optional<Clock::time_point> next_t0) {
  if (!f.resolved) resolve_step(f);
  StepResult& r = f.r;
  if (f.extras.valid()) {  // late: what the device left for the host
    const double* v = f.extras.get().data_ptr<double>();
    r.grad_norm = v[0];
    r.loss_scale_before = v[1];
    r.loss_scale = v[2];
  }
  Progress& progress = run_.progress;
  if (r.skipped) {
    ++progress.skipped_steps;
    logging::warn(
        "step {}: inf/NaN on some rank; every rank skips this update{}", r.step,
        run_.update.scaler ? fmt::format(" (loss scale {} -> {})", r.loss_scale_before, r.loss_scale) : std::string());
  }
  r.step_ms = next_t0 ? std::chrono::duration<double, std::milli>(*next_t0 - f.t0).count() : ms_since(f.t0);
  progress.steps_done = r.step;
  progress.last_loss = r.loss;
  report_.metrics().step_time(r.step_ms);
  const std::optional<EvalResult> eval = maybe_evaluate(r.step);
  report_.log_step(r, eval);
  if (ckpts_.due(r.step)) ckpts_.save(r.step);
  if (r.stop) stop_requested_ = true;
}

// Steps whose end the host must see before the next begins: evaluation and checkpoint steps, the
// last, and the loop's first (a rank that disagrees on the gradient plan, e.g. another number of
// micro-batches, is named before a second step's buckets are all-reduced).
bool Trainer::Loop::needs_host(int64_t step) const {
  const int64_t e = run_.job.cfg.train.eval_interval;
  return step == run_.progress.total_steps || step == report_.steps_at_loop() + 1 || (e > 0 && step % e == 0) ||
         ckpts_.due(step);
}

std::optional<EvalResult> Trainer::Loop::maybe_evaluate(int64_t step) {
  const int64_t every = run_.job.cfg.train.eval_interval;
  if (every <= 0 || (step % every != 0 && step != run_.progress.total_steps)) return std::nullopt;
  return report_.evaluated(step_->evaluate(step), /*log=*/true);
}

// Out of memory (injected or real): say where, how much, and what survives.
std::runtime_error Trainer::Loop::out_of_memory(const std::string& what, bool committed_step) const {
  const std::string where = "out of memory at step " +
                            std::to_string(std::max(current_step_, run_.progress.steps_done + 1)) + " on rank " +
                            std::to_string(run_.job.world.rank);
  if (!committed_step) return std::runtime_error(where + " (" + what + "); lower train.batch_size");
  const int64_t committed = ckpts_.last_committed();
  return std::runtime_error(where + ": " + what + "; the last committed checkpoint is " +
                            (committed >= 0 ? "step " + std::to_string(committed) + " (intact)" : std::string("none")) +
                            "; lower train.batch_size or use train.grad_accum");
}

// After the loop: the evaluation of a run resumed at its end, the final checkpoint (also after
// a stop signal) and its commit, and leaving together.
void Trainer::Loop::finish() {
  dist::PhaseScope phase(dist::Phase::Finish);
  report_.metrics().finish();
  const Progress& progress = run_.progress;
  const int64_t done = progress.steps_done;
  if (report_.metrics().steps_timed() == 0 && done >= progress.total_steps) {
    logging::info("checkpoint step {} is the end of this run ({} steps): nothing to train", done, progress.total_steps);
    if (run_.job.cfg.train.eval_interval > 0) report_.evaluated(step_->evaluate(done), /*log=*/false);
  }
  ckpts_.finish(done);
  if (StepProfiler* p = report_.profiler()) p->finish();
  run_.net.dmodel->sync_buffers();  // every rank ends with rank 0's model (under tp: its dp peers' shard)
  // dist.zero = 3: the whole model, gathered for on_end only (on every rank when one rank has it:
  // the gathers are collective; stage 2's parameters are whole).
  step_->hold_whole_model(bool(run_.job.cb.on_end));
  if (run_.job.cb.on_end) run_.job.cb.on_end(*run_.net.model);
  // Every rank leaves with the same verdict: the signal a rank received (the one that stopped
  // the loop, or one that came after the last step's consensus: evaluation, the final save,
  // on_end) stops every rank with 128+N. This all-reduce is also the barrier before leaving: a
  // rank that tears down its connections while a peer still uses them makes the peer's Gloo
  // threads fail.
  // The flight recorder stops asking the store about peers: rank 0, which serves it, may leave
  // right after this last agreement.
  if (run_.job.flight) run_.job.flight->stop_polling();
  auto signo = torch::tensor({static_cast<int64_t>(g_stop_signal.load())}, torch::kLong);
  run_.job.coll->all_reduce(signo, dist::ReduceOp::Max, "end of training (stop signal)");
  stop_signal_ = static_cast<int>(signo.item<int64_t>());
  if (stopped_ && !stop_signal_) stop_signal_ = SIGTERM;  // request_stop(0): still a stop
  if (stop_signal_) logging::warn("stopped by signal {} after step {} of {}", stop_signal_, done, progress.total_steps);
}

Trainer::Trainer(Config cfg, dist::World world, Callbacks callbacks)
    : cfg_(std::move(cfg)), world_(std::move(world)), callbacks_(std::move(callbacks)) {}

Trainer::~Trainer() = default;

Summary Trainer::run() {
  StopSignals signals;  // until summary.json is written
  // dist.flight_recorder: the record outlives the run's parts, so that a failure that ends the
  // run is dumped after its error unwound them (the phase it was thrown in stays: dist/phase.h).
  const std::unique_ptr<dist::FlightRecorder> flight = make_flight_recorder(cfg_, world_);
  Summary s;
  try {
    s = Loop(cfg_, world_, callbacks_, flight.get()).run();
  } catch (const InputError&) {
    throw;  // the user's input: said as it is, before or without a collective that went wrong
  } catch (const std::exception& e) {
    if (flight) flight->dump("the run failed", message_of(e));
    throw;
  }
  // A signal after the job's last agreement (while summary.json was written): the checkpoint is
  // committed and the summary written; this rank still exits 128+N.
  if (!s.stop_signal && g_stop_signal.load()) s.stop_signal = g_stop_signal.load();
  logging::info("done: {} steps, median {:.2f} ms/step, final loss {:.4f}{}", s.steps, s.median_step_ms, s.final_loss,
                s.test_accuracy ? fmt::format(", test accuracy {:.4f}", *s.test_accuracy) : std::string());
  return s;
}

}  // namespace keel
