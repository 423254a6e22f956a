#include "trainer/run.h"
#include "trainer/config/pipeline.h"

#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <string>

#include <ATen/CPUGeneratorImpl.h>

#include "amp/autocast.h"
#include "checkpoint/weights.h"
#include "common/clock.h"
#include "common/log.h"
#include "common/stop.h"
#include "common/tensor_memory.h"
#include "dist/placement.h"
#include "dist/tp_ops.h"
#include "keel/common/error.h"
#include "models/deferred_init.h"
#include "models/hf.h"
#include "trainer/app/log.h"
#include "trainer/compile/inductor.h"
#include "trainer/compile/packaging.h"
#include "trainer/config/limits.h"
#include "trainer/rank_agreement.h"
#include "trainer/signals.h"

namespace keel {
namespace {

// train.steps' documented maximum (trainer/config/schema.cpp).
constexpr int64_t kMaxPlannedSteps = 1'000'000'000'000;

dist::Recompute recompute_policy(ActivationCheckpointing ac) {
  switch (ac) {
    case ActivationCheckpointing::Blocks:
      return dist::Recompute::Blocks;
    case ActivationCheckpointing::Selective:
      return dist::Recompute::Selective;
    case ActivationCheckpointing::None:
      break;
  }
  return dist::Recompute::None;
}

}  // namespace

Run::Run(const Config& cfg, const dist::World& world, const Callbacks& cb, dist::FlightRecorder* flight)
    : job(cfg, world, cb) {
  job.flight = flight;
  dist::PhaseScope setup(dist::Phase::Setup);
  net.loss = cb.loss ? cb.loss : losses().get(cfg.train.loss);
  if (job.classifier())  // the default loss, with train.ignore_index
    net.loss = [ignore = job.cfg.train.ignore_index](const torch::Tensor& logits, const torch::Tensor& target) {
      return cross_entropy(logits, target, ignore);
    };
  init_logging(job.cfg.run, job.world.rank, job.world.size);
  tune_allocator();
  if (job.cfg.run.count_tensor_memory) count_tensor_memory();
  job.threads = set_threads(job.cfg.run, job.world);
  torch::manual_seed(static_cast<uint64_t>(job.cfg.run.seed));
  job.device = resolve_device(job.cfg.run, job.world);
  const auto t_rdzv = Clock::now();
  {
    AtRendezvous at_rendezvous;
    job.group = dist::Group::create(job.world, job.cfg.dist, job.device);
    agree_on_config(job.group, job.cfg);  // before the first collective
  }
  job.rendezvous_ms = ms_since(t_rdzv);
  job.coll = std::make_shared<dist::Collectives>(job.group, job.cfg.dist.validate);
  build_mesh();
  optimizer_choice.emplace(resolve_optimizer(job.cfg.train));  // an unknown or unusable one stops the run here
  lock_directories();
  check_memory_needs();
  build_model_and_data();
  compile_and_distribute();
  build_optimizer();
}

// parallel.pp > 1 composes, so far, with data parallelism (DDP, ZeRO 1-3), tensor and sequence
// parallelism, checkpoints (whole tensors, dist/stage_checkpoint.h) and compile.mode = "inductor"
// (each block compiled); the rest is refused by name (exit 2) until it is built.
void Run::refuse_what_pipelines_do_not_serve_yet() const {
  auto refuse = [&](bool set, const std::string& what) {
    if (set)
      throw InputError("parallel.pp = " + std::to_string(job.mesh.pp()) + " cannot be combined with " + what +
                       " yet (pipeline parallelism runs eager, or with each block compiled)");
  };
  refuse(job.cfg.dist.comm_hook != CommHook::Allreduce,
         "dist.comm_hook = \"" + std::string(choice_name(kCommHooks, job.cfg.dist.comm_hook)) + "\"");
  refuse(job.cfg.compile.mode == CompileMode::Trace, "compile.mode = \"trace\"");
  refuse(job.cfg.compile.cuda_graphs, "compile.cuda_graphs = true");
}

// [parallel]: the world as a mesh, each axis's Collectives made (collective: the subgroups).
void Run::build_mesh() {
  const ParallelConfig& p = job.cfg.parallel;
  const int64_t pp_tp = p.pp * p.tp;
  const std::string pp = p.pp > 1 ? "parallel.pp = " + std::to_string(p.pp) + " x " : "";
  if (p.dp == 0 && job.world.size % pp_tp != 0)
    throw InputError(pp + "parallel.tp = " + std::to_string(p.tp) + " must divide the world size " +
                     std::to_string(job.world.size) + " (parallel.dp = 0 takes what " + (p.pp > 1 ? "pp and " : "") +
                     "tp leaves)");
  try {
    job.mesh = dist::Mesh::build(job.world, dist::MeshShape{p.pp, p.dp, p.tp});
  } catch (const InputError&) {
    const int64_t dp = p.dp > 0 ? p.dp : job.world.size / pp_tp;
    throw InputError(pp + "parallel.dp = " + std::to_string(dp) +
                     (p.dp > 0   ? ""
                      : p.pp > 1 ? " (world / (pp x tp))"
                                 : " (world / parallel.tp)") +
                     " x parallel.tp = " + std::to_string(p.tp) + " is " + std::to_string(p.pp * dp * p.tp) +
                     " ranks; the world has " + std::to_string(job.world.size) + ": make their product the world size");
  }
  if (job.mesh.pp() > 1) refuse_what_pipelines_do_not_serve_yet();
  job.mesh.connect(job.coll, job.cfg.dist.validate);
  if (job.flight) {
    job.flight->install(job.mesh);
    // (weak: the world's group goes with the run, before the recorder)
    job.flight->watch_peers([coll = std::weak_ptr<dist::Collectives>(job.coll)]() -> std::optional<std::string> {
      const auto c = coll.lock();
      // A fresh, bounded connection first: a store op to a host cut off blocks (TwoNode.partition).
      if (!c || !c->group()->store_reachable(std::chrono::milliseconds(1000))) return std::nullopt;
      return c->peer_failure();
    });
  }
  if (job.mesh.tp() == 1) return;
  if (job.cb.loss)
    throw InputError("parallel.tp = " + std::to_string(job.mesh.tp()) +
                     " computes the loss over vocabulary shards; a custom loss (Callbacks::loss) cannot be");
  // The cross-entropy over this rank's vocabulary columns of the logits (dist/tp_ops.h).
  net.loss = [this](const torch::Tensor& logits, const torch::Tensor& target) {
    return dist::tp::vocab_parallel_cross_entropy(logits, target, net.vocab_range(job.mesh),
                                                  job.mesh.on(dist::Axis::Tp), job.cfg.train.ignore_index);
  };
}

dist::tp::VocabRange ModelParts::vocab_range(const dist::Mesh& mesh) const {
  return dist::tp::VocabRange::of(spec.num_classes, mesh.tp(), mesh.coordinate(dist::Axis::Tp));
}

void Run::lock_directories() {
  std::string error;
  if (job.world.is_main()) {
    char host[256] = {0};
    ::gethostname(host, sizeof host - 1);
    const std::string who = "keel run \"" + job.cfg.run.name + "\" (pid " + std::to_string(::getpid()) + " on " + host +
                            ", " + std::to_string(job.world.size) + " rank(s))";
    auto take = [&](DirLock& lock, const std::string& key, const std::string& dir) {
      if (!error.empty() || dir.empty()) return;
      const std::string why = lock.try_lock(dir, who);
      if (why.rfind("held by ", 0) == 0)
        error = key + " = \"" + dir + "\" is in use by another run: its lock (" + dir + "/.keel.lock) is " + why +
                "; wait for it to end, or give this run another " + key;
      else if (!why.empty())
        error = key + ": " + why;
    };
    take(run_dir_lock, "run.dir", job.cfg.run.dir);
    std::error_code ec1;
    const bool same = !job.cfg.checkpoint.dir.empty() &&
                      std::filesystem::equivalent(job.cfg.run.dir, job.cfg.checkpoint.dir, ec1) && !ec1;
    if (!same) take(checkpoint_dir_lock, "checkpoint.dir", job.cfg.checkpoint.dir);
  }
  if (const dist::RankError e = dist::first_error(*job.coll, error, "directory locks"))
    throw InputError(e.rank == job.world.rank ? e.message : "rank " + std::to_string(e.rank) + ": " + e.message);
}

// What the model, one micro-batch and the data need, from the config alone (trainer/config/limits.h):
// exit 2 on every rank naming the keys and the sizes, before any of it is allocated.
void Run::check_memory_needs() {
  std::string problem;
  if (const auto host = available_memory_bytes())
    problem = memory_problem(job.cfg, job.mesh.dp(), job.world.local_size, job.device.is_cuda(), *host,
                             job.device.is_cuda() ? device_free_bytes(job.device.index()) : std::nullopt);
  if (const dist::RankError e = dist::first_error(*job.coll, problem, "memory estimate"))
    throw InputError(e.rank == job.world.rank ? e.message : "rank " + std::to_string(e.rank) + ": " + e.message);
}

// The model (and compile.libraries, which a Python module's packaging needs), agreed: a rank that
// cannot build it (a file or library missing on its host, another Python there) fails every rank
// together, each naming that rank and its reason, instead of leaving the others to a lost peer.
std::shared_ptr<models::Model> Run::build_model_on_every_rank(std::optional<models::InputKind> data_kind) {
  std::shared_ptr<models::Model> built;
  std::string error;
  bool input = true;  // the user's input (exit 2) or not (exit 1)
  try {
    aot::load_libraries(job.cfg.compile.libraries);
    built = make_model(job.cfg, data_kind);
  } catch (const InputError& e) {
    error = e.what();
  } catch (const Stopped&) {
    throw;  // a stop signal ended a wait (the compile cache's lock): every rank got it
  } catch (const std::exception& e) {
    error = e.what();
    input = false;
  }
  if (const dist::RankError e =
          dist::first_error(*job.coll, error.empty() ? "" : (input ? "2" : "1") + error, "model")) {
    const std::string why =
        (e.rank == job.world.rank ? "" : "rank " + std::to_string(e.rank) + ": ") + e.message.substr(1);
    if (e.message[0] == '2') throw InputError(why);
    throw std::runtime_error(why);
  }
  return built;
}

void Run::build_model_and_data() {
  // The data's native input kind is asked first so that an unknown dataset is reported before
  // a model is built.
  const auto data_kind = data::native_input_kind(job.cfg.data.name);
  rss_before_model_mib = peak_resident_mib();
  if (builds_sharded(job.cfg)) deferred = std::make_shared<models::DeferredInit>();
  {
    models::DeferredInit::Use use(deferred.get());
    net.model = build_model_on_every_rank(data_kind);
  }
  if (deferred && deferred->empty()) deferred.reset();
  if (deferred) check_generators_agree();
  net.num_parameters = net.model->num_parameters();  // (dist.zero = 3 empties the model's own between steps)
  net.python = std::dynamic_pointer_cast<PythonModel>(net.model);
  if (!job.cfg.model.init_from.empty()) {  // before placement and DDP's broadcast; a resume overrides it
    // The Hugging Face families read transformers' files under their older names too.
    const int64_t n = checkpoint::load_weights(*net.model, job.cfg.model.init_from,
                                               models::is_hf_family(job.cfg.model.name)
                                                   ? models::hf_tensor_rename(models::hf_shape(job.cfg.model))
                                                   : checkpoint::TensorRename{},
                                               deferred.get());
    logging::info("model: {} tensors from {} (model.init_from)", n, job.cfg.model.init_from);
  }
  net.spec = net.model->input_spec();
  data.splits = data::create_dataset(job.cfg.data, net.spec, job.cfg.run.seed);
  net.model->train(true);
  net.amp = AmpContext::resolve(job.cfg.amp, job.device);
  job.faults = std::make_unique<FaultInjector>(job.cfg.fault, job.world, job.device,
                                               std::chrono::seconds(job.cfg.dist.timeout_s));
  job.faults->strike_at_phases(*job.coll);
  job.faults->signal(FaultPhase::Start, 0);
  net.model = job.faults->wrap_model(net.model);
  if (amp::loss_scaling_enabled(job.cfg.amp)) update.scaler = std::make_unique<amp::GradScaler>(job.cfg.amp);
  try {
    data.sampler = std::make_unique<data::DistributedSampler>(
        data.splits.train->size(), job.mesh.dp(), job.mesh.dp_rank(), job.cfg.train.batch_size, job.cfg.data.shuffle,
        job.cfg.data.drop_last, static_cast<uint64_t>(job.cfg.run.seed));
  } catch (const std::invalid_argument& e) {
    throw InputError(std::string("data: ") + e.what());
  }
  // A Python module runs only its compiled step, at one batch shape (every rank alike).
  if (const int64_t tail = static_cast<int64_t>(data.sampler->rank_indices(0).size()) % job.cfg.train.batch_size;
      net.python && tail != 0)
    throw InputError("model.name = \"python\" runs only its compiled step, at train.batch_size = " +
                     std::to_string(job.cfg.train.batch_size) + ": data.drop_last = false leaves a last batch of " +
                     std::to_string(tail) +
                     " samples per rank and epoch, which it cannot run; set data.drop_last = true");
}

// The fixed init pipeline, place -> compile -> distribute (trainer/compile/transforms.h), with
// autocast around tracing so that the casts are part of the graph.
void Run::compile_and_distribute() {
  const data::Batch first = data.splits.train->get(std::vector<int64_t>(job.cfg.train.batch_size, 0));
  const torch::Tensor& example = first.input;
  check_dropout(job.cfg);
  std::optional<InductorRequest> inductor;
  if (job.cfg.compile.mode == CompileMode::Inductor) {
    // A custom loss (Callbacks::loss, train.loss) is traced into the step with the C++ model, and
    // runs eager beside the block packages (use_compiled_loss); a Python module's step is traced in
    // Python, where a C++ loss cannot go.
    if (net.python && (job.cb.loss || job.cfg.train.loss != "cross_entropy"))
      throw InputError(
          "model.name = \"python\" compiles its step in Python with keel's cross-entropy (or the loss its factory "
          "returns); a C++ custom loss (Callbacks::loss, train.loss) cannot be traced into it");
    inductor = inductor_request(job.cfg, *net.model, job.device, net.amp, job.threads, net.python.get());
    inductor->seed_dir = package_seed_dir(job.cfg.checkpoint);
    inductor->loss = net.loss;
    inductor->example_target = first.target;
    inductor->agree_on_trace = [this](const std::string& mine) {
      if (const dist::RankError e = dist::first_error(*job.coll, mine, "compile trace"); e && mine.empty())
        throw GraphRefusal("compile.mode = \"inductor\": rank " + std::to_string(e.rank) +
                           " refused the traced step: " + e.message);
    };
  }
  auto compile = [&] {
    return compile_on_every_rank(*job.coll, [&] {
      job.faults->signal(FaultPhase::Compile, 0);
      amp::Autocast ac(job.device.type(), net.amp.dtype, net.amp.enabled);
      // The identity (which reads and hashes a TorchScript file) is needed only by the cache.
      const std::string identity =
          job.cfg.compile.cache_dir.empty() || inductor ? "" : compile_identity(job.cfg.model, job.cfg.amp);
      dist::TransformOptions options{job.cfg.parallel.sequence_parallel,
                                     recompute_policy(job.cfg.train.activation_checkpointing),
                                     deferred,
                                     // (at pp > 1 place() makes the stage's parameters: FullyShard
                                     // would find the other stages' unmade)
                                     dist::Placement(job.cfg.dist.zero).shards_parameters() && job.mesh.pp() == 1,
                                     {}};
      if (job.mesh.pp() > 1)
        options.pipeline = {pipeline_schedule(job.cfg).stage_rank, pipeline_split_points(job.cfg.parallel)};
      return place(net.model, job.device, job.mesh, options)
          .compile(job.cfg.compile, example, identity, inductor ? &*inductor : nullptr);
    });
  };
  if (!inductor) {
    net.dmodel.emplace(compile().distribute(job.mesh.shared(dist::Axis::Dp), job.cfg.dist));
    logging::info("model transforms: {}", net.dmodel->transforms().describe());
    log_build_memory();
    return;
  }
  try {
    net.dmodel.emplace(compile().distribute(job.mesh.shared(dist::Axis::Dp), job.cfg.dist));
    if (net.python) net.python->attach(net.dmodel->inductor_step(), /*evaluates=*/inductor->eval_batch > 0);
    use_compiled_loss();
    logging::info("model transforms: {}", net.dmodel->transforms().describe());
    log_build_memory();
  } catch (const GraphRefusal& e) {
    throw InputError(e.what());  // the C++ model does what a graph would bake in: exit 2 on every rank
  } catch (const CompileError& e) {
    // With compile.fullgraph (or a Python module, which has no eager code to fall back to) a step
    // that cannot be captured whole is the user's model: exit 2.
    throw InputError(std::string(e.what()) +
                     (net.python ? " (model.name = \"python\" runs only compiled)" : " (compile.fullgraph = true)"));
  }
}

// compile.granularity = "blocks": keel's cross-entropy from the block package's root units where
// it fits the logits (trainer/compile/inductor_block.h), else the eager loss as before.
void Run::use_compiled_loss() {
  const std::shared_ptr<InductorBlock>& block = net.dmodel->inductor_block();
  if (!block || !block->root_loss()) return;  // the run's loss, traced with the root (unit_trace.h)
  net.loss = [compiled = block->root_loss(), eager = net.loss](const torch::Tensor& logits,
                                                               const torch::Tensor& target) {
    const torch::Tensor l = compiled(logits, target);
    return l.defined() ? l : eager(logits, target);
  };
}

// Sharded initialisation broadcasts nothing: every rank makes its shards from the draws it
// recorded, which are the same on every rank only if each rank's generator went the same way.
// Its state after the build, compared (one agreement): a rank that drew otherwise (another seed,
// a draw of its own before the build) stops the run instead of training from other values.
void Run::check_generators_agree() {
  const torch::Tensor state = at::detail::getDefaultCPUGenerator().get_state().contiguous();
  const uint64_t fp = dist::fingerprint(
      std::string_view(reinterpret_cast<const char*>(state.data_ptr()), static_cast<size_t>(state.numel())));
  if (const auto d = dist::agree(
          *job.coll, fp, [fp] { return std::to_string(fp); }, "sharded initialisation");
      d)
    throw std::runtime_error(
        "model.sharded_init: the ranks' random generators differ after building the model, so their shards would "
        "come from different draws (generator state fingerprints:" +
        d.by_rank() + "); set model.sharded_init = false to build it whole and broadcast rank 0's");
}

// What building and placing the model cost this rank: its peak resident memory so far (the
// process's high-water mark, before the first step allocates gradients and optimizer state).
void Run::log_build_memory() {
  const double peak_mib = peak_resident_mib();
  char peak[160];
  std::snprintf(peak, sizeof peak, "peak resident memory so far %.0f MiB, %.0f MiB over its peak before the model",
                peak_mib, peak_mib - rss_before_model_mib);
  if (deferred)
    logging::info(
        "model: built as this rank's shards (model.sharded_init): the largest whole tensor made was {:.1f} "
        "MiB; {}",
        static_cast<double>(deferred->largest_transient_bytes()) / (1 << 20), peak);
  else
    logging::info("model: built and placed; {}", peak);
  deferred.reset();
}

void Run::build_optimizer() {
  progress.total_steps = job.cfg.train.steps;
  if (job.cfg.train.epochs > 0) {
    // train.steps' documented bound holds for the steps that epochs make, too.
    int64_t batches = 0;
    if (__builtin_mul_overflow(job.cfg.train.epochs, data.sampler->batches_per_epoch(), &batches) ||
        batches / job.cfg.train.grad_accum > kMaxPlannedSteps)
      throw InputError("train.epochs = " + std::to_string(job.cfg.train.epochs) + " makes more than " +
                       std::to_string(kMaxPlannedSteps) + " steps (" +
                       std::to_string(data.sampler->batches_per_epoch()) +
                       " batches per epoch); lower it or use train.steps");
    progress.total_steps = std::max<int64_t>(1, batches / job.cfg.train.grad_accum);
  }
  progress.global_batch = job.cfg.train.batch_size * job.cfg.train.grad_accum * job.mesh.dp();
  net.params = net.model->parameters();
  for (const auto& [n, t] : net.dmodel->owned_parameters()) net.owned.push_back(t);
  update.optimizer = optimizer_choice->make(net.owned);
  // With a sharded optimizer state the checkpoint records who owns each parameter's state.
  update.optimizer_state = net.dmodel->optimizer_state(*update.optimizer, optimizer_choice->codec());
  update.schedule.emplace(job.cfg.train, progress.total_steps);
  // dist.consensus: late needs the fused kernel's found_inf (config.cpp refuses it without
  // train.fused_optimizer); auto takes it where the host would otherwise wait for a GPU.
  update.fused = dynamic_cast<FusedOptimizer*>(update.optimizer.get());
  const Consensus mode = job.cfg.dist.consensus;
  if (mode == Consensus::Late && !update.fused)
    throw InputError("dist.consensus = \"late\" needs a fused optimizer (train.fused_optimizer = true)");
  // compile.cuda_graphs captures the device-decided update (config.cpp refuses dist.consensus = step).
  update.late = update.fused && (mode == Consensus::Late || job.cfg.compile.cuda_graphs ||
                                 (mode == Consensus::Auto && job.device.is_cuda() && job.group->backend() == "nccl"));
}

}  // namespace keel
