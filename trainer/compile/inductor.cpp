#include "keel/trainer/compile/inductor.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <torch/csrc/inductor/aoti_package/model_package_loader.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>

#include "keel/checkpoint/io.h"
#include "keel/common/atomic_file.h"
#include "keel/common/clock.h"
#include "keel/common/error.h"
#include "keel/common/file.h"
#include "keel/common/log.h"
#include "keel/common/sha256.h"
#include "keel/trainer/config/config.h"

#ifdef KEEL_WITH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#include <cuda_runtime_api.h>
#endif

namespace keel {
namespace {

constexpr const char* kFormat = "keel-aoti-step/1";

std::string env_or(const char* name, const std::string& fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::string(v) : fallback;
}

bool is_file(const std::string& p) { return not_a_regular_file(p).empty(); }

std::string home() { return env_or("HOME", "/tmp"); }

std::string cache_root(const CompileConfig& c) {
  if (!c.cache_dir.empty()) return c.cache_dir;
  return env_or("XDG_CACHE_HOME", home() + "/.cache") + "/keel/compile";
}

// The packaging step's Python: compile.python, $KEEL_PYTHON, the build's venv, keel's venv.
std::string python_for(const CompileConfig& c) {
  if (!c.python.empty()) return c.python;
  if (const std::string p = env_or("KEEL_PYTHON", ""); !p.empty()) return p;
#ifdef KEEL_DEFAULT_PYTHON
  if (is_file(KEEL_DEFAULT_PYTHON)) return KEEL_DEFAULT_PYTHON;
#endif
  return env_or("KEEL_VENV", home() + "/.cache/keel/venv") + "/bin/python";
}

// trainer/compile/aot_package.py: $KEEL_AOT_SCRIPT, the source tree this keel was built from,
// or the installed copy (share/keel/).
std::string script_path() {
  std::vector<std::string> tried;
  for (const std::string p : {
           env_or("KEEL_AOT_SCRIPT", ""),
#ifdef KEEL_AOT_SCRIPT_SOURCE
           std::string(KEEL_AOT_SCRIPT_SOURCE),
#endif
#ifdef KEEL_AOT_SCRIPT_INSTALLED
           std::string(KEEL_AOT_SCRIPT_INSTALLED),
#endif
       }) {
    if (p.empty()) continue;
    if (is_file(p)) return p;
    tried.push_back(p);
  }
  std::string list;
  for (const auto& t : tried) list += (list.empty() ? "" : ", ") + t;
  throw std::runtime_error("compile.mode = \"inductor\": the packaging script aot_package.py is not found (tried " +
                           list + "; set KEEL_AOT_SCRIPT)");
}

std::string sha256_of_file(const std::string& path) {
  const std::string text = read_regular_file(path, uint64_t{1} << 34);
  return sha256_hex(text);
}

// The first line a command prints (the C++ compiler's version for the cache key), "" if none.
std::string first_line_of(const std::string& cmd) {
  std::FILE* p = ::popen((cmd + " 2>/dev/null").c_str(), "r");
  if (!p) return "";
  char buf[512] = {0};
  const bool got = std::fgets(buf, sizeof buf, p) != nullptr;
  ::pclose(p);
  std::string s = got ? buf : "";
  while (!s.empty() && (s.back() == '\n' || s.back() == '\r')) s.pop_back();
  return s;
}

std::string cpu_model() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("model name", 0) == 0 || line.rfind("flags", 0) == 0) return line;
  return "";
}

std::string device_identity(const torch::Device& d) {
  if (!d.is_cuda()) return "cpu|" + cpu_model();
#ifdef KEEL_WITH_CUDA
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, d.has_index() ? d.index() : 0) == cudaSuccess)
    return std::string("cuda|") + prop.name + "|sm_" + std::to_string(prop.major) + std::to_string(prop.minor);
#endif
  return "cuda";
}

// An exclusive flock held until the object dies (blocking: the other ranks wait while one
// compiles).
class EntryLock {
 public:
  explicit EntryLock(const std::string& path) {
    fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd_ < 0) throw std::runtime_error("compile cache: cannot open " + path + ": " + std::strerror(errno));
    while (::flock(fd_, LOCK_EX) != 0)
      if (errno != EINTR) throw std::runtime_error("compile cache: cannot lock " + path + ": " + std::strerror(errno));
  }
  ~EntryLock() { ::close(fd_); }
  EntryLock(const EntryLock&) = delete;
  EntryLock& operator=(const EntryLock&) = delete;

 private:
  int fd_ = -1;
};

// Runs argv with stdout and stderr into `log`; the exit status (or 128 + signal).
int run_logged(const std::vector<std::string>& argv, const std::string& log, const std::vector<std::string>& env) {
  const pid_t pid = ::fork();
  if (pid < 0) throw std::runtime_error(std::string("cannot start the packaging step: fork: ") + std::strerror(errno));
  if (pid == 0) {
    const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd >= 0) {
      ::dup2(fd, 1);
      ::dup2(fd, 2);
    }
    for (const auto& e : env) ::putenv(const_cast<char*>(e.c_str()));
    std::vector<char*> args;
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    ::execvp(args[0], args.data());
    std::fprintf(stderr, "cannot run %s: %s\n", args[0], std::strerror(errno));
    ::_exit(127);
  }
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0)
    if (errno != EINTR) throw std::runtime_error(std::string("waitpid: ") + std::strerror(errno));
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

// The last line of the log that is not empty (the packaging step's reason on failure).
std::string last_line(const std::string& path) {
  std::ifstream in(path);
  std::string line, last;
  while (std::getline(in, line))
    if (line.find_first_not_of(" \t\r") != std::string::npos) last = line;
  return last;
}

std::vector<int64_t> shape_of(const nlohmann::json& spec) { return spec.at("shape").get<std::vector<int64_t>>(); }

// The autograd function around one run of the package: forward runs the whole step and keeps
// the gradients; backward returns them times the gradient of the loss.
struct StepFunction : public torch::autograd::Function<StepFunction> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, at::TensorList params, InductorStep* step,
                               const torch::Tensor& input, const torch::Tensor& target) {
    std::vector<torch::Tensor> in(params.begin(), params.end());
    in.push_back(input);
    in.push_back(target);
    auto out = step->run(std::move(in));
    std::vector<torch::Tensor> grads(out.begin() + 1, out.begin() + 1 + static_cast<std::ptrdiff_t>(params.size()));
    ctx->saved_data["grads"] = grads;
    return out[0];
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_out) {
    std::vector<torch::Tensor> grads = ctx->saved_data["grads"].toTensorVector();
    ctx->saved_data.erase("grads");
    at::_foreach_mul_(grads, grad_out[0]);  // 1/grad_accum, a loss scale: no host sync
    grads.resize(grads.size() + 3);         // the step, input and target get none
    return grads;
  }
};

}  // namespace

nlohmann::json model_config_json(const Config& cfg) {
  nlohmann::json j = nlohmann::json::object();
  for (const auto& f : config_schema()) {
    if (f.section != "model") continue;
    std::visit([&](const auto& v) { j[f.key] = v; }, f.get(cfg));
  }
  return j;
}

std::string InductorStep::cache_key(const InductorRequest& req) {
  const std::string script = script_path();
  const std::string dir = script.substr(0, script.find_last_of('/'));
  std::string reference = dir + "/reference_models.py";
  if (!is_file(reference)) reference = dir + "/../../tests/golden/reference_models.py";
  nlohmann::json k = {
      {"format", kFormat},
      {"script", sha256_of_file(script)},
      {"reference_models", is_file(reference) ? sha256_of_file(reference) : std::string("none")},
      {"model", req.model},
      {"model_config", req.model_config},
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

// A cache miss: the packaging script (trainer/compile/aot_package.py) run by compile.python into
// `pt2`, its output in `log`. A failure of the graph itself (it cannot be captured) is recorded
// in `error_path` for every later try and thrown as CompileError; others as runtime_error.
static void run_packaging(const InductorRequest& req, const std::string& dir, const std::string& pt2,
                          const std::string& error_path, const std::string& log) {
  std::vector<std::string> argv = {python_for(req.cfg),
                                   script_path(),
                                   "--model",
                                   req.model,
                                   "--model-config",
                                   req.model_config.dump(),
                                   "--batch",
                                   std::to_string(req.batch),
                                   "--amp",
                                   req.amp,
                                   "--device",
                                   req.device.is_cuda() ? "cuda" : "cpu",
                                   "--threads",
                                   std::to_string(req.threads),
                                   "--no-forward",
                                   "--out",
                                   pt2};
  if (req.cfg.fullgraph) argv.push_back("--fullgraph");
  if (req.cfg.deterministic) argv.push_back("--deterministic");
  if (req.cfg.max_autotune) argv.push_back("--max-autotune");
  logging::info("compile: packaging the {} training step (batch {}, amp {}) with AOTInductor: {} (log: {})", req.model,
                req.batch, req.amp, pt2, log);
  // Inductor's own cache beside keel's: a second key for the same graph reuses its kernels.
  const int rc = run_logged(argv, log, {"TORCHINDUCTOR_CACHE_DIR=" + dir + "/torchinductor"});
  if (rc != 0) {
    const std::string why = last_line(log);
    if (rc == 3 || rc == 4 || rc == 6) {  // the graph itself: every later try would say the same
      const std::string what = "compile.mode = \"inductor\": " + why;
      write_atomic(error_path, what);
      throw CompileError(what);
    }
    throw std::runtime_error("compile.mode = \"inductor\": the packaging step failed (exit " + std::to_string(rc) +
                             "): " + why + " (its log: " + log + ")");
  }
}

std::shared_ptr<InductorStep> InductorStep::load_or_compile(const InductorRequest& req, CompileReport& report) {
  if (req.model != "mlp" && req.model != "cnn" && req.model != "gpt")
    throw InputError("compile.mode = \"inductor\" packages the built-in models mlp, cnn and gpt; model.name = \"" +
                     req.model + "\" is not one (use compile.mode = \"off\")");
  if (req.amp != "off" && req.amp != "bf16")
    throw InputError(
        "compile.mode = \"inductor\" with amp.dtype = \"" + req.amp +
        "\" is not built yet (fp16 needs the loss scale inside the package); use bf16 or compile.mode = \"off\"");
  const auto t0 = Clock::now();
  const std::string key = cache_key(req);
  const std::string dir = cache_root(req.cfg) + "/inductor";
  if (const std::string err = make_dirs(dir); !err.empty()) throw InputError("compile.cache_dir: " + err);
  const std::string base = dir + "/" + key.substr(0, 32);
  const std::string pt2 = base + ".pt2", manifest_path = base + ".json", error_path = base + ".error";
  nlohmann::json manifest;
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
      report.cache = "hit";
    } else if (seed_cache_from_checkpoint(req.seed_dir, key, pt2, manifest_path) && usable()) {
      report.cache = "checkpoint";
      logging::info("compile: the package stored with checkpoint {} fits this run; loading it (cache entry {})",
                    req.seed_dir, pt2);
    } else if (is_file(error_path)) {
      // Another process of this job (or an earlier run) found the step cannot be captured.
      throw CompileError(read_regular_file(error_path, 1 << 20));
    } else {
      report.cache = "miss";
      const std::string log = base + ".log";
      run_packaging(req, dir, pt2, error_path, log);
      if (!usable())
        throw std::runtime_error(
            "compile.mode = \"inductor\": the packaging step wrote no usable package (log: " + log + ")");
    }
  }
  auto step = std::shared_ptr<InductorStep>(new InductorStep());
  step->path_ = pt2;
  step->sha256_ = manifest.at("sha256").get<std::string>();
  step->manifest_ = manifest;
  step->manifest_["cache_key"] = key;
  const auto& sig = manifest.at("models").at("train_step");
  std::vector<std::string> names;
  for (const auto& in : sig.at("inputs")) {
    const std::string kind = in.value("kind", "");
    if (kind == "parameter")
      names.push_back(in.at("name").get<std::string>());
    else if (kind == "input")
      step->input_shape_ = shape_of(in);
    else if (kind == "target")
      step->target_shape_ = shape_of(in);
    else
      throw std::runtime_error(pt2 + ": an input keel does not pass: " + in.dump());
  }
  // The package takes keel's parameters by position: the same names in the same order.
  if (names != req.param_names) {
    std::string mismatch = std::to_string(names.size()) + " parameters in the package, " +
                           std::to_string(req.param_names.size()) + " in the model";
    for (size_t i = 0; i < std::min(names.size(), req.param_names.size()); ++i)
      if (names[i] != req.param_names[i]) {
        mismatch = "parameter " + std::to_string(i) + " is " + names[i] + " in the package, " + req.param_names[i] +
                   " in the model";
        break;
      }
    throw std::runtime_error(pt2 + " does not fit the model: " + mismatch);
  }
  step->num_params_ = names.size();
  step->loader_ = std::make_unique<torch::inductor::AOTIModelPackageLoader>(
      pt2, "train_step", /*run_single_threaded=*/true, /*num_runners=*/1,
      req.device.is_cuda() ? static_cast<c10::DeviceIndex>(req.device.index()) : c10::DeviceIndex(-1));
  report.mode = "inductor";
  report.compile_ms = ms_since(t0);
  report.package = pt2;
  report.package_sha256 = step->sha256_;
  logging::info("compile: {} the inductor package {} ({:.0f} ms)",
                report.cache == "hit"          ? "cache hit:"
                : report.cache == "checkpoint" ? "from the checkpoint:"
                                               : "built",
                pt2, report.compile_ms);
  return step;
}

InductorStep::~InductorStep() = default;

bool InductorStep::fits(const torch::Tensor& input, const torch::Tensor& target) const {
  return input.sizes().vec() == input_shape_ && target.sizes().vec() == target_shape_;
}

std::vector<torch::Tensor> InductorStep::run(std::vector<torch::Tensor> inputs) { return loader_->run(inputs); }

torch::Tensor InductorStep::loss(const std::vector<torch::Tensor>& params, const torch::Tensor& input,
                                 const torch::Tensor& target) {
  if (params.size() != num_params_)
    throw std::runtime_error("inductor step: " + std::to_string(params.size()) + " parameters, the package takes " +
                             std::to_string(num_params_));
  return StepFunction::apply(at::TensorList(params), this, input.contiguous(), target.contiguous());
}

}  // namespace keel
