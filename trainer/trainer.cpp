#include "trainer/trainer.h"

#include <unistd.h>
#ifdef __GLIBC__
#include <malloc.h>
#endif

#include <atomic>
#include <chrono>
#include <csignal>
#include <cmath>
#include <cstdio>
#include <optional>
#include <thread>

#include <spdlog/spdlog.h>

#include "amp/autocast.h"
#include "amp/grad_scaler.h"
#include "dist/collectives.h"
#include "dist/process_group.h"
#include "keel/version.h"
#include "models/model.h"
#include "trainer/compile_cache.h"
#include "trainer/data.h"
#include "trainer/fault.h"
#include "trainer/log.h"
#include "trainer/metrics.h"
#include "trainer/optim.h"
#include "trainer/pipeline.h"
#include "trainer/sampler.h"

namespace keel {
namespace {

std::atomic<int> g_stop_signal{0};

extern "C" void on_stop_signal(int signo) { g_stop_signal.store(signo); }

// Installs SIGINT/SIGTERM handlers for the Trainer's lifetime.
class StopSignals {
 public:
  StopSignals() {
    struct sigaction sa {};
    sa.sa_handler = on_stop_signal;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, &old_int_);
    sigaction(SIGTERM, &sa, &old_term_);
  }
  ~StopSignals() {
    sigaction(SIGINT, &old_int_, nullptr);
    sigaction(SIGTERM, &old_term_, nullptr);
  }

 private:
  struct sigaction old_int_ {}, old_term_ {};
};

// glibc returns every large block (conv activations of a big eval batch are ~100 MB) to the
// kernel with munmap and faults it back in on the next allocation: measured here, evaluating
// the cnn with batch 1000 spent 13 of 16 s in the kernel. Keeping freed memory in the heap
// (no mmap for blocks under 1 GiB, no trimming) brought that run to 4.5 s.
void tune_allocator() {
#ifdef __GLIBC__
  const bool ok = mallopt(M_MMAP_THRESHOLD, 1 << 30) == 1 && mallopt(M_TRIM_THRESHOLD, 1 << 30) == 1;
  spdlog::debug("glibc malloc tuning (mmap/trim threshold 1 GiB): {}", ok ? "applied" : "refused");
#endif
}

using Clock = std::chrono::steady_clock;
double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

std::string format_duration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  const int64_t s = static_cast<int64_t>(seconds + 0.5);
  char buf[32];
  if (s >= 3600) std::snprintf(buf, sizeof buf, "%ldh%02ldm", long(s / 3600), long(s % 3600 / 60));
  else std::snprintf(buf, sizeof buf, "%ldm%02lds", long(s / 60), long(s % 60));
  return buf;
}

torch::Device resolve_device(const RunConfig& run, const dist::World& world) {
  if (run.device == "cpu") return torch::kCPU;
  if (run.device == "cuda" || (run.device == "auto" && torch::cuda::is_available())) {
    if (!torch::cuda::is_available())
      throw InputError("run.device = \"cuda\" but no CUDA device is available");
    return torch::Device(torch::kCUDA, static_cast<int16_t>(world.local_rank % torch::cuda::device_count()));
  }
  return torch::kCPU;
}

// What determines the model's graph, for the compile cache: every [model] key, and the bytes
// of a TorchScript file.
std::string model_identity(const ModelConfig& m) {
  Config c;
  c.model = m;
  std::string id;
  for (const auto& f : config_schema())
    if (f.section == "model") id += f.key + "=" + to_toml_literal(f.get(c)) + ";";
  if (m.name == "torchscript") id += "file_sha256=" + sha256_hex(read_file(m.path));
  return id;
}

// Zeroes gradients in place. torch::optim::Optimizer::zero_grad() (1.13) detaches them, which
// fails for DDP's gradients-as-bucket-views and would unlink them from the buckets.
void zero_grads(const std::vector<torch::Tensor>& params) {
  for (const auto& p : params)
    if (p.grad().defined()) p.grad().zero_();
}

// Cross-entropy over the last dimension: logits (..., C), target (...) int64.
torch::Tensor lm_or_class_loss(const torch::Tensor& logits, const torch::Tensor& target) {
  return torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}), target.reshape({-1}));
}

}  // namespace

void request_stop(int signo) { g_stop_signal.store(signo); }

struct Trainer::State {
  Config cfg;
  dist::World world;
  Callbacks cb;
};

Trainer::Trainer(Config cfg, dist::World world, Callbacks callbacks)
    : s_(std::make_unique<State>(State{std::move(cfg), std::move(world), std::move(callbacks)})) {}

Trainer::~Trainer() = default;

nlohmann::json Trainer::run() {
  const Config& cfg = s_->cfg;
  const dist::World& world = s_->world;
  const auto t_start = Clock::now();
  init_logging(cfg.run, world.rank, world.size);
  tune_allocator();

  // Threads: one intra-op pool per rank, sized so that the ranks of a node share its cores.
  const int64_t cores = std::max<int64_t>(1, static_cast<int64_t>(std::thread::hardware_concurrency()));
  const int64_t threads = cfg.run.threads > 0 ? cfg.run.threads : std::max<int64_t>(1, cores / world.local_size);
  at::set_num_threads(static_cast<int>(threads));
  torch::manual_seed(static_cast<uint64_t>(cfg.run.seed));
  const torch::Device device = resolve_device(cfg.run, world);
  auto group = dist::Group::create(world, cfg.dist, device);
  auto coll = std::make_shared<dist::Collectives>(group, cfg.dist.validate);

  // Model and data, from their registries. The data's native input kind is asked first so that
  // an unknown dataset is reported before a model is built.
  const auto data_kind = data::native_input_kind(cfg.data.name);
  auto model = models::create_model(cfg.model, data_kind);
  const models::InputSpec spec = model->input_spec();
  data::Splits splits = data::create_dataset(cfg.data, spec, cfg.run.seed);
  model->train(true);
  // The fixed init pipeline: place -> compile -> distribute (trainer/pipeline.h).
  // Mixed precision: autocast around forward and loss (and around tracing, so the casts are
  // part of the graph); dynamic loss scaling when amp.loss_scaling resolves to it.
  const bool autocast_on = cfg.amp.dtype != "off";
  if (cfg.amp.dtype == "fp16" && !device.is_cuda())
    throw InputError("amp.dtype = \"fp16\" needs a CUDA device (run.device resolved to " + device.str() +
                     "); use \"bf16\" on CPU");
  const c10::ScalarType amp_dtype = cfg.amp.dtype == "fp16" ? c10::kHalf : c10::kBFloat16;
  std::unique_ptr<amp::GradScaler> scaler;
  if (amp::loss_scaling_enabled(cfg.amp)) scaler = std::make_unique<amp::GradScaler>(cfg.amp);
  const torch::Tensor example = splits.train->get(std::vector<int64_t>(cfg.train.batch_size, 0)).input;
  auto compiled = [&] {
    amp::Autocast ac(device.type(), amp_dtype, autocast_on);
    // The identity (which reads and hashes a TorchScript file) is needed only by the cache.
    const std::string identity =
        cfg.compile.cache_dir.empty() ? "" : model_identity(cfg.model) + "amp.dtype=" + cfg.amp.dtype;
    return place(model, device).compile(cfg.compile, example, identity);
  }();
  DistributedModel dmodel = std::move(compiled).distribute(coll, cfg.dist);
  const bool is_lm = spec.kind == models::InputKind::Tokens;
  const int64_t tokens_per_sample = is_lm ? spec.sample_shape.at(0) : 0;

  const FaultPlan faults(cfg.fault.inject, world.size);
  std::unique_ptr<data::DistributedSampler> sampler;
  try {
    sampler = std::make_unique<data::DistributedSampler>(splits.train->size(), world.size, world.rank,
                                                         cfg.train.batch_size, cfg.data.shuffle,
                                                         cfg.data.drop_last, static_cast<uint64_t>(cfg.run.seed));
  } catch (const std::invalid_argument& e) {
    throw InputError(std::string("data: ") + e.what());
  }
  const int64_t total_steps =
      cfg.train.epochs > 0
          ? std::max<int64_t>(1, cfg.train.epochs * sampler->batches_per_epoch() / cfg.train.grad_accum)
          : cfg.train.steps;
  const int64_t global_batch = cfg.train.batch_size * cfg.train.grad_accum * world.size;

  const std::vector<torch::Tensor> model_params = model->parameters();
  auto optimizer = make_optimizer(cfg.train, model_params);
  LrSchedule schedule(cfg.train, total_steps);

  // Outputs (rank 0).
  JsonlWriter metrics;
  if (world.is_main()) {
    make_dirs(cfg.run.dir);
    write_file_atomic(cfg.run.dir + "/config.toml", dump_toml(cfg));
    metrics = JsonlWriter(cfg.run.dir + "/metrics.jsonl");
  }
  spdlog::info("keel {} | LibTorch {} | {} threads | device {}", KEEL_VERSION, TORCH_VERSION, threads,
               device.str());
  spdlog::info("model {} ({} parameters) | data {} ({} train, {} test) | {} steps of global batch {} "
               "({} per rank x {} accum x {} ranks), {} batches per epoch",
               model->name(), model->num_parameters(), cfg.data.name, splits.train->size(),
               splits.test ? splits.test->size() : 0, total_steps, global_batch, cfg.train.batch_size,
               cfg.train.grad_accum, world.size, sampler->batches_per_epoch());

  auto evaluate = [&](int64_t step) -> EvalResult {
    EvalResult r;
    r.step = step;
    if (!splits.test) return r;
    torch::NoGradGuard no_grad;
    model->train(false);
    double loss_sum = 0;
    int64_t correct = 0, count = 0;
    const int64_t n = splits.test->size();
    std::vector<int64_t> idx;
    for (int64_t i = world.rank; i < n; i += world.size) {
      idx.push_back(i);
      if (static_cast<int64_t>(idx.size()) == cfg.data.eval_batch_size || i + world.size >= n) {
        auto b = splits.test->get(idx);
        auto logits = model->forward(b.input.to(device));
        auto target = b.target.to(device);
        auto flat = logits.reshape({-1, logits.size(-1)});
        auto t = target.reshape({-1});
        loss_sum += torch::nn::functional::cross_entropy(
                        flat, t, torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum))
                        .item<double>();
        correct += flat.argmax(1).eq(t).sum().item<int64_t>();
        count += t.numel();
        idx.clear();
      }
    }
    model->train(true);
    auto totals = torch::tensor({loss_sum, double(correct), double(count)}, torch::kDouble);
    coll->all_reduce(totals, dist::ReduceOp::Sum, "evaluation totals");
    loss_sum = totals[0].item<double>();
    correct = static_cast<int64_t>(totals[1].item<double>());
    count = static_cast<int64_t>(totals[2].item<double>());
    r.loss = count ? loss_sum / count : std::nan("");
    r.accuracy = count ? double(correct) / count : std::nan("");
    r.count = count;
    return r;
  };

  // From here on SIGINT/SIGTERM stop the run after the current step; before, they end the
  // process as usual (e.g. while waiting at the rendezvous).
  StopSignals signals;
  g_stop_signal.store(0);
  const bool show_progress = cfg.run.progress && world.is_main() && ::isatty(STDOUT_FILENO);
  std::vector<double> step_times;
  step_times.reserve(total_steps);
  double last_loss = std::nan("");
  std::optional<EvalResult> last_eval;
  int64_t steps_done = 0;
  double ema_ms = 0;
  int64_t skipped_steps = 0;

  for (int64_t step = 0; step < total_steps; ++step) {
    if (g_stop_signal.load()) break;
    const auto t0 = Clock::now();
    coll->set_step(step + 1);
    const double lr = schedule.at(step);
    set_lr(*optimizer, lr);
    zero_grads(model_params);
    double loss_sum = 0;
    for (int64_t micro = 0; micro < cfg.train.grad_accum; ++micro) {
      // Gradients are all-reduced only on the last micro-batch of the step.
      const bool sync = micro + 1 == cfg.train.grad_accum;
      data::Batch b = splits.train->get(sampler->next());
      torch::Tensor loss;
      {
        amp::Autocast ac(device.type(), amp_dtype, autocast_on);
        auto logits = dmodel.forward(b.input.to(device), sync);
        loss = lm_or_class_loss(logits, b.target.to(device)).to(torch::kFloat);
      }
      auto scaled = loss / static_cast<double>(cfg.train.grad_accum);
      dmodel.backward(scaler ? scaler->scale(scaled) : scaled, sync);
      loss_sum += loss.item<double>();
    }
    const double local_loss = loss_sum / cfg.train.grad_accum;
    if (faults.fires("nonfinite_grad", step + 1, world.rank, world.restart_count)) {
      spdlog::warn("fault injection: nonfinite_grad at step {} on rank {}", step + 1, world.rank);
      for (auto& p : model_params)
        if (p.grad().defined()) {
          p.grad().view(-1)[0] = std::numeric_limits<float>::infinity();
          break;
        }
    }
    // Unscale before clipping; this rank's verdict on its gradients.
    bool local_nonfinite = !std::isfinite(local_loss);
    if (scaler) local_nonfinite = scaler->unscale_(model_params) || local_nonfinite;
    else if (cfg.train.skip_nonfinite || !faults.entries().empty())
      for (const auto& p : model_params)  // without a scaler, look at the gradients only when asked
        if (p.grad().defined() && !torch::isfinite(p.grad()).all().item<bool>()) {
          local_nonfinite = true;
          break;
        }
    const double compute_ms = ms_since(t0);
    // One all-gather per step: every rank is at this step with the same gradient plan, the
    // mean loss, and whether any rank saw inf/NaN (then no rank steps).
    const dist::StepConsensus consensus =
        coll->step_sync(step + 1, dmodel.plan(), local_loss, local_nonfinite, compute_ms);
    const double loss = consensus.mean_loss;
    const bool skip = consensus.any_nonfinite;
    if (skip && !scaler && !cfg.train.skip_nonfinite)
      throw std::runtime_error("non-finite training loss or gradients at step " + std::to_string(step + 1) +
                               " (local loss " + std::to_string(local_loss) +
                               "); no rank applied the update; lower train.lr, set train.grad_clip, or set "
                               "train.skip_nonfinite = true to skip such steps");
    double grad_norm = std::nan("");
    if (!skip) {
      if (cfg.train.grad_clip > 0)
        grad_norm = torch::nn::utils::clip_grad_norm_(model_params, cfg.train.grad_clip);
      optimizer->step();
    } else {
      ++skipped_steps;
      spdlog::warn("step {}: inf/NaN on some rank; every rank skips this update{}", step + 1,
                   scaler ? fmt::format(" (loss scale {} -> {})", scaler->scale_value(),
                                        scaler->scale_value() * cfg.amp.backoff_factor)
                          : std::string());
    }
    if (scaler) scaler->update(skip);
    const double step_ms = ms_since(t0);
    steps_done = step + 1;
    step_times.push_back(step_ms);
    last_loss = loss;
    ema_ms = step == 0 ? step_ms : 0.9 * ema_ms + 0.1 * step_ms;

    StepInfo info{steps_done, loss, lr, step_ms, global_batch * 1000.0 / step_ms};
    nlohmann::json line = {{"step", info.step}, {"loss", loss}, {"lr", lr}, {"step_ms", step_ms},
                           {"samples_per_s", info.samples_per_s},
                           {"epoch", sampler->position().epoch}};
    if (is_lm) line["tokens_per_s"] = info.samples_per_s * tokens_per_sample;
    if (cfg.train.grad_clip > 0) line["grad_norm"] = grad_norm;
    if (world.size > 1) line["rank_compute_ms"] = consensus.rank_compute_ms;
    if (scaler) line["loss_scale"] = scaler->scale_value();
    if (skip) line["skipped"] = true;

    const bool eval_now = cfg.train.eval_interval > 0 &&
                          (steps_done % cfg.train.eval_interval == 0 || steps_done == total_steps);
    if (eval_now) {
      last_eval = evaluate(steps_done);
      line["test_loss"] = last_eval->loss;
      line["test_accuracy"] = last_eval->accuracy;
      spdlog::info("eval step {}: test_loss {:.4f} test_accuracy {:.4f} ({} {})", steps_done, last_eval->loss,
                   last_eval->accuracy, last_eval->count, is_lm ? "tokens" : "samples");
      if (s_->cb.on_eval) s_->cb.on_eval(*last_eval);
    }
    metrics.write(line);
    if (s_->cb.on_step) s_->cb.on_step(info);

    if (show_progress) {
      const double eta_s = (total_steps - steps_done) * ema_ms / 1000.0;
      std::printf("\r\033[Kstep %ld/%ld | loss %.4f | %.1f it/s | ETA %s", long(steps_done), long(total_steps),
                  loss, 1000.0 / ema_ms, format_duration(eta_s).c_str());
      std::fflush(stdout);
    }
    if (steps_done % cfg.train.log_interval == 0 || steps_done == total_steps) {
      spdlog::log(show_progress ? spdlog::level::debug : spdlog::level::info,
                  "step {}/{} | loss {:.4f} | lr {:.3g} | {:.1f} ms/step | {:.0f} samples/s", steps_done,
                  total_steps, loss, lr, step_ms, info.samples_per_s);
    }
  }
  if (show_progress) std::printf("\n");

  // Leave together: a rank that tears down its connections while a peer still uses them makes
  // the peer's Gloo threads fail.
  coll->barrier("end of training");
  if (s_->cb.on_end) s_->cb.on_end(*model);
  const int stop_signal = g_stop_signal.load();
  if (stop_signal)
    spdlog::warn("stopped by signal {} after step {} of {}", stop_signal, steps_done, total_steps);

  // Summary: the median excludes the first 5 steps (warm-up: allocator, caches, lazy init).
  const size_t warm = step_times.size() > 5 ? 5 : 0;
  std::vector<double> steady(step_times.begin() + warm, step_times.end());
  const double median_ms = median(steady);
  nlohmann::json summary = {
      {"keel_version", KEEL_VERSION},
      {"torch_version", TORCH_VERSION},
      {"run_name", cfg.run.name},
      {"model", model->name()},
      {"num_parameters", model->num_parameters()},
      {"data", cfg.data.name},
      {"device", device.str()},
      {"world_size", world.size},
      {"launcher", world.launcher},
      {"backend", group->backend()},
      {"restart_count", world.restart_count},
      {"threads_per_rank", threads},
      {"batch_size", cfg.train.batch_size},
      {"grad_accum", cfg.train.grad_accum},
      {"global_batch", global_batch},
      {"steps", steps_done},
      {"planned_steps", total_steps},
      {"completed", steps_done == total_steps && !stop_signal},
      {"stop_signal", stop_signal ? nlohmann::json(stop_signal) : nlohmann::json(nullptr)},
      {"median_step_ms", median_ms},
      {"samples_per_s", global_batch * 1000.0 / median_ms},
      {"final_loss", last_loss},
      {"wall_s", ms_since(t_start) / 1000.0},
      {"compile_mode", dmodel.compile_report().mode},
      {"compile_ms", dmodel.compile_report().compile_ms},
      {"compile_cache", dmodel.compile_report().cache},
      {"recompiles", dmodel.compile_report().recompiles},
      {"amp_dtype", cfg.amp.dtype},
      {"loss_scale", scaler ? nlohmann::json(scaler->scale_value()) : nlohmann::json(nullptr)},
      {"skipped_steps", skipped_steps},
  };
  if (is_lm) summary["tokens_per_s"] = global_batch * tokens_per_sample * 1000.0 / median_ms;
  if (last_eval) {
    summary["test_accuracy"] = last_eval->accuracy;
    summary["test_loss"] = last_eval->loss;
  }
  if (world.is_main()) write_file_atomic(cfg.run.dir + "/summary.json", summary.dump(2) + "\n");
  spdlog::info("done: {} steps, median {:.2f} ms/step, final loss {:.4f}{}", steps_done, median_ms, last_loss,
               last_eval ? fmt::format(", test accuracy {:.4f}", last_eval->accuracy) : std::string());
  return summary;
}

}  // namespace keel
