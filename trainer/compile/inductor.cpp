#include "trainer/compile/inductor.h"

#include <torch/csrc/inductor/aoti_package/model_package_loader.h>
#include <optional>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "checkpoint/io.h"
#include "common/atomic_file.h"
#include "common/clock.h"
#include "common/file.h"
#include "common/log.h"
#include "common/sha256.h"
#include "keel/common/error.h"
#include "keel/trainer/config/config.h"
#include "trainer/compile/packaging.h"
#include "trainer/loss.h"

namespace keel {
namespace {

constexpr const char* kFormat = "keel-aoti-step/1";

using namespace aot;

// The autograd function around one run of the package: forward runs the whole step and keeps
// the gradients; backward returns them times the gradient of the loss. A package that takes the
// loss scale (`scale` given, by pointer: autograd takes no undefined tensor) returned gradients
// already times it: backward multiplies by the gradient of the loss over the scale (1/grad_accum
// when the loss was scaled by the same scale; exact for GradScaler's powers of two).
struct StepFunction : public torch::autograd::Function<StepFunction> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, at::TensorList params, InductorStep* step,
                               const std::vector<torch::Tensor>* buffers, const torch::Tensor& input,
                               const torch::Tensor& target, const torch::Tensor* scale) {
    std::vector<torch::Tensor> in(params.begin(), params.end());
    in.insert(in.end(), buffers->begin(), buffers->end());
    in.push_back(input);
    in.push_back(target);
    if (scale) in.push_back(*scale);
    auto out = step->run(std::move(in), *buffers);
    std::vector<torch::Tensor> grads(out.begin() + 1, out.begin() + 1 + static_cast<std::ptrdiff_t>(params.size()));
    ctx->saved_data["grads"] = grads;
    if (scale) ctx->saved_data["scale"] = *scale;
    return out[0];
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_out) {
    std::vector<torch::Tensor> grads = ctx->saved_data["grads"].toTensorVector();
    ctx->saved_data.erase("grads");
    torch::Tensor factor = grad_out[0];
    if (ctx->saved_data.count("scale")) {
      factor = factor / ctx->saved_data["scale"].toTensor();
      ctx->saved_data.erase("scale");
    }
    // A package may return a gradient as a broadcast view (stride 0: the gradient of p.sum() is an
    // expanded scalar), which cannot be written in place: such a one gets memory of its own.
    for (auto& g : grads)
      if (g.defined() && !g.is_non_overlapping_and_dense()) g = g.contiguous();
    at::_foreach_mul_(grads, factor);  // 1/grad_accum, a loss scale: no host sync
    grads.resize(grads.size() + 5);    // the step, buffers, input, target and scale get none
    return grads;
  }
};

}  // namespace

std::string tensor_spec(const torch::Tensor& t) {
  return c10::str(t.sizes()) + " " + c10::getDtypeNames(t.scalar_type()).first;  // "float32", as torch prints it
}

nlohmann::json model_config_json(const Config& cfg) {
  nlohmann::json j = nlohmann::json::object();
  for (const auto& f : config_schema()) {
    // model.sharded_init says how the parameters are made, not what the model is.
    if (f.section != "model" || f.key == "sharded_init") continue;
    std::visit([&](const auto& v) { j[f.key] = v; }, f.get(cfg));
  }
  return j;
}

bool InductorRequest::traces() const { return module.empty(); }

bool InductorRequest::traces_step() const { return traces() && granularity == "step"; }

std::function<torch::Tensor(const torch::Tensor&, const torch::Tensor&)> request_loss(const InductorRequest& req) {
  if (req.loss) return req.loss;
  return [ignore = req.ignore_index](const torch::Tensor& out, const torch::Tensor& target) {
    return cross_entropy(out, target, ignore);
  };
}

GraphFile traced_and_agreed(const InductorRequest& req, const std::function<GraphFile()>& trace) {
  std::optional<GraphFile> file;
  std::string refused;
  bool unsupported = false;  // keel's limit, not the model's doing: an eager fallback (CompileError)
  try {
    file.emplace(trace());
  } catch (const GraphRefusal& e) {
    refused = e.what();
  } catch (const CompileError& e) {
    refused = e.what();
    unsupported = true;
  }
  if (req.agree_on_trace) req.agree_on_trace(refused);
  if (!refused.empty() && unsupported) throw CompileError(refused);
  if (!refused.empty()) throw GraphRefusal(refused);
  return std::move(*file);
}

GraphFile trace_step(models::Model& model, const torch::Tensor& input, const InductorRequest& req) {
  if (!req.example_target.defined()) throw std::logic_error("trace_step: the request has no example target");
  return traced_and_agreed(
      req, [&] { return trace_training_step(model, input, req.example_target.to(input.device()), request_loss(req)); });
}

std::string InductorStep::cache_key(const InductorRequest& req) {
  std::string scripts;  // the packaging step's code: aot_package.py and its modules
  for (const auto& f : script_files()) scripts += sha256_of_file(f) + " ";
  nlohmann::json k = {
      {"format", kFormat},
      {"script", sha256_hex(scripts)},
      {"batch", req.batch},
      {"amp", req.amp},
      {"device", device_identity(req.device)},
      {"threads", req.threads},
      {"torch", TORCH_VERSION},
      {"compiler", first_line_of("c++ --version")},
      {"fullgraph", req.cfg.fullgraph},
      {"deterministic", req.cfg.deterministic},
      {"max_autotune", req.cfg.max_autotune},
  };
  // The traced graph is the model: its ops, shapes, dtypes and parameter names (a Python module: below).
  if (req.graph) k["graph"] = req.graph->fingerprint;
  if (req.grad_scale && req.amp != "fp16") k["grad_scale"] = true;  // fp16 implies it (packages of before kept)
  if (!req.module.empty()) {  // a Python module: its file's bytes, the batches, the evaluation forward
    k["model"] = req.model;
    k["model_config"] = req.model_config;  // what its factory is given (config=)
    k["module"] = req.module;
    k["module_sha256"] = sha256_of_file(req.module.substr(0, req.module.rfind(':')));
    k["example"] = req.example;
    k["buffers"] = req.buffer_names;
  }
  if (req.eval_batch > 0) k["eval_batch"] = req.eval_batch;
  if (req.granularity != "step") k["granularity"] = req.granularity;  // packages of before kept
  if (req.tp > 1) k["tp"] = req.tp;
  if (req.ignore_index != -100) k["ignore_index"] = req.ignore_index;
  // Inductor picks its CPU vector code from ATEN_CPU_CAPABILITY when it is set (cpu_vec_isa.py):
  // a package built for AVX-512 is another entry than one held to AVX2 (the CPU's own best is in
  // the device identity).
  if (const char* isa = std::getenv("ATEN_CPU_CAPABILITY"); isa && *isa && !req.device.is_cuda())
    k["aten_cpu_capability"] = isa;
  for (const auto& lib : req.cfg.libraries) k["libraries"].push_back(sha256_of_file(lib));  // the ops' code
  return sha256_hex(k.dump());
}

std::string InductorStep::manifest_for_checkpoint() const { return manifest_.dump(2) + "\n"; }

namespace {

// checkpoint.save_graph stored the package of a step as <seed_dir>/graph.pt2 with graph.json
// (its manifest and cache key). When that key is `key` and both files have the SHA-256 that the
// step's meta.json lists, they become the cache entry (`pt2`, `manifest_path`) and true is
// returned; another key (other shapes, device, dtype, options, torch) or a damaged file: false,
// and the step is packaged anew.
bool seed_cache_from_checkpoint(const std::string& seed_dir, const std::string& key, const std::string& pt2,
                                const std::string& manifest_path) {
  if (seed_dir.empty() || !is_file(seed_dir + "/graph.pt2") || !is_file(seed_dir + "/graph.json")) return false;
  try {
    const auto meta = nlohmann::json::parse(checkpoint::read_metadata(seed_dir + "/meta.json"));
    for (const char* f : {"graph.pt2", "graph.json"})
      if (sha256_of_file(seed_dir + "/" + f) != meta.at("files").at(f).at("sha256").get<std::string>())
        throw std::runtime_error(std::string(f) + ": SHA-256 differs from the step's meta.json (damaged or replaced)");
    auto manifest = nlohmann::json::parse(read_regular_file(seed_dir + "/graph.json", uint64_t{64} << 20));
    if (manifest.value("cache_key", "") != key) {
      logging::info(
          "compile: the package stored with checkpoint {} was built for another run (its shapes, device, "
          "dtype, compile options or torch differ); packaging this one anew",
          seed_dir);
      return false;
    }
    write_atomic(pt2, read_regular_file(seed_dir + "/graph.pt2", uint64_t{16} << 30));
    manifest.erase("cache_key");
    write_atomic(manifest_path, manifest.dump(2) + "\n");
    return true;
  } catch (const std::exception& e) {
    logging::warn("compile: the package stored with checkpoint {} cannot be used ({}); packaging anew", seed_dir,
                  e.what());
    return false;
  }
}

}  // namespace

// The record of a graph that cannot be captured (exit 3, 4 or 6 of the packaging step), kept
// beside the entry so that every later try says the same without packaging again. It names its
// key: a record of another key, or one that does not parse (damaged, edited), is removed and
// the step packaged again (issue 64: nothing is read back from the cache unchecked).
static void write_error_record(const std::string& path, const std::string& key, const std::string& what) {
  write_atomic(path, nlohmann::json{{"format", "keel-compile-error/1"}, {"key", key}, {"error", what}}.dump() + "\n");
}

static std::optional<std::string> read_error_record(const std::string& path, const std::string& key) {
  if (!is_file(path)) return std::nullopt;
  try {
    const auto j = nlohmann::json::parse(read_regular_file(path, 1 << 20));
    if (j.at("format").get<std::string>() == "keel-compile-error/1" && j.at("key").get<std::string>() == key)
      return j.at("error").get<std::string>();
  } catch (const std::exception&) {
  }
  logging::warn("compile cache: {} is not a record of this entry; removing it and packaging again", path);
  std::remove(path.c_str());
  return std::nullopt;
}

// A cache miss: the packaging script (trainer/compile/aot_package.py) run by compile.python into
// `pt2`, its output in `log`. A failure of the graph itself (it cannot be captured) is recorded
// in `error_path` for every later try and thrown as CompileError; others as runtime_error.
static void run_packaging(const InductorRequest& req, const std::string& dir, const std::string& pt2,
                          const std::string& error_path, const std::string& key, const std::string& log) {
  std::vector<std::string> argv = {python_for(req.cfg), script_path()};
  if (req.graph) {  // the step keel traced from its C++ model, beside the entry
    const std::string graph = pt2.substr(0, pt2.size() - 4) + ".graph.json";
    req.graph->write(graph);
    argv.insert(argv.end(), {"--graph", graph});
  } else {
    argv.insert(argv.end(), {"--module", req.module, "--example", req.example.dump()});
  }
  if (req.granularity != "step") argv.insert(argv.end(), {"--granularity", req.granularity});
  if (req.tp > 1) argv.insert(argv.end(), {"--tp", std::to_string(req.tp)});
  if (req.eval_batch > 0)
    argv.insert(argv.end(), {"--eval-batch", std::to_string(req.eval_batch)});
  else
    argv.push_back("--no-forward");
  if (!req.graph) argv.insert(argv.end(), {"--model-config", req.model_config.dump()});  // the module's factory
  argv.insert(argv.end(),
              {"--batch", std::to_string(req.batch), "--amp", req.amp, "--device",
               req.device.is_cuda() ? "cuda" : "cpu", "--threads", std::to_string(req.threads), "--out", pt2});
  if (req.ignore_index != -100) argv.insert(argv.end(), {"--ignore-index", std::to_string(req.ignore_index)});
  if (req.cfg.fullgraph) argv.push_back("--fullgraph");
  if (req.cfg.deterministic) argv.push_back("--deterministic");
  if (req.cfg.max_autotune) argv.push_back("--max-autotune");
  if (req.grad_scale) argv.push_back("--grad-scale-input");
  for (auto& a : library_args(req.cfg.libraries)) argv.push_back(std::move(a));
  logging::info("compile: packaging the {} {} (batch {}, amp {}) with AOTInductor: {} (log: {})", req.model,
                req.granularity != "blocks" ? std::string("training step")
                : req.tp > 1 ? "transformer block's tensor-parallel regions (tp " + std::to_string(req.tp) + ")"
                             : std::string("transformer block"),
                req.batch, req.amp, pt2, log);
  // Inductor's own cache beside keel's: a second key for the same graph reuses its kernels. Its
  // temporary files (precompiled headers, which ignore TORCHINDUCTOR_CACHE_DIR) stay under
  // compile.cache_dir too.
  const std::string tmp = dir + "/tmp";
  if (const std::string err = make_dirs(tmp); !err.empty()) throw InputError("compile.cache_dir: " + err);
  const int rc = run_logged(argv, log, {"TORCHINDUCTOR_CACHE_DIR=" + dir + "/torchinductor", "TMPDIR=" + tmp});
  if (rc != 0) {
    const std::string why = last_line(log);
    // A Python without torch (compile.python, $KEEL_PYTHON): the user's setting, named.
    if (rc == 127 || why.find("No module named 'torch'") != std::string::npos)
      throw InputError("compile.mode = \"inductor\": the packaging step's Python " + argv[0] + " cannot run it (" +
                       why + "); set compile.python to a Python with torch " + TORCH_VERSION);
    check_runs_python(req.cfg, log);  // a program that is not a Python (compile.python = "/bin/false")
    // A Python module the packaging step refuses (exit 2: its factory fails with the batch or
    // device): the user's input, not recorded (an import may fail for what the user installs next).
    if (rc == 2 && !req.module.empty()) throw CompileError("compile.mode = \"inductor\": " + why);
    if (rc == 3 || rc == 4 || rc == 6) {  // the graph itself: every later try would say the same
      const std::string what = "compile.mode = \"inductor\": " + why;
      write_error_record(error_path, key, what);
      throw CompileError(what);
    }
    throw std::runtime_error("compile.mode = \"inductor\": the packaging step failed (exit " + std::to_string(rc) +
                             "): " + why + " (its log: " + log + ")");
  }
}

// Whether the packaging step's log has the script's closing line for `pt2` ("wrote <pt2> ...").
static bool wrote_package(const std::string& log, const std::string& pt2) {
  const std::string name = std::filesystem::path(pt2).filename().string();  // the script prints it absolute
  std::ifstream in(log);
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("wrote ", 0) == 0 && line.find(name) != std::string::npos) return true;
  return false;
}

PackageEntry fetch_package(const InductorRequest& req, CompileReport& report) {
  // What is packaged is a graph keel traced from the C++ model, or a user's Python module: never a
  // model rebuilt in Python by name (issue 65).
  if (!req.graph && req.module.empty())
    throw std::logic_error("fetch_package: a request for model " + req.model + " without the graph traced from it");
  if (req.amp != "off" && req.amp != "bf16" && !(req.amp == "fp16" && req.device.is_cuda()))
    throw InputError("compile.mode = \"inductor\" with amp.dtype = \"" + req.amp + "\" on " + req.device.str() +
                     ": packages take off, bf16, and fp16 on CUDA (with the loss scale inside the package)");
  const auto t0 = Clock::now();
  load_libraries(req.cfg.libraries);  // before the key (which hashes them) and the package (which calls their ops)
  const std::string key = InductorStep::cache_key(req);
  const std::string dir = cache_root(req.cfg) + "/inductor";
  if (const std::string err = make_dirs(dir); !err.empty()) throw InputError("compile.cache_dir: " + err);
  const std::string base = dir + "/" + key.substr(0, 32);
  const std::string pt2 = base + ".pt2", manifest_path = base + ".json", error_path = base + ".error";
  nlohmann::json manifest;
  // Whether the entry was there before this process waited for its lock: if it was not and is
  // after, another process (a rank of this job, another run) packaged it meanwhile.
  const bool there_before = is_file(pt2) && is_file(manifest_path);
  {
    EntryLock lock(base + ".lock");  // one process per entry compiles; the others wait here, then load
    auto usable = [&]() -> bool {
      if (!is_file(pt2) || !is_file(manifest_path)) return false;
      try {
        manifest = nlohmann::json::parse(read_regular_file(manifest_path, uint64_t{64} << 20));
        if (manifest.value("format", "") != kFormat)
          throw std::runtime_error("not a " + std::string(kFormat) + " manifest");
        if (sha256_of_file(pt2) != manifest.at("sha256").get<std::string>())
          throw std::runtime_error(pt2 + ": SHA-256 differs from its manifest (damaged or replaced)");
        return true;
      } catch (const std::exception& e) {
        logging::warn("compile cache: {} cannot be used ({}); compiling it again", pt2, e.what());
        std::remove(pt2.c_str());
        std::remove(manifest_path.c_str());
        return false;
      }
    };
    if (usable()) {
      report.cache = !there_before && lock.waited() ? "waited" : "hit";
      if (report.cache == "waited")
        logging::info(
            "compile: another process made {} (packaged it, or took it from a checkpoint) while this one "
            "waited for it ({:.0f} ms)",
            pt2, lock.waited_ms());
    } else if (seed_cache_from_checkpoint(req.seed_dir, key, pt2, manifest_path) && usable()) {
      report.cache = "checkpoint";
      logging::info("compile: the package stored with checkpoint {} fits this run; loading it (cache entry {})",
                    req.seed_dir, pt2);
    } else if (const std::optional<std::string> recorded = read_error_record(error_path, key)) {
      // Another process of this job (or an earlier run) found the step cannot be captured.
      throw CompileError(*recorded);
    } else {
      report.cache = "miss";
      const std::string log = base + ".log";
      run_packaging(req, dir, pt2, error_path, key, log);
      if (!usable()) {
        check_runs_python(req.cfg, log);  // compile.python = "/bin/true": status 0, nothing run
        // A user's Python module that ends the interpreter with status 0 (sys.exit(0), os._exit(0) in
        // its import or factory) leaves nothing: the module's doing, named by its key.
        // A package the script said it wrote but that cannot be used is not the module's doing.
        if (!req.module.empty() && !wrote_package(log, pt2))
          throw InputError("model.path: the packaging step of " + req.module +
                           " ended with status 0 without writing a package: the module or its factory ended the "
                           "Python interpreter (sys.exit, os._exit?) (its log: " +
                           log + ")");
        throw std::runtime_error(
            "compile.mode = \"inductor\": the packaging step wrote no usable package (log: " + log + ")");
      }
    }
  }
  manifest["cache_key"] = key;
  report.mode = "inductor";
  report.package = pt2;
  report.package_sha256 = manifest.at("sha256").get<std::string>();
  return {pt2, std::move(manifest), t0};
}

void PackageEntry::loaded(CompileReport& report) const {
  report.compile_ms = ms_since(started);
  logging::info("compile: {} the inductor package {} ({:.0f} ms)",
                report.cache == "hit"          ? "cache hit:"
                : report.cache == "waited"     ? "made by another process:"
                : report.cache == "checkpoint" ? "from the checkpoint:"
                                               : "built",
                path, report.compile_ms);
}

std::shared_ptr<InductorStep> InductorStep::load_or_compile(const InductorRequest& req, CompileReport& report) {
  PackageEntry entry = fetch_package(req, report);
  auto step = std::shared_ptr<InductorStep>(new InductorStep());
  step->path_ = entry.path;
  step->sha256_ = entry.manifest.at("sha256").get<std::string>();
  step->manifest_ = std::move(entry.manifest);
  step->read_signature(req);
  entry.loaded(report);
  return step;
}

namespace {

// The first difference between the names a package takes and the model's ("" when equal).
std::string first_difference(const char* what, const std::vector<std::string>& package,
                             const std::vector<std::string>& model) {
  for (size_t i = 0; i < std::min(package.size(), model.size()); ++i)
    if (package[i] != model[i])
      return std::string(what) + " " + std::to_string(i) + " is " + package[i] + " in the package, " + model[i] +
             " in the model";
  if (package.size() != model.size())
    return std::to_string(package.size()) + " " + what + "s in the package, " + std::to_string(model.size()) +
           " in the model";
  return "";
}

// The first tensor whose shape and dtype differ between the package and the model ("" when none;
// the names already agree; an empty `model` list is not checked).
std::string first_spec_difference(const char* what, const std::vector<std::string>& names,
                                  const std::vector<std::string>& package, const std::vector<std::string>& model) {
  for (size_t i = 0; i < std::min(package.size(), model.size()); ++i)
    if (package[i] != model[i])
      return std::string(what) + " " + names[i] + " is " + package[i] + " in the package, " + model[i] +
             " in the model";
  return "";
}

}  // namespace

// The package takes keel's parameters and buffers by position: the same names in the same order.
void InductorStep::read_signature(const InductorRequest& req) {
  const auto& sig = manifest_.at("models").at("train_step");
  std::vector<std::string> params, buffers, param_specs, buffer_specs;
  for (const auto& in : sig.at("inputs")) {
    const std::string kind = in.value("kind", "");
    if (kind == "parameter")
      params.push_back(in.at("name").get<std::string>()), param_specs.push_back(spec_of(in));
    else if (kind == "buffer")
      buffers.push_back(in.at("name").get<std::string>()), buffer_specs.push_back(spec_of(in));
    else if (kind == "input")
      input_shape_ = shape_of(in);
    else if (kind == "target")
      target_shape_ = shape_of(in);
    else if (kind == "grad_scale")
      takes_scale_ = true;
    else
      throw std::runtime_error(path_ + ": an input keel does not pass: " + in.dump());
  }
  std::string mismatch = first_difference("parameter", params, req.param_names);
  if (mismatch.empty()) mismatch = first_difference("buffer", buffers, req.buffer_names);
  // The package runs on whatever it is given (AOTInductor checks no sizes): a parameter of
  // another shape (a cache entry of another model, a Python module whose imported file changed)
  // would be read out of bounds.
  if (mismatch.empty()) mismatch = first_spec_difference("parameter", params, param_specs, req.param_specs);
  if (mismatch.empty()) mismatch = first_spec_difference("buffer", buffers, buffer_specs, req.buffer_specs);
  if (!mismatch.empty())
    throw std::runtime_error(path_ + " does not fit the model: " + mismatch +
                             " (with model.name = \"python\": did a file the module imports change? it is not "
                             "part of the cache key; remove the entry or use another compile.cache_dir)");
  for (const auto& out : sig.at("outputs")) {
    if (out.value("kind", "") != "buffer_update") continue;
    const std::string name = out.at("name").get<std::string>().substr(std::string("buffer:").size());
    const auto it = std::find(buffers.begin(), buffers.end(), name);
    if (it == buffers.end()) throw std::runtime_error(path_ + ": updates a buffer it does not take: " + name);
    updated_buffers_.push_back(static_cast<size_t>(it - buffers.begin()));
  }
  num_params_ = params.size();
  num_buffers_ = buffers.size();
  const auto device = req.device.is_cuda() ? static_cast<c10::DeviceIndex>(req.device.index()) : c10::DeviceIndex(-1);
  loader_ = std::make_unique<torch::inductor::AOTIModelPackageLoader>(path_, "train_step", /*run_single_threaded=*/true,
                                                                      /*num_runners=*/1, device);
  if (req.eval_batch > 0 && manifest_.at("models").contains("forward")) {
    eval_batch_ = manifest_["models"]["forward"].at("batch").get<int64_t>();
    for (const auto& in : manifest_["models"]["forward"].at("inputs"))
      if (in.value("kind", "") == "input") eval_input_shape_ = shape_of(in);
    forward_loader_ = std::make_unique<torch::inductor::AOTIModelPackageLoader>(path_, "forward", true, 1, device);
  }
}

InductorStep::~InductorStep() = default;

std::string InductorStep::no_forward_reason() const {
  if (forward_loader_) return "";
  const auto& why = manifest_.contains("forward_skipped") ? manifest_["forward_skipped"] : nlohmann::json();
  return why.is_string() ? why.get<std::string>() : "it was packaged without one";
}

bool InductorStep::fits(const torch::Tensor& input, const torch::Tensor& target) const {
  return input.sizes().vec() == input_shape_ && target.sizes().vec() == target_shape_;
}

std::vector<torch::Tensor> InductorStep::run(std::vector<torch::Tensor> inputs,
                                             const std::vector<torch::Tensor>& buffers) {
  auto out = loader_->run(inputs);
  const size_t first = 1 + num_params_;
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < updated_buffers_.size(); ++i) buffers[updated_buffers_[i]].copy_(out[first + i]);
  out.resize(first);
  return out;
}

torch::Tensor InductorStep::loss(const std::vector<torch::Tensor>& params, const std::vector<torch::Tensor>& buffers,
                                 const torch::Tensor& input, const torch::Tensor& target,
                                 const torch::Tensor& grad_scale) {
  if (params.size() != num_params_ || buffers.size() != num_buffers_)
    throw std::runtime_error("inductor step: " + std::to_string(params.size()) + " parameters and " +
                             std::to_string(buffers.size()) + " buffers; the package takes " +
                             std::to_string(num_params_) + " and " + std::to_string(num_buffers_));
  torch::Tensor scale;
  if (takes_scale_)  // 0-dim float32 on the step's device, as the package was traced with
    scale = grad_scale.defined() ? grad_scale.detach().to(input.device(), torch::kFloat).reshape({})
                                 : torch::ones({}, input.options().dtype(torch::kFloat));
  return StepFunction::apply(at::TensorList(params), this, &buffers, input.contiguous(), target.contiguous(),
                             takes_scale_ ? &scale : nullptr);
}

torch::Tensor InductorStep::forward(const std::vector<torch::Tensor>& params, const std::vector<torch::Tensor>& buffers,
                                    const torch::Tensor& input) {
  if (!forward_loader_) throw std::logic_error("InductorStep::forward: the package has no evaluation forward");
  if (input.sizes().vec() != eval_input_shape_)  // a package runs only the shapes it was compiled for
    throw std::runtime_error("inductor step: an evaluation batch of shape " + c10::str(input.sizes()) +
                             " is not the package's " + c10::str(c10::IntArrayRef(eval_input_shape_)));
  std::vector<torch::Tensor> in(params.begin(), params.end());
  in.insert(in.end(), buffers.begin(), buffers.end());
  in.push_back(input.contiguous());
  torch::NoGradGuard no_grad;
  return forward_loader_->run(in).at(0);
}

}  // namespace keel
