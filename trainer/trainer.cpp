#include "trainer/trainer.h"

#include "trainer/rank_agreement.h"

#include <unistd.h>
#ifdef __GLIBC__
#include <malloc.h>
#endif

#include <atomic>
#include <chrono>
#include <csignal>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <optional>
#include <thread>

#include "common/log.h"

#include "amp/autocast.h"
#include "amp/grad_scaler.h"
#include "checkpoint/checkpoint.h"
#include "dist/collectives.h"
#include "dist/process_group.h"
#include "keel/version.h"
#include "models/model.h"
#include "trainer/compile.h"
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
  logging::debug("glibc malloc tuning (mmap/trim threshold 1 GiB): {}", ok ? "applied" : "refused");
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
      throw InputError("run.device = \"cuda\" but no CUDA device is available on this machine (no GPU or no "
                       "driver); use run.device = \"cpu\" or \"auto\"");
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
  if (m.name == "torchscript") id += "file_sha256=" + sha256_hex(read_file(m.path, kMaxInputBytes));
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

// fault.inject = graph_break: the model's forward gains a branch on a tensor's value, which a
// trace cannot capture (the compile stage must refuse it or fall back to eager).
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

 private:
  std::shared_ptr<models::Model> m_;
};

bool is_out_of_memory(const std::string& what) {
  return what.find("can't allocate memory") != std::string::npos ||
         what.find("out of memory") != std::string::npos || what.find("std::bad_alloc") != std::string::npos;
}

// Bits of the per-step consensus (dist::Collectives::step_sync).
constexpr uint32_t kFlagStop = 1u << 0;              // this rank received SIGINT/SIGTERM
constexpr uint32_t kFlagCheckpointWritten = 1u << 1; // this rank's async checkpoint write is done

// The generators a step draws from: the CPU one always, the device's one on CUDA. Saved per
// rank (each rank's dropout masks differ once ranks draw different amounts).
std::vector<torch::Device> rng_devices(const torch::Device& device) {
  std::vector<torch::Device> d{torch::kCPU};
  if (device.is_cuda()) d.push_back(device);
  return d;
}

checkpoint::NamedTensors rng_states(const torch::Device& device) {
  checkpoint::NamedTensors out;
  for (const auto& d : rng_devices(device)) {
    auto gen = at::globalContext().defaultGenerator(d);
    std::lock_guard<std::mutex> lock(gen.mutex());
    out.emplace_back("rng." + d.str(), gen.get_state());
  }
  return out;
}

void restore_rng_states(const torch::Device& device, const checkpoint::NamedTensors& saved) {
  for (const auto& d : rng_devices(device))
    for (const auto& [name, t] : saved)
      if (name == "rng." + d.str()) {
        auto gen = at::globalContext().defaultGenerator(d);
        std::lock_guard<std::mutex> lock(gen.mutex());
        gen.set_state(t);
      }
}

// Keeps the lines of metrics.jsonl up to `step` (a resumed run rewrites what followed).
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
  write_file_atomic(path, kept);
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
  agree_on_config(*group, cfg);  // before the first collective
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
  const FaultPlan faults(cfg.fault.inject, world.size);
  if (faults.fires("graph_break", 1, world.rank, world.restart_count)) {
    logging::warn("fault injection: graph_break: rank {}'s model branches on a tensor value", world.rank);
    model = std::make_shared<GraphBreakModel>(model);
  }
  std::unique_ptr<amp::GradScaler> scaler;
  if (amp::loss_scaling_enabled(cfg.amp)) scaler = std::make_unique<amp::GradScaler>(cfg.amp);
  const torch::Tensor example = splits.train->get(std::vector<int64_t>(cfg.train.batch_size, 0)).input;
  auto compile = [&] {
    amp::Autocast ac(device.type(), amp_dtype, autocast_on);
    // The identity (which reads and hashes a TorchScript file) is needed only by the cache.
    const std::string identity =
        cfg.compile.cache_dir.empty() ? "" : model_identity(cfg.model) + "amp.dtype=" + cfg.amp.dtype;
    return place(model, device).compile(cfg.compile, example, identity);
  };
  // A compile error on one rank stops every rank (agreed here), instead of leaving the others
  // waiting in DDP's first collective.
  std::optional<CompiledModel> compiled;
  std::string compile_error;
  try {
    compiled.emplace(compile());
  } catch (const CompileError& e) {
    compile_error = e.what();
  }
  auto compile_failed = torch::tensor({compile_error.empty() ? int64_t{0} : world.rank + 1}, torch::kLong);
  coll->all_reduce(compile_failed, dist::ReduceOp::Max, "compile outcome");
  if (compile_failed.item<int64_t>() != 0) {
    if (!compile_error.empty()) throw CompileError(compile_error);
    throw CompileError("compile failed on rank " + std::to_string(compile_failed.item<int64_t>() - 1) +
                       " (its log says why); every rank stops");
  }
  DistributedModel dmodel = std::move(*compiled).distribute(coll, cfg.dist);
  const bool is_lm = spec.kind == models::InputKind::Tokens;
  const int64_t tokens_per_sample = is_lm ? spec.sample_shape.at(0) : 0;

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
  const models::NamedTensors named_params = model->named_parameters();
  int64_t skipped_steps = 0;
  double last_loss = std::nan("");

  // Checkpoints: resume from the newest committed step (checkpoint/checkpoint.h).
  std::unique_ptr<checkpoint::Checkpointer> ckpt;
  int64_t start_step = 0;
  std::optional<int64_t> resumed_from;
  auto model_state = [&] {
    checkpoint::NamedTensors t;
    for (const auto& [n, x] : named_params) t.emplace_back(n, x);
    for (const auto& [n, x] : model->named_buffers()) t.emplace_back(n, x);
    return t;
  };
  auto make_checkpoint_state = [&](int64_t step) {
    checkpoint::State st;
    st.model = model_state();
    st.optimizer = optimizer_state(*optimizer, named_params);
    st.shared = {{"step", step},
                 {"skipped_steps", skipped_steps},
                 {"loss", std::isfinite(last_loss) ? nlohmann::json(last_loss) : nlohmann::json(nullptr)},
                 {"total_steps", total_steps},
                 {"global_batch", global_batch},
                 {"scaler", nullptr}};
    if (scaler) {
      const auto& ss = scaler->state();
      st.shared["scaler"] = {{"scale", ss.scale},
                             {"growth_tracker", ss.growth_tracker},
                             {"growth_factor", ss.growth_factor},
                             {"backoff_factor", ss.backoff_factor},
                             {"growth_interval", ss.growth_interval}};
    }
    st.rank_tensors = rng_states(device);
    if (s_->cb.save_state) s_->cb.save_state(st);
    if (cfg.checkpoint.save_graph) {
      st.graph = export_traced_module(dmodel.model());
      if (st.graph.empty() && world.is_main())
        logging::warn("checkpoint.save_graph: the model is not traced (compile fell back to eager); no graph.pt");
    }
    const auto pos = sampler->position();
    st.shared["data_position"] = {{"epoch", pos.epoch}, {"batch", pos.batch}};
    st.shared["batch_size"] = cfg.train.batch_size;
    st.rank_state = {{"sampler", {{"epoch", pos.epoch}, {"batch", pos.batch}}},
                     {"batch_size", cfg.train.batch_size},
                     {"world_size", world.size},
                     {"rank", world.rank}};
    return st;
  };
  if (!cfg.checkpoint.dir.empty()) {
    checkpoint::Options o;
    o.dir = cfg.checkpoint.dir;
    o.keep = cfg.checkpoint.keep;
    o.async = cfg.checkpoint.async;
    o.config_sha256 = sha256_hex(dump_toml(cfg));
    ckpt = std::make_unique<checkpoint::Checkpointer>(o, coll);
    for (const auto& e : faults.entries())
      if (e.type == "checkpoint_corruption" && faults.fires(e.type, e.step, world.rank, world.restart_count))
        ckpt->inject_corruption_after_commit(e.step);
    std::optional<checkpoint::Loaded> loaded;
    try {
      loaded = ckpt->load(cfg.checkpoint.resume_from);
    } catch (const checkpoint::ResumeError& e) {
      throw InputError(e.what());  // the step the user named; a failed peer or disk stays exit 1
    }
    if (loaded) {
      const auto& st = loaded->state;
      try {
        checkpoint::copy_into(model_state(), st.model, loaded->path);
      } catch (const checkpoint::BindError& e) {
        throw InputError(e.what());
      }
      load_optimizer_state(*optimizer, named_params, st.optimizer);
      start_step = loaded->step;
      resumed_from = loaded->step;
      skipped_steps = st.shared.value("skipped_steps", int64_t{0});
      if (st.shared.contains("loss") && st.shared["loss"].is_number()) last_loss = st.shared["loss"].get<double>();
      if (st.shared.contains("scaler") && st.shared["scaler"].is_object() && scaler) {
        const auto& j = st.shared["scaler"];
        amp::ScalerState ss;
        ss.scale = j.at("scale").get<double>();
        ss.growth_tracker = j.at("growth_tracker").get<int64_t>();
        ss.growth_factor = j.at("growth_factor").get<double>();
        ss.backoff_factor = j.at("backoff_factor").get<double>();
        ss.growth_interval = j.at("growth_interval").get<int64_t>();
        scaler->load_state(ss);
      } else if (scaler) {
        logging::warn("checkpoint {} has no loss-scaler state; starting from amp.init_scale", loaded->path);
      }
      const int64_t saved_world = loaded->saved_world_size;
      const auto& rs = st.rank_state;
      const bool same_layout = loaded->has_rank_state && saved_world == world.size &&
                               rs.value("batch_size", int64_t{-1}) == cfg.train.batch_size;
      if (loaded->has_rank_state) restore_rng_states(device, st.rank_tensors);
      if (same_layout) {
        sampler->restore({rs["sampler"]["epoch"].get<int64_t>(), rs["sampler"]["batch"].get<int64_t>()});
      } else {
        // Another world size (or batch size): keep the position in the data as the number of
        // samples the whole job has consumed in the current epoch, and start every rank at the
        // first global batch not fully consumed (docs/checkpoints.md).
        int64_t e = 0, b = 0;  // every rank of the saved job had this position
        if (st.shared.contains("data_position")) {
          e = st.shared["data_position"].value("epoch", int64_t{0});
          b = st.shared["data_position"].value("batch", int64_t{0});
        }
        const int64_t saved_batch = st.shared.value("batch_size", cfg.train.batch_size);
        const int64_t consumed = b * saved_world * saved_batch;
        const int64_t per_global = world.size * cfg.train.batch_size;
        int64_t nb = consumed / per_global;
        if (nb > sampler->batches_per_epoch()) nb = sampler->batches_per_epoch();
        sampler->restore({e, nb});
        logging::warn("resuming a checkpoint saved by {} ranks x batch {} on {} ranks x batch {}: data position "
                     "remapped from epoch {} batch {} to batch {} ({} samples of the epoch consumed){}",
                     saved_world, saved_batch, world.size, cfg.train.batch_size, e, b, nb, consumed,
                     consumed % per_global ? "; the partial global batch is skipped" : "");
      }
      if (s_->cb.load_state) s_->cb.load_state(st);
      logging::info("resumed from {} (step {} of {})", loaded->path, start_step, total_steps);
    } else {
      logging::info("checkpoint: no committed step under {}; starting fresh", cfg.checkpoint.dir);
    }
  }

  // Outputs (rank 0).
  JsonlWriter metrics;
  if (world.is_main()) {
    make_dirs(cfg.run.dir);
    write_file_atomic(cfg.run.dir + "/config.toml", dump_toml(cfg));
    if (resumed_from) truncate_metrics(cfg.run.dir + "/metrics.jsonl", *resumed_from);
    else std::remove((cfg.run.dir + "/metrics.jsonl").c_str());  // a fresh run starts a fresh file
    metrics = JsonlWriter(cfg.run.dir + "/metrics.jsonl");
  }
  logging::info("keel {} | LibTorch {} | {} threads | device {}", KEEL_VERSION, TORCH_VERSION, threads,
               device.str());
  logging::info("model {} ({} parameters) | data {} ({} train, {} test) | {} steps of global batch {} "
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
  std::optional<EvalResult> last_eval;
  int64_t steps_done = start_step;
  double ema_ms = 0;
  bool stopped = false;
  double checkpoint_stall_ms = 0;

  // fault.inject = checkpoint_write_failure: ENOSPC (or, with `crash`, SIGKILL) halfway through
  // this rank's model shard of the checkpoint of step `s`.
  auto inject_save_fault = [&](int64_t s) {
    if (const FaultEntry* e = faults.find("checkpoint_write_failure", s, world.rank, world.restart_count)) {
      logging::warn("fault injection: checkpoint_write_failure ({}) at step {} on rank {}", e->crash ? "SIGKILL" : "ENOSPC",
                   s, world.rank);
      ckpt->inject_write_failure(e->crash ? -1 : ENOSPC);
    }
  };
  // Callbacks::on_checkpoint, once per newly committed step.
  int64_t notified_step = ckpt ? ckpt->last_committed() : -1;
  auto notify_checkpoint = [&] {
    if (!ckpt || ckpt->last_committed() == notified_step) return;
    notified_step = ckpt->last_committed();
    if (s_->cb.on_checkpoint) s_->cb.on_checkpoint(notified_step, cfg.checkpoint.dir + "/step_" + std::to_string(notified_step));
  };

  // Faults that strike during a step (after backward, before the step's consensus).
  std::vector<int64_t> slow_streak(static_cast<size_t>(world.size), 0);
  auto inject_step_faults = [&](int64_t s) {
    const int64_t r = world.rank, rc = world.restart_count;
    if (const FaultEntry* e = faults.active("straggler", s, r, rc)) {
      if (s == e->step) logging::warn("fault injection: straggler: rank {} sleeps {} ms per step from step {}", r, e->ms, s);
      std::this_thread::sleep_for(std::chrono::milliseconds(e->ms));
    }
    if (faults.fires("crash", s, r, rc)) {
      logging::error("fault injection: crash (SIGKILL) at step {} on rank {}", s, r);
      logging::flush();
      std::raise(SIGKILL);
    }
    if (faults.fires("oom", s, r, rc)) {
      // 1 PiB: more than a 47-bit address space holds, so the allocation fails even where the
      // kernel overcommits memory (nothing is ever touched).
      logging::warn("fault injection: oom at step {} on rank {}: allocating 1 PiB", s, r);
      auto huge = torch::empty({int64_t{1} << 48}, torch::TensorOptions().dtype(torch::kFloat).device(device));
    }
    if (faults.fires("collective_hang", s, r, rc)) {
      logging::warn("fault injection: collective_hang at step {}: rank {} stops taking part in collectives", s, r);
      const std::string why = coll->hang_until_peers_fail(std::chrono::milliseconds(2 * cfg.dist.timeout_s * 1000 + 10000));
      throw std::runtime_error("fault injection: collective_hang: rank " + std::to_string(r) + " stopped at step " +
                               std::to_string(s) + (why.empty() ? std::string("; no peer reported")
                                                                : "; its peers gave up: " + why.substr(0, 300)));
    }
    if (const FaultEntry* e = faults.any_rank("shape_mismatch", s, rc)) {
      // Every rank issues the same collective; the faulty rank's tensor has another shape.
      auto probe = torch::zeros({e->rank == r ? 5 : 4}, torch::TensorOptions().device(device));
      if (e->rank == r) logging::warn("fault injection: shape_mismatch at step {}: rank {} all-reduces shape [5]", s, r);
      coll->all_reduce(probe, dist::ReduceOp::Sum, "fault probe (shape_mismatch)");
    }
  };

  try {
  for (int64_t step = start_step; step < total_steps; ++step) {
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
      logging::warn("fault injection: nonfinite_grad at step {} on rank {}", step + 1, world.rank);
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
    if (!faults.empty()) inject_step_faults(step + 1);
    const double compute_ms = ms_since(t0);
    uint32_t flags = 0;
    if (g_stop_signal.load()) flags |= kFlagStop;
    if (ckpt && ckpt->pending() && ckpt->write_finished()) flags |= kFlagCheckpointWritten;
    // One all-gather per step: every rank is at this step with the same gradient plan, the
    // mean loss, and whether any rank saw inf/NaN (then no rank steps).
    const dist::StepConsensus consensus =
        coll->step_sync(step + 1, dmodel.plan(), local_loss, local_nonfinite, compute_ms, flags);
    // An async checkpoint is committed once every rank has written its share.
    if (ckpt && ckpt->pending() && (consensus.all_flags & kFlagCheckpointWritten)) {
      ckpt->commit();
      notify_checkpoint();
    }
    const double loss = consensus.mean_loss;
    // A rank that is consistently slower than the others sets the pace of the whole job
    // (rank 0 watches; O(world) per step: one median, the other rank's time for 2 ranks).
    if (world.size > 1 && world.is_main()) {
      const auto& c = consensus.rank_compute_ms;
      const double m_all = median(c);
      for (int64_t rr = 0; rr < world.size; ++rr) {
        const double m = world.size == 2 ? c[1 - rr] : m_all;
        slow_streak[rr] = c[rr] > 1.5 * m && c[rr] > m + 5.0 ? slow_streak[rr] + 1 : 0;
        if (slow_streak[rr] == 20)
          logging::warn("rank {} is consistently slower: its forward+backward took {:.1f} ms vs {:.1f} ms (median of the "
                       "other ranks) for 20 steps in a row; every rank waits for it (rank_compute_ms in metrics.jsonl)",
                       rr, c[rr], m);
      }
    }
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
      logging::warn("step {}: inf/NaN on some rank; every rank skips this update{}", step + 1,
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
      logging::info("eval step {}: test_loss {:.4f} test_accuracy {:.4f} ({} {})", steps_done, last_eval->loss,
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
    if (ckpt && cfg.checkpoint.interval > 0 && steps_done % cfg.checkpoint.interval == 0 && steps_done < total_steps) {
      inject_save_fault(steps_done);
      ckpt->save(steps_done, make_checkpoint_state(steps_done));
      checkpoint_stall_ms += ckpt->last_save_blocking_ms();
      notify_checkpoint();
    }
    if (steps_done % cfg.train.log_interval == 0 || steps_done == total_steps) {
      logging::log(show_progress ? logging::Level::debug : logging::Level::info,
                  "step {}/{} | loss {:.4f} | lr {:.3g} | {:.1f} ms/step | {:.0f} samples/s", steps_done,
                  total_steps, loss, lr, step_ms, info.samples_per_s);
    }
    if (consensus.any_flags & kFlagStop) {  // every rank stops after the same step
      stopped = true;
      break;
    }
  }
  } catch (const c10::Error& e) {
    // Out of memory (injected or real): say where, how much, and what survives.
    const std::string what = e.what_without_backtrace();
    if (!is_out_of_memory(what)) throw;
    throw std::runtime_error("out of memory at step " + std::to_string(steps_done + 1) + " on rank " +
                             std::to_string(world.rank) + ": " + what.substr(0, what.find('\n')) +
                             "; the last committed checkpoint is " +
                             (ckpt && ckpt->last_committed() >= 0 ? "step " + std::to_string(ckpt->last_committed()) + " (intact)"
                                                                   : std::string("none")) +
                             "; lower train.batch_size or use train.grad_accum");
  } catch (const std::bad_alloc&) {
    throw std::runtime_error("out of memory at step " + std::to_string(steps_done + 1) + " on rank " +
                             std::to_string(world.rank) + " (std::bad_alloc); lower train.batch_size");
  }
  if (show_progress) std::printf("\n");
  if (start_step >= total_steps) {
    // Resumed from the final step: nothing to train; evaluate so the summary is complete.
    logging::info("checkpoint step {} is the end of this run ({} steps): nothing to train", start_step, total_steps);
    if (cfg.train.eval_interval > 0) {
      last_eval = evaluate(steps_done);
      if (s_->cb.on_eval) s_->cb.on_eval(*last_eval);
    }
  }
  // The final checkpoint (also after a stop signal), then the pending commit.
  if (ckpt) {
    if (steps_done > 0 && steps_done != ckpt->last_committed()) {
      inject_save_fault(steps_done);
      ckpt->save(steps_done, make_checkpoint_state(steps_done));
      checkpoint_stall_ms += ckpt->last_save_blocking_ms();
    }
    ckpt->finish();
    notify_checkpoint();
  }

  // Leave together: a rank that tears down its connections while a peer still uses them makes
  // the peer's Gloo threads fail.
  coll->barrier("end of training");
  if (s_->cb.on_end) s_->cb.on_end(*model);
  const int stop_signal = stopped ? (g_stop_signal.load() ? g_stop_signal.load() : SIGTERM) : 0;
  if (stop_signal)
    logging::warn("stopped by signal {} after step {} of {}", stop_signal, steps_done, total_steps);

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
      {"metrics_lines_lost", metrics.lines_lost()},
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
      {"resumed_from_step", resumed_from ? nlohmann::json(*resumed_from) : nlohmann::json(nullptr)},
      {"checkpoint_step", ckpt && ckpt->last_committed() >= 0 ? nlohmann::json(ckpt->last_committed())
                                                               : nlohmann::json(nullptr)},
      {"checkpoint_stall_ms", checkpoint_stall_ms},
  };
  if (is_lm) summary["tokens_per_s"] = global_batch * tokens_per_sample * 1000.0 / median_ms;
  if (last_eval) {
    summary["test_accuracy"] = last_eval->accuracy;
    summary["test_loss"] = last_eval->loss;
  }
  if (world.is_main()) write_file_atomic(cfg.run.dir + "/summary.json", summary.dump(2) + "\n");
  logging::info("done: {} steps, median {:.2f} ms/step, final loss {:.4f}{}", steps_done, median_ms, last_loss,
               last_eval ? fmt::format(", test accuracy {:.4f}", last_eval->accuracy) : std::string());
  return summary;
}

}  // namespace keel
