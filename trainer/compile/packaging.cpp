#include "trainer/compile/packaging.h"

#include <dlfcn.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>

#include <filesystem>
#include <mutex>
#include <optional>
#include <set>
#include <thread>

#include "common/file.h"
#include "common/log.h"
#include "common/sha256.h"
#include "common/stop.h"
#include "keel/common/error.h"

#ifdef KEEL_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace keel::aot {

std::vector<int64_t> shape_of(const nlohmann::json& spec) { return spec.at("shape").get<std::vector<int64_t>>(); }

std::string spec_of(const nlohmann::json& spec) {
  return c10::str(c10::IntArrayRef(shape_of(spec))) + " " + spec.value("dtype", std::string("?"));
}

std::string env_or(const char* name, const std::string& fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::string(v) : fallback;
}

bool is_file(const std::string& p) { return not_a_regular_file(p).empty(); }

namespace {
std::string home() { return env_or("HOME", "/tmp"); }
}  // namespace

// Absolute: the packaging step gets paths under it while its compilers run elsewhere (issue 64: a
// relative compile.cache_dir failed in Inductor's C++ compile, where an absolute one worked).
std::string cache_root(const CompileConfig& c) {
  const std::string dir =
      !c.cache_dir.empty() ? c.cache_dir : env_or("XDG_CACHE_HOME", home() + "/.cache") + "/keel/compile";
  std::error_code ec;
  const auto abs = std::filesystem::absolute(dir, ec);
  return ec ? dir : abs.lexically_normal().string();
}

// The packaging step's Python: compile.python, $KEEL_PYTHON, the build's venv, keel's venv.
std::string python_for(const CompileConfig& c) {
  if (!c.python.empty()) {
    // A bare name (python3) is looked up on PATH by execvp; not found there, exit 127 (run_packaging).
    if (c.python.find('/') != std::string::npos && (::access(c.python.c_str(), X_OK) != 0 || !is_file(c.python)))
      throw InputError("compile.python = \"" + c.python + "\": not an executable file (the Python, with torch " +
                       TORCH_VERSION + ", that packages the step)");
    return c.python;
  }
  if (const std::string p = env_or("KEEL_PYTHON", ""); !p.empty()) return p;
#ifdef KEEL_DEFAULT_PYTHON
  if (is_file(KEEL_DEFAULT_PYTHON)) return KEEL_DEFAULT_PYTHON;
#endif
  return env_or("KEEL_VENV", home() + "/.cache/keel/venv") + "/bin/python";
}

// One of keel's Python scripts: $<env_var>, the source tree this keel was built from, or the
// installed copy (share/keel/).
std::string keel_script(const std::string& source_relative, const char* env_var) {
  std::vector<std::string> tried;
  const std::string base = source_relative.substr(source_relative.rfind('/') + 1);
  for (const std::string& p : {
           env_or(env_var, ""),
#ifdef KEEL_SOURCE_DIR
           std::string(KEEL_SOURCE_DIR) + "/" + source_relative,
#endif
#ifdef KEEL_SHARE_DIR
           std::string(KEEL_SHARE_DIR) + "/" + base,
#endif
       }) {
    if (p.empty()) continue;
    if (is_file(p)) return p;
    tried.push_back(p);
  }
  std::string list;
  for (const auto& t : tried) list += (list.empty() ? "" : ", ") + t;
  throw std::runtime_error("keel's script " + base + " is not found (tried " + list + "; set " + env_var + ")");
}

std::string script_path() {
  try {
    return keel_script("trainer/compile/aot_package.py", "KEEL_AOT_SCRIPT");
  } catch (const std::runtime_error& e) {
    throw std::runtime_error(std::string("compile.mode = \"inductor\": ") + e.what());
  }
}

std::vector<std::string> script_files() {
  const std::string script = script_path();
  const std::string dir = script.substr(0, script.find_last_of('/') + 1);
  std::vector<std::string> files = {script};
  for (const char* module : {"aot_common.py", "keel_graph.py", "python_front.py", "aot_checks.py"}) {
    if (!is_file(dir + module))
      throw std::runtime_error(std::string("compile.mode = \"inductor\": ") + dir + module +
                               " is missing beside the packaging script " + script + " (an incomplete install?)");
    files.push_back(dir + module);
  }
  return files;
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

namespace {
std::string cpu_model() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("model name", 0) == 0 || line.rfind("flags", 0) == 0) return line;
  return "";
}
}  // namespace

std::string device_identity(const torch::Device& d) {
  if (!d.is_cuda()) return "cpu|" + cpu_model();
#ifdef KEEL_WITH_CUDA
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, d.has_index() ? d.index() : 0) == cudaSuccess)
    return std::string("cuda|") + prop.name + "|sm_" + std::to_string(prop.major) + std::to_string(prop.minor);
#endif
  return "cuda";
}

// An exclusive flock held until the object dies: the other ranks wait while one compiles. Polled
// (10 ms, then 100 ms), so that the wait is visible and a stop signal ends it.
EntryLock::EntryLock(const std::string& path) {
  fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd_ < 0) throw std::runtime_error("compile cache: cannot open " + path + ": " + std::strerror(errno));
  const auto t0 = std::chrono::steady_clock::now();
  int64_t told_s = 0;
  while (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    if (errno == EINTR) continue;
    if (errno != EWOULDBLOCK) {
      const std::string why = std::strerror(errno);
      ::close(fd_);
      throw std::runtime_error("compile cache: cannot lock " + path + ": " + why);
    }
    if (const int signo = g_stop_signal.load()) {
      ::close(fd_);
      throw Stopped(signo, "stopped by signal " + std::to_string(signo) + " while waiting for the compile cache's " +
                               path + " (held by another process)");
    }
    const auto waited = std::chrono::duration_cast<std::chrono::seconds>(std::chrono::steady_clock::now() - t0);
    if (waited.count() >= 5 && waited.count() >= told_s + (told_s ? 60 : 5)) {
      told_s = waited.count();
      logging::info(
          "compile cache: waiting {} s for {} (another process holds it: a rank or another run "
          "packaging the same entry)",
          told_s, path);
    }
    waited_ = true;
    std::this_thread::sleep_for(std::chrono::milliseconds(waited.count() < 1 ? 10 : 100));
  }
  waited_ms_ = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

EntryLock::~EntryLock() { ::close(fd_); }

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
  // Polled, so that a stop signal (SIGINT, SIGTERM: common/stop.h) is passed on to the packaging
  // step at once (SIGKILL 10 s later) instead of waiting out a compile of minutes, and ends the
  // run with 128 + N rather than as the step's failure.
  int status = 0;
  std::optional<std::chrono::steady_clock::time_point> stopped_at;
  for (;;) {
    const pid_t r = ::waitpid(pid, &status, WNOHANG);
    if (r == pid) break;
    if (r < 0 && errno != EINTR) throw std::runtime_error(std::string("waitpid: ") + std::strerror(errno));
    if (const int signo = g_stop_signal.load(); signo && !stopped_at) {
      ::kill(pid, signo);
      stopped_at = std::chrono::steady_clock::now();
    } else if (stopped_at && std::chrono::steady_clock::now() - *stopped_at > std::chrono::seconds(10)) {
      ::kill(pid, SIGKILL);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  if (const int signo = g_stop_signal.load())
    throw Stopped(signo, "stopped by signal " + std::to_string(signo) + " while " + argv[0] + " ran " +
                             (argv.size() > 1 ? argv[1] : std::string()) + " (its log: " + log + ")");
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

void check_runs_python(const CompileConfig& c, const std::string& log) {
  const std::string py = python_for(c);
  const std::string probe = log + ".python";
  const int rc = run_logged({py, "-c", "import sys; print('keel-python', sys.version_info[0])"}, probe, {});
  const std::string said = last_line(probe);
  if (rc == 0 && said == "keel-python 3") return;
  const std::string setting = !c.python.empty()                    ? "compile.python = \"" + py + "\""
                              : !env_or("KEEL_PYTHON", "").empty() ? "$KEEL_PYTHON = \"" + py + "\""
                                                                   : "keel's default Python " + py;
  const std::string what = setting + " does not run Python 3: asked to print a line it " +
                           (said.empty() ? std::string("printed nothing") : "printed \"" + said + "\"") +
                           " and exited " + std::to_string(rc) + " (set compile.python to the Python, with torch " +
                           TORCH_VERSION + ", that packages the step)";
  // The user's setting is exit 2; keel's own venv broken is not the user's input (exit 1).
  if (!c.python.empty() || !env_or("KEEL_PYTHON", "").empty()) throw InputError(what);
  throw std::runtime_error(what + "; or run scripts/setup.sh again");
}

// The last line of the log that is not empty (the packaging step's reason on failure).
std::string last_line(const std::string& path) {
  std::ifstream in(path);
  std::string line, last;
  while (std::getline(in, line))
    if (line.find_first_not_of(" \t\r") != std::string::npos) last = line;
  return last;
}

void load_libraries(const std::vector<std::string>& paths) {
  static std::mutex mu;
  static std::set<std::string> loaded;
  std::lock_guard<std::mutex> lock(mu);
  for (const auto& p : paths) {
    if (const std::string what = not_a_regular_file(p); !what.empty())
      throw InputError("compile.libraries: \"" + p + "\" " + (what == "missing" ? "not found" : "is " + what));
    const std::string abs = std::filesystem::absolute(p).lexically_normal().string();
    if (loaded.count(abs)) continue;
    if (::dlopen(abs.c_str(), RTLD_NOW | RTLD_GLOBAL) == nullptr) {
      const char* err = ::dlerror();
      throw InputError("compile.libraries: cannot load \"" + p + "\": " + (err ? err : "dlopen failed"));
    }
    loaded.insert(abs);
  }
}

std::vector<std::string> library_args(const std::vector<std::string>& paths) {
  std::vector<std::string> out;
  for (const auto& p : paths) {
    out.push_back("--load-library");
    out.push_back(std::filesystem::absolute(p).lexically_normal().string());
  }
  return out;
}

}  // namespace keel::aot
