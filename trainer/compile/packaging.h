// trainer/compile/packaging.h: running keel's Python packaging step (trainer/compile/aot_package.py)
// and keeping what it makes in the compile cache. Internal to trainer/compile/ (inductor.cpp,
// python_model.cpp); not installed.
//
// Owns: which Python and which script run (compile.python, $KEEL_PYTHON, the build's venv;
// $KEEL_AOT_SCRIPT, the source tree, the installed copy), the cache directory, the per-entry lock
// under which one process makes an entry while the others wait, running the step with its output
// in a log, and the identity of the machine (CPU model and flags, GPU and its architecture, the
// C++ compiler) that cache keys include.
#pragma once

#include <torch/torch.h>

#include <nlohmann/json.hpp>

#include <string>
#include <vector>

#include "keel/trainer/config/config.h"

namespace keel::aot {

/// A manifest input's or output's shape, and its shape and dtype as "[2, 3] float32" (how
/// packages and models are compared).
std::vector<int64_t> shape_of(const nlohmann::json& spec);
std::string spec_of(const nlohmann::json& spec);

std::string env_or(const char* name, const std::string& fallback);
bool is_file(const std::string& path);
/// compile.cache_dir, else $XDG_CACHE_HOME/keel/compile (~/.cache/keel/compile), made absolute
/// against the working directory.
std::string cache_root(const CompileConfig& c);
/// The packaging step's Python: compile.python, $KEEL_PYTHON, the build's venv, keel's venv.
std::string python_for(const CompileConfig& c);
/// Called when the packaging step failed or wrote nothing: asks python_for(c) to print one line.
/// A program that does not (compile.python = "/bin/true", a shell script, a Python 2) is the
/// user's setting: InputError naming where it came from (compile.python, $KEEL_PYTHON, keel's
/// venv) and what it did. `log` is the failed step's log; the probe's output goes beside it.
void check_runs_python(const CompileConfig& c, const std::string& log);
/// One of keel's Python scripts (`source_relative` in the source tree): $<env_var>, the source
/// tree keel was built from, or share/keel/ of the install; std::runtime_error naming where it
/// looked.
std::string keel_script(const std::string& source_relative, const char* env_var);
/// aot_package.py's path ($KEEL_AOT_SCRIPT first); throws as keel_script.
std::string script_path();
/// The packaging step's code: script_path() and the modules beside it that it imports
/// (aot_common.py, keel_graph.py, python_front.py, aot_checks.py), which the cache key hashes.
std::vector<std::string> script_files();
std::string sha256_of_file(const std::string& path);
/// The first line a shell command prints ("" if none): the C++ compiler's version for keys.
std::string first_line_of(const std::string& cmd);
/// "cpu|<model name or flags>" or "cuda|<name>|sm_XY".
std::string device_identity(const torch::Device& d);
/// Runs argv (with `env` added) with stdout and stderr into `log`; its exit status, or 128 + signal.
int run_logged(const std::vector<std::string>& argv, const std::string& log, const std::vector<std::string>& env);
/// The last line of `path` that is not blank (the packaging step's one-line reason on failure).
std::string last_line(const std::string& path);
/// compile.libraries: each shared library loaded into this process once (dlopen, RTLD_NOW |
/// RTLD_GLOBAL), so that the custom ops it registers with TORCH_LIBRARY are there when a package
/// calls them. Throws InputError naming the key, the file and dlerror().
void load_libraries(const std::vector<std::string>& paths);
/// The packaging step's arguments for them: --load-library <absolute path> each.
std::vector<std::string> library_args(const std::vector<std::string>& paths);

/// An exclusive flock on `path`, held until the object dies: waits while another process (a
/// rank on this host, or on another host sharing the directory) holds it, saying so in the log
/// after 5 s and every minute, and throws Stopped (common/stop.h) when a stop signal arrives
/// meanwhile.
class EntryLock {
 public:
  explicit EntryLock(const std::string& path);
  ~EntryLock();
  EntryLock(const EntryLock&) = delete;
  EntryLock& operator=(const EntryLock&) = delete;
  /// Whether another process held it when this one asked, and how long the wait took.
  bool waited() const { return waited_; }
  double waited_ms() const { return waited_ms_; }

 private:
  int fd_ = -1;
  bool waited_ = false;
  double waited_ms_ = 0;
};

}  // namespace keel::aot
