#include "trainer/report.h"

#include <unistd.h>
#ifdef KEEL_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

#include <algorithm>
#include <string>

#include "common/atomic_file.h"
#include "common/file.h"
#include "common/log.h"
#include "common/tensor_memory.h"
#include "keel/common/error.h"
#include "keel/version.h"
#include "trainer/config/limits.h"

namespace keel {

RunReport::RunReport(const JobParts& job, const ModelParts& net, const DataParts& data, const UpdateParts& update,
                     const Progress& progress, const GraphCounts& counts, const std::optional<int64_t>& resumed_from)
    : job_(job), net_(net), data_(data), update_(update), progress_(progress), counts_(counts) {
  if (job_.world.is_main()) {
    if (const std::string err = make_dirs(job_.cfg.run.dir); !err.empty()) throw InputError("run.dir: " + err);
    write_atomic(job_.cfg.run.dir + "/config.toml", dump_toml(job_.cfg));
  }
  RunMetrics::Options mo;
  mo.dir = job_.cfg.run.dir;
  mo.main = job_.world.is_main();
  mo.tensorboard = job_.cfg.run.tensorboard;
  mo.progress = job_.cfg.run.progress && ::isatty(STDOUT_FILENO);
  mo.log_interval = job_.cfg.train.log_interval;
  mo.world = job_.world.size;
  mo.resumed_from = resumed_from;
  mo.steps_left = progress_.total_steps - progress_.steps_done;
  metrics_.open(mo);
  if (const auto range = parse_profile_steps(job_.cfg.run.profile_steps)) {
    // Every rank writes its own trace into run.dir (which, across hosts, may be its host's own).
    if (const std::string err = make_dirs(job_.cfg.run.dir); !err.empty()) throw InputError("run.dir: " + err);
    profiler_ = std::make_unique<StepProfiler>(
        range, job_.cfg.run.dir + "/trace.rank" + std::to_string(job_.world.rank) + ".json", job_.device);
  }
  logging::info("keel {} | LibTorch {} | {} threads | device {}", KEEL_VERSION, TORCH_VERSION, job_.threads,
                job_.device.str());
  logging::info(
      "model {} ({} parameters) | data {} ({} train, {} test) | {} steps of global batch {} "
      "({} per rank x {} accum x {} data-parallel ranks{}), {} batches per epoch",
      net_.model->name(), net_.num_parameters, job_.cfg.data.name, data_.splits.train->size(),
      data_.splits.test ? data_.splits.test->size() : 0, progress_.total_steps, progress_.global_batch,
      job_.cfg.train.batch_size, job_.cfg.train.grad_accum, job_.mesh.dp(),
      job_.mesh.tp() > 1 ? fmt::format(", each {} tensor-parallel ranks", job_.mesh.tp()) : std::string(),
      data_.sampler->batches_per_epoch());
  if (const double flops = net_.model->train_flops_per_sample(); flops > 0) {
    const bool given = job_.cfg.run.peak_tflops > 0;
    const double peak = given ? job_.cfg.run.peak_tflops : measure_peak_tflops(job_.device, net_.amp);
    metrics_.set_mfu(flops, peak, progress_.global_batch, job_.world.size);
    logging::info("MFU against a peak of {:.3g} TFLOP/s per rank ({}); the model: {:.3g} GFLOP per sample", peak,
                  given ? "run.peak_tflops" : "measured: a square matrix multiply on " + job_.device.str(),
                  flops / 1e9);
  }
}

// ---------------------------------------------------------------------------------------------
// The loop.

namespace {
// The traffic of every Collectives this rank talks through: the world's and each mesh axis's
// that is not the world's (issue 64: under parallel.tp the tp and dp groups' collectives, and
// their validation probes, were missing from control_per_step).
dist::TrafficStats mesh_traffic(const JobParts& job) {
  dist::TrafficStats t = job.coll->traffic();
  std::vector<const dist::Collectives*> seen = {job.coll.get()};
  for (const dist::Axis a : {dist::Axis::Pp, dist::Axis::Dp, dist::Axis::Tp}) {
    const dist::Collectives* c = &job.mesh.on(a);
    if (std::find(seen.begin(), seen.end(), c) != seen.end()) continue;
    seen.push_back(c);
    const dist::TrafficStats more = c->traffic();
    t.collectives += more.collectives;
    t.probes += more.probes;
    t.bytes_sent += more.bytes_sent;
    t.bytes_received += more.bytes_received;
    t.wait_ms += more.wait_ms;
    t.replayed += more.replayed;
    t.gradient_buckets += more.gradient_buckets;
    t.gradient_bytes += more.gradient_bytes;
  }
  return t;
}
}  // namespace

void RunReport::loop_begins() {
  traffic_at_loop_ = mesh_traffic(job_);
  steps_at_loop_ = progress_.steps_done;
}

const EvalResult& RunReport::evaluated(EvalResult e, bool log) {
  last_eval_ = e;
  if (log)
    logging::info("eval step {}: test_loss {:.4f} test_accuracy {:.4f} ({} {})", e.step, e.loss, e.accuracy, e.count,
                  net_.spec.kind == models::InputKind::Tokens ? "tokens" : "samples");
  if (job_.cb.on_eval) job_.cb.on_eval(*last_eval_);
  return *last_eval_;
}

// The step's scalars, each once: its metrics.jsonl key and its TensorBoard tag.
StepRecord RunReport::step_record(const StepResult& r, const std::optional<EvalResult>& eval) const {
  StepRecord rec;
  rec.step = r.step;
  const double samples_per_s = progress_.global_batch * 1000.0 / r.step_ms;
  rec.add("loss", "train/loss", r.loss)
      .add("lr", "train/lr", r.lr)
      .add("step_ms", "train/step_ms", r.step_ms)
      .add("samples_per_s", "train/samples_per_s", samples_per_s)
      .add("epoch", "", r.epoch)
      .add("", "train/skipped_steps", progress_.skipped_steps);
  if (net_.spec.kind == models::InputKind::Tokens)
    rec.add("tokens_per_s", "train/tokens_per_s", samples_per_s * static_cast<double>(net_.spec.sample_shape.at(0)));
  if (update_.scaler) rec.add("loss_scale", "train/loss_scale", r.loss_scale);
  if (job_.cfg.train.grad_clip > 0) rec.add("grad_norm", "train/grad_norm", r.grad_norm);
  if (r.skipped) rec.add("skipped", "", true);
  const auto& c = r.consensus.rank_compute_ms;
  if (job_.world.size > 1) rec.add("rank_compute_ms", "", c);
  if (c.size() > 1) {  // how far apart the ranks' forward+backward times are: stragglers
    const auto [lo, hi] = std::minmax_element(c.begin(), c.end());
    rec.add("", "dist/rank_compute_spread_ms", *hi - *lo);
  }
  if (eval) rec.add("test_loss", "eval/loss", eval->loss).add("test_accuracy", "eval/accuracy", eval->accuracy);
  return rec;
}

// One record of the step feeds metrics.jsonl, TensorBoard, the progress and log lines
// (RunMetrics), and Callbacks::on_step.
void RunReport::log_step(const StepResult& r, const std::optional<EvalResult>& eval) {
  watch_gradients(r);
  StepRecord rec = step_record(r, eval);
  metrics_.record(rec, progress_.total_steps);
  if (job_.cb.on_step) job_.cb.on_step(StepInfo{r.step, r.loss, r.lr, r.step_ms, rec.number("samples_per_s")});
}

// A step that updated with lr > 0 while its global gradient norm (train.grad_clip's, or the one
// Step measures without it) was exactly 0 changed no parameter: said in the log, not silent
// (issue 64: ZeRO-2/3 at dp 1 once trained nothing and exited 0). The first few such steps.
void RunReport::watch_gradients(const StepResult& r) {
  if (r.skipped || !(r.lr > 0) || r.grad_norm != 0.0) return;
  constexpr int64_t kTold = 3;
  if (++zero_gradient_steps_ > kTold) return;
  logging::warn(
      "step {}: every gradient is exactly zero (global norm 0) at lr {}: this update changes no parameter and the "
      "model is not training. The loss does not reach the parameters (a loss that ignores the model's output, every "
      "target equal to train.ignore_index, a frozen model) or the gradients are lost before the optimizer{}",
      r.step, r.lr, zero_gradient_steps_ == kTold ? " (later such steps are not logged)" : "");
}

Summary RunReport::summary(const RunCheckpoints& ckpts, int stop_signal) const {
  Summary s;
  s.keel_version = KEEL_VERSION;
  s.torch_version = TORCH_VERSION;
  s.run_name = job_.cfg.run.name;
  s.model = net_.model->name();
  s.num_parameters = net_.num_parameters;
  s.data = job_.cfg.data.name;
  s.device = job_.device.str();
  s.world_size = job_.world.size;
  s.launcher = dist::launcher_name(job_.world.launcher);
  s.backend = job_.group->backend();
  s.restart_count = job_.world.restart_count;
  s.metrics_lines_lost = metrics_.lines_lost();
  s.threads_per_rank = job_.threads;
  s.batch_size = job_.cfg.train.batch_size;
  s.grad_accum = job_.cfg.train.grad_accum;
  s.global_batch = progress_.global_batch;
  s.steps = progress_.steps_done;
  s.planned_steps = progress_.total_steps;
  s.completed = s.steps == s.planned_steps && !stop_signal;
  if (stop_signal) s.stop_signal = stop_signal;
  s.median_step_ms = metrics_.median_step_ms();  // the first 5 steps (warm-up) excluded
  s.samples_per_s = s.global_batch * 1000.0 / s.median_step_ms;
  if (net_.spec.kind == models::InputKind::Tokens) s.tokens_per_s = s.samples_per_s * net_.spec.sample_shape.at(0);
  s.final_loss = progress_.last_loss;
  s.wall_s = ms_since(job_.t_start) / 1000.0;
  const CompileReport& cr = net_.dmodel->compile_report();
  s.compile_mode = cr.mode;
  s.compile_ms = cr.compile_ms;
  s.compile_cache = cr.cache;
  s.recompiles = cr.recompiles;
  if (job_.cfg.compile.cuda_graphs) {
    s.cuda_graph_captures = counts_.captures;
    s.cuda_graph_replays = counts_.replays;
  }
  s.amp_dtype = choice_name(kAmpDtypes, job_.cfg.amp.dtype);
  s.consensus = update_.late ? "late" : "step";
  if (update_.scaler) s.loss_scale = update_.scaler->scale_value();
  s.skipped_steps = progress_.skipped_steps;
  s.resumed_from_step = ckpts.resumed_from();
  if (ckpts.last_committed() >= 0) s.checkpoint_step = ckpts.last_committed();
  s.checkpoint_stall_ms = ckpts.stall_ms();
  const auto held = net_.dmodel->residency(*net_.model);
  s.zero = held.zero;
  s.parameter_bytes = held.parameter_bytes;
  s.gradient_bytes = held.gradient_bytes;
  s.optimizer_state_bytes = update_.optimizer_state->state_bytes();
#ifdef KEEL_WITH_CUDA
  if (job_.device.is_cuda()) {
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(job_.device.index());
    const auto aggregate = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
    s.peak_device_memory_mb = static_cast<double>(stats.allocated_bytes[aggregate].peak) / (1024.0 * 1024.0);
  }
#endif
  if (const auto counted = tensor_memory()) {
    s.cpu_tensor_peak_mb = static_cast<double>(counted->peak) / (1024.0 * 1024.0);
    s.cpu_tensor_end_mb = static_cast<double>(counted->live) / (1024.0 * 1024.0);
  }
  s.peak_rss_mb = peak_resident_mib();
  s.rendezvous_ms = job_.rendezvous_ms;
  s.eta_s = metrics_.eta_s();
  s.mfu = metrics_.mfu();
  if (metrics_.peak_tflops() > 0) s.peak_tflops = metrics_.peak_tflops();
  const dist::TrafficStats t = mesh_traffic(job_) - traffic_at_loop_;
  const int64_t n = progress_.steps_done - steps_at_loop_;
  if (n > 0)
    s.control_per_step = {static_cast<double>(t.collectives) / n,
                          static_cast<double>(t.probes) / n,
                          static_cast<double>(t.bytes_sent) / n,
                          static_cast<double>(t.bytes_received) / n,
                          t.wait_ms / n,
                          n};
  if (last_eval_) {
    s.test_accuracy = last_eval_->accuracy;
    s.test_loss = last_eval_->loss;
  }
  return s;
}

}  // namespace keel
