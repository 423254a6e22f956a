// The training loop. Trainer::Loop's constructor builds the run (place -> compile ->
// distribute, data, optimizer, checkpointing, resume); run() is the loop; each part of a step
// is a named member below, in the order a step runs them.
#include "keel/trainer/trainer.h"

#include <sys/resource.h>
#include <unistd.h>

#include <ATen/record_function.h>
#ifdef KEEL_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#endif

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <optional>
#include <set>
#include <vector>

#include "amp/autocast.h"
#include "amp/grad_scaler.h"
#include "checkpoint/checkpointer.h"
#include "checkpoint/stateful.h"
#include "checkpoint/weights.h"
#include "common/atomic_file.h"
#include "common/clock.h"
#include "common/file.h"
#include "common/host_copy.h"
#include "common/log.h"
#include "common/registry.h"
#include "common/stop.h"
#include "dist/fsdp.h"
#include "dist/mesh.h"
#include "keel/dist/collectives.h"
#include "keel/dist/process_group.h"
#include "keel/trainer/data/data.h"
#include "keel/version.h"
#include "models/hf.h"
#include "trainer/app/log.h"
#include "trainer/compile/inductor.h"
#include "trainer/compile/packaging.h"
#include "trainer/compile/pipeline.h"
#include "trainer/compile/python_model.h"
#include "trainer/config/limits.h"
#include "trainer/data/sampler.h"
#include "trainer/fault/injector.h"
#include "trainer/loss.h"
#include "trainer/metrics.h"
#include "trainer/optim.h"
#include "trainer/profiler.h"
#include "trainer/progress.h"
#include "trainer/rank_agreement.h"
#include "trainer/setup.h"
#include "trainer/signals.h"
#include "trainer/state.h"

namespace keel {
namespace {

// train.steps' documented maximum (trainer/config/schema.cpp).
constexpr int64_t kMaxPlannedSteps = 1'000'000'000'000;

// Bits of the per-step consensus (dist::Collectives::step_sync).
constexpr uint32_t kFlagStop = 1u << 0;               // this rank received SIGINT/SIGTERM
constexpr uint32_t kFlagCheckpointWritten = 1u << 1;  // this rank's async checkpoint write is done

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

}  // namespace

// What one optimizer step produced.
struct StepResult {
  int64_t step = 0;       // optimizer steps done after it
  double loss = 0;        // mean over micro-batches and ranks
  double local_loss = 0;  // this rank's
  double lr = 0;
  double step_ms = 0;
  double grad_norm = std::nan("");   // before clipping (train.grad_clip > 0)
  double loss_scale = std::nan("");  // after the step's update (with a GradScaler)
  double loss_scale_before = std::nan("");
  int64_t epoch = 0;     // the sampler's epoch after the step's batches
  bool skipped = false;  // inf/NaN on some rank: no rank applied the update
  bool stop = false;     // some rank was asked to stop: every rank stops after this step
  dist::StepConsensus consensus;
};

// A step on its way: launched (forward, backward, the consensus exchanged, the update issued)
// and, with dist.consensus = late, not yet read by the host.
struct InFlight {
  StepResult r;
  Clock::time_point t0;
  dist::PendingStep record;
  bool resolved = false;  // r holds the consensus
  HostCopy extras;        // float64 [grad norm, loss scale before the update, after it]
};

class Trainer::Loop {
 public:
  Loop(const Config& cfg, const dist::World& world, const Callbacks& cb);
  Summary run();

 private:
  // Setup, in order (the constructor).
  void lock_directories();
  void check_memory_needs();
  void build_model_and_data();
  std::shared_ptr<models::Model> build_model_on_every_rank(std::optional<models::InputKind> data_kind);
  void compile_and_distribute();
  void build_optimizer();
  void build_checkpointing();
  void resume();
  void open_outputs();
  // One step, in order: begin (data, forward, backward, the verdict, the consensus exchanged),
  // update, then finish (the consensus read, logs, evaluation, checkpoint), which with
  // dist.consensus = late comes after the next step's begin.
  InFlight begin_step(int64_t step);
  torch::Tensor forward_backward(double* loss_now);
  torch::Tensor to_device(const torch::Tensor& t) const;
  torch::Tensor local_nonfinite(const torch::Tensor& local_loss);
  bool local_nonfinite_now(double local_loss);
  torch::Tensor grad_verdict();
  void resolve_step(InFlight& f);
  void apply_update(InFlight& f);
  void finish_step(InFlight& f, std::optional<Clock::time_point> next_t0);
  bool needs_host(int64_t step) const;
  std::optional<EvalResult> maybe_evaluate(int64_t step);
  EvalResult evaluate(int64_t step);
  void log_step(const StepResult& r, const std::optional<EvalResult>& eval);
  StepRecord step_record(const StepResult& r, const std::optional<EvalResult>& eval) const;
  void maybe_checkpoint(int64_t step);
  // The end.
  void finish();
  Summary summary() const;
  void save_checkpoint(int64_t step);
  void notify_checkpoint();
  std::runtime_error out_of_memory(const std::string& what, bool committed_step) const;

  const Config& cfg_;
  const dist::World& world_;
  const Callbacks& cb_;
  const Clock::time_point t_start_ = Clock::now();

  int64_t threads_ = 1;
  torch::Device device_{torch::kCPU};
  std::shared_ptr<dist::Group> group_;
  std::shared_ptr<dist::Collectives> coll_;  // the world's
  dist::Mesh mesh_;                          // the parallel axes: who is a data-parallel peer
  std::unique_ptr<FaultInjector> faults_;
  AmpContext amp_;
  std::shared_ptr<models::Model> model_;  // the eager model (evaluation, checkpoints)
  std::shared_ptr<PythonModel> python_;   // model.name = "python": model_'s core, evaluated through the package
  models::InputSpec spec_;
  data::Splits splits_;
  std::optional<DistributedModel> dmodel_;
  std::unique_ptr<data::DistributedSampler> sampler_;
  std::vector<torch::Tensor> params_;
  int64_t num_parameters_ = 0;        // the model's, as built
  std::vector<torch::Tensor> owned_;  // the parameters this rank's optimizer updates (dist.zero)
  std::unique_ptr<torch::optim::Optimizer> optimizer_;
  std::unique_ptr<OptimizerState> optimizer_state_;  // its checkpoint part (partitioned with dist.zero)
  std::optional<LrSchedule> schedule_;
  std::unique_ptr<amp::GradScaler> scaler_;
  LossFn loss_;

  DirLock run_dir_lock_, checkpoint_dir_lock_;  // rank 0 holds them for the job
  Progress progress_;
  std::unique_ptr<checkpoint::Checkpointer> ckpt_;
  checkpoint::StateRegistry state_;
  std::vector<std::unique_ptr<checkpoint::Stateful>> owned_state_;
  std::optional<int64_t> resumed_from_;
  double rendezvous_ms_ = 0;
  dist::TrafficStats traffic_at_loop_;  // the control traffic before the loop (setup, resume)
  // The control traffic so far: everything through the world's door (ZeRO's replayed
  // collectives included; DDP's buckets counted apart).
  dist::TrafficStats control_traffic() const { return coll_->traffic(); }
  int64_t steps_at_loop_ = 0;
  int64_t notified_step_ = -1;
  double checkpoint_stall_ms_ = 0;

  RunMetrics metrics_;                      // metrics.jsonl, TensorBoard, the log line, step times
  std::unique_ptr<StepProfiler> profiler_;  // run.profile_steps
  std::optional<EvalResult> last_eval_;
  int stop_signal_ = 0;              // the signal that stopped the run (every rank the same, after finish())
  bool stopped_ = false;             // the step consensus said some rank was asked to stop
  bool stop_requested_ = false;      // ... read in a step's finish: the loop ends after the step in hand
  int64_t current_step_ = 0;         // the step begun last (with a late consensus, one ahead of steps_done)
  bool late_ = false;                // dist.consensus resolved: the consensus is read one step late
  FusedOptimizer* fused_ = nullptr;  // optimizer_, when fused (the update can skip on the device)
  std::optional<OptimizerChoice> optimizer_choice_;  // train.optimizer, resolved at start
};

Trainer::Loop::Loop(const Config& cfg, const dist::World& world, const Callbacks& cb)
    : cfg_(cfg), world_(world), cb_(cb), loss_(cb.loss ? cb.loss : losses().get(cfg.train.loss)) {
  init_logging(cfg.run, world.rank, world.size);
  tune_allocator();
  threads_ = set_threads(cfg.run, world);
  torch::manual_seed(static_cast<uint64_t>(cfg.run.seed));
  device_ = resolve_device(cfg.run, world);
  const auto t_rdzv = Clock::now();
  {
    AtRendezvous rendezvous;
    group_ = dist::Group::create(world, cfg.dist, device_);
    agree_on_config(group_, cfg);  // before the first collective
  }
  rendezvous_ms_ = ms_since(t_rdzv);
  coll_ = std::make_shared<dist::Collectives>(group_, cfg.dist.validate);
  mesh_ = dist::Mesh::build(world);
  mesh_.connect(coll_, cfg.dist.validate);
  optimizer_choice_.emplace(resolve_optimizer(cfg.train));  // an unknown or unusable one stops the run here
  lock_directories();
  check_memory_needs();
  build_model_and_data();
  compile_and_distribute();
  build_optimizer();
  build_checkpointing();
  resume();
  open_outputs();
}

// One job per run.dir and per checkpoint.dir: rank 0 takes an exclusive lock on each (released
// by the kernel when the process ends, SIGKILL included) before anything is read or written
// there; a second job is refused on every rank, exit 2, naming the directory and the holder.
void Trainer::Loop::lock_directories() {
  std::string error;
  if (world_.is_main()) {
    char host[256] = {0};
    ::gethostname(host, sizeof host - 1);
    const std::string who = "keel run \"" + cfg_.run.name + "\" (pid " + std::to_string(::getpid()) + " on " + host +
                            ", " + std::to_string(world_.size) + " rank(s))";
    auto take = [&](DirLock& lock, const std::string& key, const std::string& dir) {
      if (!error.empty() || dir.empty()) return;
      const std::string why = lock.try_lock(dir, who);
      if (why.rfind("held by ", 0) == 0)
        error = key + " = \"" + dir + "\" is in use by another run: its lock (" + dir + "/.keel.lock) is " + why +
                "; wait for it to end, or give this run another " + key;
      else if (!why.empty())
        error = key + ": " + why;
    };
    take(run_dir_lock_, "run.dir", cfg_.run.dir);
    std::error_code ec1;
    const bool same =
        !cfg_.checkpoint.dir.empty() && std::filesystem::equivalent(cfg_.run.dir, cfg_.checkpoint.dir, ec1) && !ec1;
    if (!same) take(checkpoint_dir_lock_, "checkpoint.dir", cfg_.checkpoint.dir);
  }
  if (const dist::RankError e = dist::first_error(*coll_, error, "directory locks"))
    throw InputError(e.rank == world_.rank ? e.message : "rank " + std::to_string(e.rank) + ": " + e.message);
}

// What the model, one micro-batch and the data need, from the config alone (trainer/config/limits.h):
// exit 2 on every rank naming the keys and the sizes, before any of it is allocated.
void Trainer::Loop::check_memory_needs() {
  std::string problem;
  if (const auto host = available_memory_bytes())
    problem = memory_problem(cfg_, mesh_.dp(), world_.local_size, device_.is_cuda(), *host,
                             device_.is_cuda() ? device_free_bytes(device_.index()) : std::nullopt);
  if (const dist::RankError e = dist::first_error(*coll_, problem, "memory estimate"))
    throw InputError(e.rank == world_.rank ? e.message : "rank " + std::to_string(e.rank) + ": " + e.message);
}

// The model (and compile.libraries, which a Python module's packaging needs), agreed: a rank that
// cannot build it (a file or library missing on its host, another Python there) fails every rank
// together, each naming that rank and its reason, instead of leaving the others to a lost peer.
std::shared_ptr<models::Model> Trainer::Loop::build_model_on_every_rank(std::optional<models::InputKind> data_kind) {
  std::shared_ptr<models::Model> model;
  std::string error;
  bool input = true;  // the user's input (exit 2) or not (exit 1)
  try {
    aot::load_libraries(cfg_.compile.libraries);
    model = make_model(cfg_, data_kind);
  } catch (const InputError& e) {
    error = e.what();
  } catch (const Stopped&) {
    throw;  // a stop signal ended a wait (the compile cache's lock): every rank got it
  } catch (const std::exception& e) {
    error = e.what();
    input = false;
  }
  if (const dist::RankError e = dist::first_error(*coll_, error.empty() ? "" : (input ? "2" : "1") + error, "model")) {
    const std::string why =
        (e.rank == world_.rank ? "" : "rank " + std::to_string(e.rank) + ": ") + e.message.substr(1);
    if (e.message[0] == '2') throw InputError(why);
    throw std::runtime_error(why);
  }
  return model;
}

void Trainer::Loop::build_model_and_data() {
  // The data's native input kind is asked first so that an unknown dataset is reported before
  // a model is built.
  const auto data_kind = data::native_input_kind(cfg_.data.name);
  model_ = build_model_on_every_rank(data_kind);
  num_parameters_ = model_->num_parameters();  // (dist.zero = 3 empties the model's own between steps)
  python_ = std::dynamic_pointer_cast<PythonModel>(model_);
  if (!cfg_.model.init_from.empty()) {  // before placement and DDP's broadcast; a resume overrides it
    // The Hugging Face families read transformers' files under their older names too.
    const int64_t n = checkpoint::load_weights(*model_, cfg_.model.init_from,
                                               models::is_hf_family(cfg_.model.name)
                                                   ? models::hf_tensor_rename(models::hf_shape(cfg_.model))
                                                   : checkpoint::TensorRename{});
    logging::info("model: {} tensors from {} (model.init_from)", n, cfg_.model.init_from);
  }
  spec_ = model_->input_spec();
  splits_ = data::create_dataset(cfg_.data, spec_, cfg_.run.seed);
  model_->train(true);
  amp_ = AmpContext::resolve(cfg_.amp, device_);
  faults_ = std::make_unique<FaultInjector>(cfg_.fault, world_, device_, std::chrono::seconds(cfg_.dist.timeout_s));
  faults_->signal(FaultPhase::Start, 0);
  model_ = faults_->wrap_model(model_);
  if (amp::loss_scaling_enabled(cfg_.amp)) scaler_ = std::make_unique<amp::GradScaler>(cfg_.amp);
  try {
    sampler_ = std::make_unique<data::DistributedSampler>(splits_.train->size(), mesh_.dp(), mesh_.dp_rank(),
                                                          cfg_.train.batch_size, cfg_.data.shuffle, cfg_.data.drop_last,
                                                          static_cast<uint64_t>(cfg_.run.seed));
  } catch (const std::invalid_argument& e) {
    throw InputError(std::string("data: ") + e.what());
  }
  // A Python module runs only its compiled step, at one batch shape (every rank alike).
  if (const int64_t tail = static_cast<int64_t>(sampler_->rank_indices(0).size()) % cfg_.train.batch_size;
      python_ && tail != 0)
    throw InputError("model.name = \"python\" runs only its compiled step, at train.batch_size = " +
                     std::to_string(cfg_.train.batch_size) + ": data.drop_last = false leaves a last batch of " +
                     std::to_string(tail) +
                     " samples per rank and epoch, which it cannot run; set data.drop_last = true");
}

// The fixed init pipeline, place -> compile -> distribute (trainer/compile/pipeline.h), with
// autocast around tracing so that the casts are part of the graph.
void Trainer::Loop::compile_and_distribute() {
  const data::Batch first = splits_.train->get(std::vector<int64_t>(cfg_.train.batch_size, 0));
  const torch::Tensor& example = first.input;
  check_dropout(cfg_);
  std::optional<InductorRequest> inductor;
  if (cfg_.compile.mode == CompileMode::Inductor) {
    if (cb_.loss || cfg_.train.loss != "cross_entropy") {  // a C++ loss cannot be traced into the package
      if (cfg_.compile.fullgraph || python_)
        throw InputError(
            "compile.mode = \"inductor\" compiles keel's cross-entropy into the step; a custom loss "
            "(Callbacks::loss, train.loss) cannot be, and " +
            std::string(python_ ? "model.name = \"python\" runs only compiled"
                                : "compile.fullgraph = true makes that an error"));
      logging::warn(
          "compile.mode = \"inductor\": a custom loss (Callbacks::loss, train.loss) cannot be compiled into the step; "
          "training eager");
    } else {
      inductor = inductor_request(cfg_, *model_, device_, amp_, threads_, python_.get());
      inductor->seed_dir = package_seed_dir(cfg_.checkpoint);
    }
  }
  auto compile = [&] {
    return compile_on_every_rank(*coll_, [&] {
      faults_->signal(FaultPhase::Compile, 0);
      amp::Autocast ac(device_.type(), amp_.dtype, amp_.enabled);
      // The identity (which reads and hashes a TorchScript file) is needed only by the cache.
      const std::string identity =
          cfg_.compile.cache_dir.empty() || inductor ? "" : compile_identity(cfg_.model, cfg_.amp);
      return place(model_, device_).compile(cfg_.compile, example, identity, inductor ? &*inductor : nullptr);
    });
  };
  if (!inductor) {
    dmodel_.emplace(compile().distribute(mesh_.shared(dist::Axis::Dp), cfg_.dist));
    return;
  }
  try {
    dmodel_.emplace(compile().distribute(mesh_.shared(dist::Axis::Dp), cfg_.dist));
    if (python_) python_->attach(dmodel_->inductor_step(), /*evaluates=*/inductor->eval_batch > 0);
  } catch (const CompileError& e) {
    // With compile.fullgraph (or a Python module, which has no eager code to fall back to) a step
    // that cannot be captured whole is the user's model: exit 2.
    throw InputError(std::string(e.what()) +
                     (python_ ? " (model.name = \"python\" runs only compiled)" : " (compile.fullgraph = true)"));
  }
}

void Trainer::Loop::build_optimizer() {
  progress_.total_steps = cfg_.train.steps;
  if (cfg_.train.epochs > 0) {
    // train.steps' documented bound holds for the steps that epochs make, too.
    int64_t batches = 0;
    if (__builtin_mul_overflow(cfg_.train.epochs, sampler_->batches_per_epoch(), &batches) ||
        batches / cfg_.train.grad_accum > kMaxPlannedSteps)
      throw InputError("train.epochs = " + std::to_string(cfg_.train.epochs) + " makes more than " +
                       std::to_string(kMaxPlannedSteps) + " steps (" + std::to_string(sampler_->batches_per_epoch()) +
                       " batches per epoch); lower it or use train.steps");
    progress_.total_steps = std::max<int64_t>(1, batches / cfg_.train.grad_accum);
  }
  progress_.global_batch = cfg_.train.batch_size * cfg_.train.grad_accum * mesh_.dp();
  params_ = model_->parameters();
  for (const auto& [n, t] : dmodel_->owned_parameters()) owned_.push_back(t);
  optimizer_ = optimizer_choice_->make(owned_);
  // With a sharded optimizer state the checkpoint records who owns each parameter's state.
  optimizer_state_ = dmodel_->optimizer_state(*optimizer_, optimizer_choice_->codec());
  schedule_.emplace(cfg_.train, progress_.total_steps);
  // dist.consensus: late needs the fused kernel's found_inf (config.cpp refuses it without
  // train.fused_optimizer); auto takes it where the host would otherwise wait for a GPU.
  fused_ = dynamic_cast<FusedOptimizer*>(optimizer_.get());
  const Consensus mode = cfg_.dist.consensus;
  if (mode == Consensus::Late && !fused_)
    throw InputError("dist.consensus = \"late\" needs a fused optimizer (train.fused_optimizer = true)");
  late_ = fused_ &&
          (mode == Consensus::Late || (mode == Consensus::Auto && device_.is_cuda() && group_->backend() == "nccl"));
}

// Every component registers its own part of a checkpoint (checkpoint/stateful.h).
void Trainer::Loop::build_checkpointing() {
  if (cfg_.checkpoint.dir.empty()) return;
  auto own = [&](const char* name, std::unique_ptr<checkpoint::Stateful> c) {
    state_.add(name, *c);
    owned_state_.push_back(std::move(c));
  };
  own("model", dmodel_->model_state(
                   model_, models::is_hf_family(cfg_.model.name) ? models::hf_shape(cfg_.model).config : nullptr));
  state_.add("optimizer", *optimizer_state_);
  state_.add("progress", progress_);
  if (scaler_) state_.add("grad_scaler", *scaler_);
  own("rng", std::make_unique<RngState>(device_));
  own("user", std::make_unique<UserState>(cb_.save_state, cb_.load_state));
  if (cfg_.checkpoint.save_graph && cfg_.compile.mode == CompileMode::Inductor)
    own("graph", std::make_unique<PackageState>(dmodel_->inductor_step(), world_.is_main()));
  else if (cfg_.checkpoint.save_graph)
    own("graph",
        std::make_unique<GraphState>([this] { return export_traced_module(dmodel_->model()); }, world_.is_main()));
  state_.add("sampler", *sampler_);

  checkpoint::Options o;
  o.dir = cfg_.checkpoint.dir;
  o.keep = cfg_.checkpoint.keep;
  o.async = cfg_.checkpoint.async;
  o.config_sha256 = sha256_hex(dump_toml(cfg_));
  o.hooks = faults_->checkpoint_hooks();
  if (optimizer_state_->partitioned())  // each rank reads only its own parameters' state
    o.wants = [s = optimizer_state_.get()](const std::string& component, const std::string& n) {
      return component != "optimizer" || s->wants(n);
    };
  try {
    ckpt_ = std::make_unique<checkpoint::Checkpointer>(o, coll_);
  } catch (const checkpoint::SaveError& e) {
    throw InputError(e.what());  // checkpoint.dir cannot be a directory: the user's choice of path
  }
}

// Resumes from the newest committed step (or checkpoint.resume_from).
void Trainer::Loop::resume() {
  if (!ckpt_) return;
  std::optional<checkpoint::Loaded> loaded;
  try {
    loaded = ckpt_->load(cfg_.checkpoint.resume_from, [this](const checkpoint::Loaded& l) { return state_.check(l); });
  } catch (const checkpoint::ResumeError& e) {
    throw InputError(e.what());  // the step the user named; a failed peer or disk stays exit 1
  }
  notified_step_ = ckpt_->last_committed();
  if (!loaded) {
    logging::info("checkpoint: no committed step under {}; starting fresh", cfg_.checkpoint.dir);
    return;
  }
  state_.load(*loaded);  // dist.zero = 3: each rank takes its pieces of the parameters read (ModelState)
  resumed_from_ = loaded->step;
  logging::info("resumed from {} (step {} of {})", loaded->path, loaded->step, progress_.total_steps);
}

void Trainer::Loop::open_outputs() {
  if (world_.is_main()) {
    if (const std::string err = make_dirs(cfg_.run.dir); !err.empty()) throw InputError("run.dir: " + err);
    write_atomic(cfg_.run.dir + "/config.toml", dump_toml(cfg_));
  }
  RunMetrics::Options mo;
  mo.dir = cfg_.run.dir;
  mo.main = world_.is_main();
  mo.tensorboard = cfg_.run.tensorboard;
  mo.progress = cfg_.run.progress && ::isatty(STDOUT_FILENO);
  mo.log_interval = cfg_.train.log_interval;
  mo.world = world_.size;
  mo.resumed_from = resumed_from_;
  mo.steps_left = progress_.total_steps - progress_.steps_done;
  metrics_.open(mo);
  if (const auto range = parse_profile_steps(cfg_.run.profile_steps)) {
    // Every rank writes its own trace into run.dir (which, across hosts, may be its host's own).
    if (const std::string err = make_dirs(cfg_.run.dir); !err.empty()) throw InputError("run.dir: " + err);
    profiler_ = std::make_unique<StepProfiler>(
        range, cfg_.run.dir + "/trace.rank" + std::to_string(world_.rank) + ".json", device_);
  }
  logging::info("keel {} | LibTorch {} | {} threads | device {}", KEEL_VERSION, TORCH_VERSION, threads_, device_.str());
  logging::info(
      "model {} ({} parameters) | data {} ({} train, {} test) | {} steps of global batch {} "
      "({} per rank x {} accum x {} ranks), {} batches per epoch",
      model_->name(), num_parameters_, cfg_.data.name, splits_.train->size(), splits_.test ? splits_.test->size() : 0,
      progress_.total_steps, progress_.global_batch, cfg_.train.batch_size, cfg_.train.grad_accum, world_.size,
      sampler_->batches_per_epoch());
  if (const double flops = model_->train_flops_per_sample(); flops > 0) {
    const bool given = cfg_.run.peak_tflops > 0;
    const double peak = given ? cfg_.run.peak_tflops : measure_peak_tflops(device_, amp_);
    metrics_.set_mfu(flops, peak, progress_.global_batch, world_.size);
    logging::info("MFU against a peak of {:.3g} TFLOP/s per rank ({}); the model: {:.3g} GFLOP per sample", peak,
                  given ? "run.peak_tflops" : "measured: a square matrix multiply on " + device_.str(), flops / 1e9);
  }
}

// ---------------------------------------------------------------------------------------------
// The loop.
// ---------------------------------------------------------------------------------------------
Summary Trainer::Loop::run() {
  {
    traffic_at_loop_ = control_traffic();
    steps_at_loop_ = progress_.steps_done;
    try {
      std::optional<InFlight> late;  // dist.consensus = late: the step the host has not read yet
      for (int64_t step = progress_.steps_done + 1; step <= progress_.total_steps; ++step) {
        // run.sync_debug: from step 6 (warm-up done: the allocators' pools, the scale moved to
        // the device), except the steps the host must see (evaluation, checkpoints, the last).
        std::optional<SyncDebugScope> sync_debug;
        if (device_.is_cuda() && step - steps_at_loop_ > 5 && !needs_host(step))
          sync_debug.emplace(cfg_.run.sync_debug);
        InFlight cur = begin_step(step);
        if (late) {  // read one step late, before this step's update
          finish_step(*late, cur.t0);
          late.reset();
        }
        apply_update(cur);
        if (late_ && !stop_requested_ && !needs_host(step)) {
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
  }
  finish();
  // summary.json while this job still holds run.dir's lock.
  Summary s = summary();
  if (world_.is_main()) write_atomic(cfg_.run.dir + "/summary.json", s.to_json().dump(2) + "\n");
  return s;
}

// A step's start: data, forward, backward (gradients all-reduced on the last micro-batch),
// unscale and this rank's verdict, then the cross-rank consensus exchanged (one all-gather) and,
// with dist.consensus = step, read at once.
InFlight Trainer::Loop::begin_step(int64_t step) {
  InFlight f;
  f.t0 = Clock::now();
  StepResult& r = f.r;
  r.step = current_step_ = step;
  if (profiler_) profiler_->before_step(r.step);
  coll_->set_step(r.step);
  mesh_.set_step(r.step);
  r.lr = schedule_->at(r.step - 1);
  set_lr(*optimizer_, r.lr);
  const torch::Tensor loss = forward_backward(late_ ? nullptr : &r.local_loss);
  r.epoch = sampler_->position().epoch;
  faults_->after_backward(r.step, owned_);
  // The verdict on the device (late), or read now (step: the host decides, as cheaply as it can).
  torch::Tensor nonfinite;
  bool nonfinite_now = false;
  if (late_) {
    nonfinite = local_nonfinite(loss);
  } else {
    nonfinite_now = local_nonfinite_now(r.local_loss);
  }
  faults_->before_consensus(r.step, *coll_);
  const double compute_ms = ms_since(f.t0);
  uint32_t flags = 0;
  if (g_stop_signal.load()) flags |= kFlagStop;
  if (ckpt_ && ckpt_->pending() && ckpt_->write_finished()) flags |= kFlagCheckpointWritten;
  // One all-gather per step: every rank is at this step with the same gradient plan, the
  // mean loss, and whether any rank saw inf/NaN (then no rank steps).
  {
    RECORD_USER_SCOPE("keel::consensus");
    if (late_) {
      f.record = coll_->exchange_step(r.step, dmodel_->plan(), loss, nonfinite, compute_ms, flags);
    } else {
      r.consensus = coll_->step_sync(r.step, dmodel_->plan(), r.local_loss, nonfinite_now, compute_ms, flags);
      resolve_step(f);
    }
  }
  return f;
}

// The consensus read: the same loss, verdict and flags on every rank, or CollectiveMismatch.
void Trainer::Loop::resolve_step(InFlight& f) {
  StepResult& r = f.r;
  if (f.record) r.consensus = coll_->resolve(f.record, &r.local_loss);  // else: step_sync's already
  // An async checkpoint is committed once every rank has written its share.
  if (ckpt_ && ckpt_->pending() && (r.consensus.all_flags & kFlagCheckpointWritten)) {
    SyncDebugScope pause(SyncDebug::Off, /*pause=*/true);  // the commit's agreement waits, rarely
    ckpt_->commit();
    notify_checkpoint();
  }
  r.loss = r.consensus.mean_loss;
  r.skipped = r.consensus.any_nonfinite;
  r.stop = (r.consensus.any_flags & kFlagStop) != 0;
  if (world_.is_main()) metrics_.observe_ranks(r.consensus.rank_compute_ms);
  if (r.skipped && !scaler_ && !cfg_.train.skip_nonfinite)
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
  if (r.skipped) {
    ++progress_.skipped_steps;
    logging::warn("step {}: inf/NaN on some rank; every rank skips this update{}", r.step,
                  scaler_ ? fmt::format(" (loss scale {} -> {})", r.loss_scale_before, r.loss_scale) : std::string());
  }
  r.step_ms = next_t0 ? std::chrono::duration<double, std::milli>(*next_t0 - f.t0).count() : ms_since(f.t0);
  progress_.steps_done = r.step;
  progress_.last_loss = r.loss;
  metrics_.step_time(r.step_ms);
  const std::optional<EvalResult> eval = maybe_evaluate(r.step);
  log_step(r, eval);
  maybe_checkpoint(r.step);
  if (r.stop) stop_requested_ = true;
}

// Steps whose end the host must see before the next begins: evaluation and checkpoint steps, the
// last, and the loop's first (a rank that disagrees on the gradient plan, e.g. another number of
// micro-batches, is named before a second step's buckets are all-reduced).
bool Trainer::Loop::needs_host(int64_t step) const {
  const int64_t e = cfg_.train.eval_interval, c = cfg_.checkpoint.interval;
  return step == progress_.total_steps || step == steps_at_loop_ + 1 || (e > 0 && step % e == 0) ||
         (ckpt_ && c > 0 && step % c == 0);
}

// Forward and backward over the step's micro-batches; returns this rank's mean loss, a float64
// tensor of one element on the device (nothing is read by the host), or, given `loss_now`, reads
// it into *loss_now (the sum in double, as the tensor's) and returns nothing.
torch::Tensor Trainer::Loop::forward_backward(double* loss_now) {
  zero_grads(params_);
  dmodel_->zero_gradient_shards();
  torch::Tensor loss_sum;
  double host_sum = 0;
  for (int64_t micro = 0; micro < cfg_.train.grad_accum; ++micro) {
    // Gradients are all-reduced only on the last micro-batch of the step.
    const bool sync = micro + 1 == cfg_.train.grad_accum;
    data::Batch b = splits_.train->get(sampler_->next());
    torch::Tensor loss;
    {
      RECORD_USER_SCOPE("keel::forward");
      // On a GPU through pinned memory, without making the host wait for the copy.
      const torch::Tensor input = to_device(b.input), target = to_device(b.target);
      // compile.mode = "inductor": forward, loss and backward in one compiled package.
      if (auto compiled =
              dmodel_->compiled_loss(input, target, sync, scaler_ ? scaler_->scale_tensor() : torch::Tensor())) {
        loss = *compiled;
      } else {
        amp::Autocast ac(device_.type(), amp_.dtype, amp_.enabled);
        auto out = dmodel_->forward(input, sync, /*step=*/true);
        loss = loss_(out, target).to(torch::kFloat);
      }
    }
    auto scaled = loss / static_cast<double>(cfg_.train.grad_accum);
    {
      RECORD_USER_SCOPE("keel::backward");  // with the Reducer's gradient all-reduces on the last micro-batch
      dmodel_->backward(scaler_ ? scaler_->scale(scaled) : scaled, sync);
    }
    if (loss_now) {
      host_sum += loss.item<double>();
    } else {
      const torch::Tensor l = loss.detach().to(torch::kDouble).reshape({1});
      loss_sum = loss_sum.defined() ? loss_sum + l : l;
    }
  }
  if (loss_now) {
    *loss_now = host_sum / static_cast<double>(cfg_.train.grad_accum);
    return {};
  }
  return loss_sum / static_cast<double>(cfg_.train.grad_accum);
}

torch::Tensor Trainer::Loop::to_device(const torch::Tensor& t) const {
  if (device_.is_cpu() || !t.device().is_cpu()) return t.to(device_);
  return (t.is_pinned() ? t : t.pin_memory()).to(torch::TensorOptions().device(device_), /*non_blocking=*/true);
}

// This rank's verdict on its gradients, after unscaling (before clipping): a float32 tensor of one
// element on their device, 1 = inf/NaN; undefined when nothing asks to look (no loss scaling,
// train.skip_nonfinite off, no fault watching them). With dist.zero >= 1 a rank reads only the
// gradients it owns; the consensus ORs the verdicts.
torch::Tensor Trainer::Loop::grad_verdict() {
  if (scaler_) return scaler_->unscale_on_device(owned_);
  if (cfg_.train.skip_nonfinite || faults_->watches_gradients()) return amp::nonfinite(owned_);
  return {};
}

// The verdict on the loss and the gradients, on the device (dist.consensus = late).
torch::Tensor Trainer::Loop::local_nonfinite(const torch::Tensor& local_loss) {
  const torch::Tensor bad = local_loss.isfinite().logical_not().to(torch::kFloat).reshape({1});
  const torch::Tensor grads = grad_verdict();
  return grads.defined() ? torch::maximum(grads.to(bad.device()), bad) : bad;
}

// The same verdict, read by the host (dist.consensus = step).
bool Trainer::Loop::local_nonfinite_now(double local_loss) {
  const torch::Tensor grads = grad_verdict();
  return (grads.defined() && grads.item<float>() != 0) || !std::isfinite(local_loss);
}

// Clip and step, or skip on every rank. With dist.consensus = late the skip is decided on the
// device (the consensus' found_inf feeds the fused kernel and the GradScaler) and the step's
// grad norm and loss scales are copied to the host behind an event, read when the step
// finishes; otherwise the host has read the consensus already and decides.
void Trainer::Loop::apply_update(InFlight& f) {
  RECORD_USER_SCOPE("keel::optimizer");
  StepResult& r = f.r;
  if (!late_) {
    if (!r.skipped) {
      if (cfg_.train.grad_clip > 0) r.grad_norm = dmodel_->clip_grad_norm(cfg_.train.grad_clip).item<double>();
      optimizer_->step();
      dmodel_->sync_parameters();  // dist.zero >= 1: each owner's update to every rank
    }
    if (scaler_) {
      if (r.skipped) r.loss_scale_before = scaler_->scale_value();  // for the skip's warning only
      scaler_->update(r.skipped);
      r.loss_scale = scaler_->scale_value();
    }
  } else {
    const torch::Device dev = params_.front().device();
    const auto nan = torch::full({1}, std::nan(""), torch::TensorOptions().dtype(torch::kDouble).device(dev));
    const torch::Tensor found = f.record.found_inf().to(dev);
    torch::Tensor norm = nan;
    if (cfg_.train.grad_clip > 0)  // NaN on a skipped step, as when the host decides
      norm =
          torch::where(found.ne(0), nan, dmodel_->clip_grad_norm(cfg_.train.grad_clip).to(torch::kDouble).reshape({1}));
    const torch::Tensor scale_before = scaler_ ? scaler_->scale_tensor().to(dev, torch::kDouble).reshape({1}) : nan;
    fused_->step_unless(found);
    dmodel_->sync_parameters();  // dist.zero >= 1: each owner's update (or its old values) to every rank
    if (scaler_) scaler_->update(found);
    const torch::Tensor scale_after = scaler_ ? scaler_->scale_tensor().to(dev, torch::kDouble).reshape({1}) : nan;
    f.extras = HostCopy::start(torch::cat({norm, scale_before, scale_after}));
  }
  if (profiler_) profiler_->after_step(r.step);
}

std::optional<EvalResult> Trainer::Loop::maybe_evaluate(int64_t step) {
  const int64_t every = cfg_.train.eval_interval;
  if (every <= 0 || (step % every != 0 && step != progress_.total_steps)) return std::nullopt;
  last_eval_ = evaluate(step);
  logging::info("eval step {}: test_loss {:.4f} test_accuracy {:.4f} ({} {})", step, last_eval_->loss,
                last_eval_->accuracy, last_eval_->count,
                spec_.kind == models::InputKind::Tokens ? "tokens" : "samples");
  if (cb_.on_eval) cb_.on_eval(*last_eval_);
  return last_eval_;
}

// Loss (and, with the default loss, top-1 accuracy) over the test split, each data-parallel rank
// taking every dp-th sample; totals are summed over the dp axis.
EvalResult Trainer::Loop::evaluate(int64_t step) {
  EvalResult r;
  r.step = step;
  if (!splits_.test) return r;
  faults_->signal(FaultPhase::Eval, step);
  dmodel_->sync_buffers();  // every rank evaluates rank 0's model
  torch::NoGradGuard no_grad;
  model_->train(false);
  const bool classifier = !cb_.loss && cfg_.train.loss == "cross_entropy";
  double loss_sum = 0, correct = 0, count = 0;
  const int64_t n =
      cfg_.data.eval_samples > 0 ? std::min(splits_.test->size(), cfg_.data.eval_samples) : splits_.test->size();
  std::vector<std::vector<int64_t>> batches(1);
  for (int64_t i = mesh_.dp_rank(); i < n; i += mesh_.dp()) {
    batches.back().push_back(i);
    if (static_cast<int64_t>(batches.back().size()) == cfg_.data.eval_batch_size && i + mesh_.dp() < n)
      batches.emplace_back();
  }
  if (batches.back().empty()) batches.pop_back();
  // dist.zero = 3: each block is gathered around its call, as in training, so every rank runs
  // as many forwards as the rank with the most batches (one more all-reduce; the extra ones
  // are discarded), and no rank holds the whole model.
  const int64_t rounds = dmodel_->evaluation_rounds(static_cast<int64_t>(batches.size()));
  for (int64_t k = 0; k < rounds; ++k) {
    const bool real = k < static_cast<int64_t>(batches.size());
    auto b = splits_.test->get(real ? batches[static_cast<size_t>(k)] : std::vector<int64_t>{0});
    auto out = dmodel_->evaluation_forward(b.input.to(device_), *model_);
    if (!real) continue;
    auto target = b.target.to(device_);
    if (classifier) {
      auto flat = out.reshape({-1, out.size(-1)});
      auto t = target.reshape({-1});
      loss_sum += torch::nn::functional::cross_entropy(
                      flat, t, torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum))
                      .item<double>();
      correct += static_cast<double>(flat.argmax(1).eq(t).sum().item<int64_t>());
      count += static_cast<double>(t.numel());
    } else {
      const auto rows = static_cast<double>(out.size(0));
      loss_sum += loss_(out, target).item<double>() * rows;
      count += rows;
    }
  }
  model_->train(true);
  dmodel_->end_evaluation();
  auto totals = torch::tensor({loss_sum, correct, count}, torch::kDouble);
  mesh_.on(dist::Axis::Dp).all_reduce(totals, dist::ReduceOp::Sum, "evaluation totals");
  loss_sum = totals[0].item<double>();
  correct = totals[1].item<double>();
  count = totals[2].item<double>();
  r.loss = count > 0 ? loss_sum / count : std::nan("");
  r.accuracy = count > 0 && classifier ? correct / count : std::nan("");
  r.count = static_cast<int64_t>(count);
  return r;
}

// The step's scalars, each once: its metrics.jsonl key and its TensorBoard tag.
StepRecord Trainer::Loop::step_record(const StepResult& r, const std::optional<EvalResult>& eval) const {
  StepRecord rec;
  rec.step = r.step;
  const double samples_per_s = progress_.global_batch * 1000.0 / r.step_ms;
  rec.add("loss", "train/loss", r.loss)
      .add("lr", "train/lr", r.lr)
      .add("step_ms", "train/step_ms", r.step_ms)
      .add("samples_per_s", "train/samples_per_s", samples_per_s)
      .add("epoch", "", r.epoch)
      .add("", "train/skipped_steps", progress_.skipped_steps);
  if (spec_.kind == models::InputKind::Tokens)
    rec.add("tokens_per_s", "train/tokens_per_s", samples_per_s * static_cast<double>(spec_.sample_shape.at(0)));
  if (scaler_) rec.add("loss_scale", "train/loss_scale", r.loss_scale);
  if (cfg_.train.grad_clip > 0) rec.add("grad_norm", "train/grad_norm", r.grad_norm);
  if (r.skipped) rec.add("skipped", "", true);
  const auto& c = r.consensus.rank_compute_ms;
  if (world_.size > 1) rec.add("rank_compute_ms", "", c);
  if (c.size() > 1) {  // how far apart the ranks' forward+backward times are: stragglers
    const auto [lo, hi] = std::minmax_element(c.begin(), c.end());
    rec.add("", "dist/rank_compute_spread_ms", *hi - *lo);
  }
  if (eval) rec.add("test_loss", "eval/loss", eval->loss).add("test_accuracy", "eval/accuracy", eval->accuracy);
  return rec;
}

// One record of the step feeds metrics.jsonl, TensorBoard, the progress and log lines
// (RunMetrics), and Callbacks::on_step.
void Trainer::Loop::log_step(const StepResult& r, const std::optional<EvalResult>& eval) {
  StepRecord rec = step_record(r, eval);
  metrics_.record(rec, progress_.total_steps);
  if (cb_.on_step) cb_.on_step(StepInfo{r.step, r.loss, r.lr, r.step_ms, rec.number("samples_per_s")});
}

// checkpoint.interval: a save every `interval` steps (the final one is finish()'s).
void Trainer::Loop::maybe_checkpoint(int64_t step) {
  const int64_t every = cfg_.checkpoint.interval;
  if (ckpt_ && every > 0 && step % every == 0 && step < progress_.total_steps) save_checkpoint(step);
}

void Trainer::Loop::save_checkpoint(int64_t step) {
  dmodel_->sync_buffers();  // the buffers saved are rank 0's, whichever rank writes them
  // dist.zero = 3: the model stays sharded; each rank writes the whole parameters it owns
  // (ModelState, one unit gathered at a time) and their optimizer state (whole parameters', by
  // owner).
  ckpt_->save(step, state_.save());
  checkpoint_stall_ms_ += ckpt_->last_save_blocking_ms();
  notify_checkpoint();
}

// Callbacks::on_checkpoint, once per newly committed step.
void Trainer::Loop::notify_checkpoint() {
  if (!ckpt_ || ckpt_->last_committed() == notified_step_) return;
  notified_step_ = ckpt_->last_committed();
  if (cb_.on_checkpoint)
    cb_.on_checkpoint(notified_step_, cfg_.checkpoint.dir + "/step_" + std::to_string(notified_step_));
}

// Out of memory (injected or real): say where, how much, and what survives.
std::runtime_error Trainer::Loop::out_of_memory(const std::string& what, bool committed_step) const {
  const std::string where = "out of memory at step " +
                            std::to_string(std::max(current_step_, progress_.steps_done + 1)) + " on rank " +
                            std::to_string(world_.rank);
  if (!committed_step) return std::runtime_error(where + " (" + what + "); lower train.batch_size");
  return std::runtime_error(where + ": " + what + "; the last committed checkpoint is " +
                            (ckpt_ && ckpt_->last_committed() >= 0
                                 ? "step " + std::to_string(ckpt_->last_committed()) + " (intact)"
                                 : std::string("none")) +
                            "; lower train.batch_size or use train.grad_accum");
}

// After the loop: the evaluation of a run resumed at its end, the final checkpoint (also after
// a stop signal) and its commit, and leaving together.
void Trainer::Loop::finish() {
  metrics_.finish();
  const int64_t done = progress_.steps_done;
  if (metrics_.steps_timed() == 0 && done >= progress_.total_steps) {
    logging::info("checkpoint step {} is the end of this run ({} steps): nothing to train", done,
                  progress_.total_steps);
    if (cfg_.train.eval_interval > 0) {
      last_eval_ = evaluate(done);
      if (cb_.on_eval) cb_.on_eval(*last_eval_);
    }
  }
  if (ckpt_) {
    if (done > 0 && done != ckpt_->last_committed()) save_checkpoint(done);
    ckpt_->finish();
    notify_checkpoint();
  }
  if (profiler_) profiler_->finish();
  dmodel_->sync_buffers();  // every rank ends with rank 0's model
  // dist.zero = 3: the whole model, gathered for on_end only (on every rank when one rank has it:
  // the gathers are collective; stage 2's parameters are whole).
  dmodel_->hold_whole_model(bool(cb_.on_end));
  if (cb_.on_end) cb_.on_end(*model_);
  // Every rank leaves with the same verdict: the signal a rank received (the one that stopped
  // the loop, or one that came after the last step's consensus: evaluation, the final save,
  // on_end) stops every rank with 128+N. This all-reduce is also the barrier before leaving: a
  // rank that tears down its connections while a peer still uses them makes the peer's Gloo
  // threads fail.
  auto signo = torch::tensor({static_cast<int64_t>(g_stop_signal.load())}, torch::kLong);
  coll_->all_reduce(signo, dist::ReduceOp::Max, "end of training (stop signal)");
  stop_signal_ = static_cast<int>(signo.item<int64_t>());
  if (stopped_ && !stop_signal_) stop_signal_ = SIGTERM;  // request_stop(0): still a stop
  if (stop_signal_)
    logging::warn("stopped by signal {} after step {} of {}", stop_signal_, done, progress_.total_steps);
}

Summary Trainer::Loop::summary() const {
  Summary s;
  s.keel_version = KEEL_VERSION;
  s.torch_version = TORCH_VERSION;
  s.run_name = cfg_.run.name;
  s.model = model_->name();
  s.num_parameters = num_parameters_;
  s.data = cfg_.data.name;
  s.device = device_.str();
  s.world_size = world_.size;
  s.launcher = dist::launcher_name(world_.launcher);
  s.backend = group_->backend();
  s.restart_count = world_.restart_count;
  s.metrics_lines_lost = metrics_.lines_lost();
  s.threads_per_rank = threads_;
  s.batch_size = cfg_.train.batch_size;
  s.grad_accum = cfg_.train.grad_accum;
  s.global_batch = progress_.global_batch;
  s.steps = progress_.steps_done;
  s.planned_steps = progress_.total_steps;
  s.completed = s.steps == s.planned_steps && !stop_signal_;
  if (stop_signal_) s.stop_signal = stop_signal_;
  s.median_step_ms = metrics_.median_step_ms();  // the first 5 steps (warm-up) excluded
  s.samples_per_s = s.global_batch * 1000.0 / s.median_step_ms;
  if (spec_.kind == models::InputKind::Tokens) s.tokens_per_s = s.samples_per_s * spec_.sample_shape.at(0);
  s.final_loss = progress_.last_loss;
  s.wall_s = ms_since(t_start_) / 1000.0;
  const CompileReport& cr = dmodel_->compile_report();
  s.compile_mode = cr.mode;
  s.compile_ms = cr.compile_ms;
  s.compile_cache = cr.cache;
  s.recompiles = cr.recompiles;
  s.amp_dtype = choice_name(kAmpDtypes, cfg_.amp.dtype);
  s.consensus = late_ ? "late" : "step";
  if (scaler_) s.loss_scale = scaler_->scale_value();
  s.skipped_steps = progress_.skipped_steps;
  s.resumed_from_step = resumed_from_;
  if (ckpt_ && ckpt_->last_committed() >= 0) s.checkpoint_step = ckpt_->last_committed();
  s.checkpoint_stall_ms = checkpoint_stall_ms_;
  const auto held = dmodel_->residency(*model_);
  s.zero = held.zero;
  s.parameter_bytes = held.parameter_bytes;
  s.gradient_bytes = held.gradient_bytes;
  s.optimizer_state_bytes = optimizer_state_->state_bytes();
#ifdef KEEL_WITH_CUDA
  if (device_.is_cuda()) {
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device_.index());
    const auto aggregate = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
    s.peak_device_memory_mb = static_cast<double>(stats.allocated_bytes[aggregate].peak) / (1024.0 * 1024.0);
  }
#endif
  {
    struct rusage ru {};
    if (::getrusage(RUSAGE_SELF, &ru) == 0) s.peak_rss_mb = static_cast<double>(ru.ru_maxrss) / 1024.0;  // KiB on Linux
  }
  s.rendezvous_ms = rendezvous_ms_;
  s.eta_s = metrics_.eta_s();
  s.mfu = metrics_.mfu();
  if (metrics_.peak_tflops() > 0) s.peak_tflops = metrics_.peak_tflops();
  const dist::TrafficStats t = control_traffic() - traffic_at_loop_;
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

Trainer::Trainer(Config cfg, dist::World world, Callbacks callbacks)
    : cfg_(std::move(cfg)), world_(std::move(world)), callbacks_(std::move(callbacks)) {}

Trainer::~Trainer() = default;

Summary Trainer::run() {
  StopSignals signals;  // until summary.json is written
  Summary s = Loop(cfg_, world_, callbacks_).run();
  // A signal after the job's last agreement (while summary.json was written): the checkpoint is
  // committed and the summary written; this rank still exits 128+N.
  if (!s.stop_signal && g_stop_signal.load()) s.stop_signal = g_stop_signal.load();
  logging::info("done: {} steps, median {:.2f} ms/step, final loss {:.4f}{}", s.steps, s.median_step_ms, s.final_loss,
                s.test_accuracy ? fmt::format(", test accuracy {:.4f}", *s.test_accuracy) : std::string());
  return s;
}

}  // namespace keel
