#include "trainer/setup.h"

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <limits>

#ifdef __GLIBC__
#include <malloc.h>
#endif

#include <optional>
#include <thread>

#include "amp/autocast.h"
#include "checkpoint/checkpointer.h"
#include "common/log.h"
#include "dist/tensor_parallel.h"
#include "keel/common/error.h"
#include "keel/trainer/config/config.h"
#include "keel/trainer/data/data.h"
#include "models/hf.h"
#include "trainer/compile/compile_cache.h"
#include "trainer/compile/inductor_block.h"
#include "trainer/compile/packaging.h"
#include "trainer/loss.h"

namespace keel {

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

// One intra-op pool per rank, sized so that the ranks of a node share its cores.
int64_t set_threads(const RunConfig& run, const dist::World& world) {
  const int64_t cores = std::max<int64_t>(1, static_cast<int64_t>(std::thread::hardware_concurrency()));
  const int64_t threads = run.threads > 0 ? run.threads : std::max<int64_t>(1, cores / world.local_size);
  at::set_num_threads(static_cast<int>(threads));
  return threads;
}

torch::Device resolve_device(const RunConfig& run, const dist::World& world) {
  if (run.device == DeviceChoice::Cpu) return torch::kCPU;
  if (run.device == DeviceChoice::Cuda || (run.device == DeviceChoice::Auto && torch::cuda::is_available())) {
    if (!torch::cuda::is_available())
      throw InputError(
          "run.device = \"cuda\" but no CUDA device is available on this machine (no GPU or no "
          "driver); use run.device = \"cpu\" or \"auto\"");
    return torch::Device(torch::kCUDA, static_cast<int16_t>(world.local_rank % torch::cuda::device_count()));
  }
  return torch::kCPU;
}

AmpContext AmpContext::resolve(const AmpConfig& cfg, const torch::Device& device) {
  if (cfg.dtype == AmpDtype::Fp16 && !device.is_cuda())
    throw InputError("amp.dtype = \"fp16\" needs a CUDA device (run.device resolved to " + device.str() +
                     "); use \"bf16\" on CPU");
  AmpContext a;
  a.enabled = cfg.dtype != AmpDtype::Off;
  a.dtype = cfg.dtype == AmpDtype::Fp16 ? c10::kHalf : c10::kBFloat16;
  return a;
}

std::string compile_identity(const ModelConfig& model, const AmpConfig& amp) {
  Config c;
  c.model = model;
  std::string id;
  for (const auto& f : config_schema())
    if (f.section == "model" && f.key != "sharded_init")  // (how the parameters are made, not the model)
      id += f.key + "=" + to_toml_literal(f.get(c)) + ";";
  if (model.name == "torchscript") id += "file_sha256=" + sha256_hex(read_file(model.path, kMaxInputBytes));
  return id + "amp.dtype=" + choice_name(kAmpDtypes, amp.dtype);
}

CompiledModel compile_on_every_rank(dist::Collectives& coll, const std::function<CompiledModel()>& compile) {
  std::optional<CompiledModel> compiled;
  std::string error;
  bool refusal = false;
  try {
    compiled.emplace(compile());
  } catch (const GraphRefusal& e) {
    error = e.what();
    refusal = true;
  } catch (const CompileError& e) {
    error = e.what();
  }
  if (const dist::RankError e = dist::first_error(coll, error, "compile outcome")) {
    if (refusal) throw GraphRefusal(error);
    if (!error.empty()) throw CompileError(error);
    throw CompileError("compile failed on rank " + std::to_string(e.rank) + " (its log says why); every rank stops");
  }
  return std::move(*compiled);
}

bool is_out_of_memory(const std::string& what) {
  return what.find("can't allocate memory") != std::string::npos || what.find("out of memory") != std::string::npos ||
         what.find("std::bad_alloc") != std::string::npos;
}

double measure_peak_tflops(const torch::Device& device, const AmpContext& amp) {
  torch::NoGradGuard no_grad;
  const bool cuda = device.is_cuda();
  const int64_t n = cuda ? 8192 : 1024;  // on a CPU, the size of the GEMMs of a small gpt step
  const auto dtype = cuda && amp.enabled ? amp.dtype : torch::kFloat;
  const auto opts = torch::TensorOptions().dtype(dtype).device(device);
  // Constant operands: the time does not depend on the values, and the RNG the run is seeded
  // with is left untouched.
  const auto a = torch::full({n, n}, 0.5, opts), b = torch::full({n, n}, 0.25, opts);
  auto sync = [&] {
#ifdef KEEL_WITH_CUDA
    if (cuda) torch::cuda::synchronize(device.index());
#endif
  };
  torch::Tensor c = torch::mm(a, b);  // warm-up: kernels, threads, allocator
  sync();
  // The fastest of the multiplies in a short window: a peak is what the device can do, and a
  // rep slowed by a peer rank's start-up on the same cores (or a clock ramping up) would
  // understate it, and MFU would then exceed 100%.
  double fastest = std::numeric_limits<double>::infinity();
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t reps = 0; reps < 3 || std::chrono::steady_clock::now() - t0 < std::chrono::milliseconds(50); ++reps) {
    const auto r0 = std::chrono::steady_clock::now();
    c = torch::mm(a, b);
    sync();
    fastest = std::min(fastest, std::chrono::duration<double>(std::chrono::steady_clock::now() - r0).count());
  }
  return 2.0 * static_cast<double>(n) * n * n / fastest / 1e12;
}

// Dropout is the eager model's: a packaged step would draw its masks inside the package, from no
// generator keel checkpoints or agrees on, and a trace would fix it on for evaluation too. Refused, never dropped
// silently; a probability taken from init_from's config.json (not model.dropout) is said once.
void check_dropout(const Config& cfg) {
  const double p = models::model_dropout(cfg.model);
  if (p <= 0) return;
  const std::string from = " (" + models::dropout_origin(cfg.model) + ")";
  if (cfg.compile.mode != CompileMode::Off)
    throw InputError(
        fmt::format("model.dropout: the model drops out with probability {}{}, which compile.mode = "
                    "\"{}\" does not compile; set compile.mode = \"off\", or model.dropout = 0",
                    p, from, choice_name(kCompileModes, cfg.compile.mode)));
  if (cfg.model.dropout < 0)
    logging::info("model: dropout {} while training{}; model.dropout = 0 turns it off", p, from);
}

// What compile.mode = "inductor" packages for this run: the model at the training batch, with
// the run's precision, device and threads.
InductorRequest inductor_request(const Config& cfg, const models::Model& model, const torch::Device& device,
                                 const AmpContext& amp, int64_t threads, const PythonModel* python) {
  InductorRequest r;
  r.model = cfg.model.name;
  r.model_config = model_config_json(cfg);
  r.batch = cfg.train.batch_size;
  r.ignore_index = cfg.train.ignore_index;
  r.amp = amp.enabled ? choice_name(kAmpDtypes, cfg.amp.dtype) : "off";
  r.grad_scale = r.amp == "fp16";  // GradScaler's scale goes into the package: fp16 gradients scaled as computed
  r.device = device;
  r.threads = threads;
  r.cfg = cfg.compile;
  if (compiles_blocks(cfg)) r.granularity = "blocks";
  if (r.granularity == "blocks") r.tp = cfg.parallel.tp;
  for (const auto& [n, p] : model.named_parameters())
    r.param_names.push_back(n), r.param_specs.push_back(tensor_spec(p));
  for (const auto& [n, b] : model.named_buffers())
    r.buffer_names.push_back(n), r.buffer_specs.push_back(tensor_spec(b));
  if (python) {
    r.model = "python";
    r.module = python->module_spec();
    r.example = python->example(r.batch);
    // The module has no C++ code: evaluation (train.eval_interval > 0) runs in the package, and
    // whatever cannot be captured whole is an error, as compile.fullgraph = true makes it.
    r.eval_batch = cfg.train.eval_interval > 0 ? cfg.data.eval_batch_size : 0;
    r.cfg.fullgraph = true;
  }
  return r;
}

// The model cfg.model names: model.name = "python" is a user's PyTorch module (trainer/compile/
// python_model.h), anything else comes from the model registry.
std::shared_ptr<models::Model> make_model(const Config& cfg, std::optional<models::InputKind> data_kind) {
  if (cfg.model.name == "python") return PythonModel::create(cfg, data_kind);
  return models::create_model(cfg.model, data_kind);
}

// The checkpoint step whose stored package (checkpoint.save_graph) may serve compile.mode =
// "inductor" when the compile cache has none: the step checkpoint.resume_from names, else the
// newest committed one; only a step of this run's own checkpoint.dir (a package is native code:
// keel loads one only from where this run writes its own). A seed only: the cache checks its
// key and checksums before using it.
std::string package_seed_dir(const CheckpointConfig& c) {
  if (c.dir.empty()) return "";
  if (!c.resume_from.empty()) {
    std::string d;
    try {
      d = checkpoint::resume_from_dir(c.dir, c.resume_from);
    } catch (const std::exception&) {
      return "";  // the checkpointer reports it
    }
    std::error_code ec;
    const auto parent = std::filesystem::path(d).lexically_normal().parent_path();
    return std::filesystem::equivalent(parent, c.dir, ec) && !ec ? d : "";
  }
  std::string newest;
  for (const auto& s : checkpoint::list_steps(c.dir))
    if (s.committed) newest = s.path;
  return newest;
}

// keel compile: the request with the example batch and loss keel train traces the step or the
// block's units on (the first training batch, the run's loss), the model on the device, training.
static InductorRequest with_example(const Config& cfg, models::Model& model, InductorRequest req) {
  const auto splits = data::create_dataset(cfg.data, model.input_spec(), cfg.run.seed);
  const data::Batch first = splits.train->get(std::vector<int64_t>(cfg.train.batch_size, 0));
  if (cfg.train.loss != "cross_entropy") req.loss = losses().get(cfg.train.loss);
  req.example_target = first.target.to(req.device);
  req.example_input = first.input.to(req.device);
  model.to(req.device);
  model.train(true);
  return req;
}

CompileReport package_training_step(const Config& cfg) {
  const dist::World world = dist::detect_world(dist::current_env());
  const int64_t threads = set_threads(cfg.run, world);
  const torch::Device device = resolve_device(cfg.run, world);
  aot::load_libraries(cfg.compile.libraries);
  check_dropout(cfg);
  auto model = make_model(cfg, data::native_input_kind(cfg.data.name));
  InductorRequest req = inductor_request(cfg, *model, device, AmpContext::resolve(cfg.amp, device), threads,
                                         dynamic_cast<const PythonModel*>(model.get()));
  auto report = std::make_shared<CompileReport>();
  if (req.module.empty()) req = with_example(cfg, *model, req);
  // Traced under the run's autocast, as keel train traces (its casts are part of the graph).
  const AmpContext amp = AmpContext::resolve(cfg.amp, device);
  amp::Autocast ac(device.type(), amp.dtype, amp.enabled);
  if (req.granularity == "blocks") {
    // The regions are one tp rank's: traced from the model sharded as rank 0 holds it.
    if (req.tp > 1) dist::shard_as_tp_rank_0(*model, req.tp);
    compile_blocks(*model, req, report, cfg.compile.max_recompiles);  // packaged and checked to fit the blocks
  } else if (req.traces_step()) {
    req.graph = std::make_shared<const GraphFile>(trace_step(*model, req.example_input, req));
    InductorStep::load_or_compile(req, *report);
  } else {
    InductorStep::load_or_compile(req, *report);
  }
  return *report;
}

}  // namespace keel
