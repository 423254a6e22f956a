// Test helpers: temporary directories, running the keel binary as a user would, and
// small file utilities. Every test that writes files does so under its own temp directory.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace keel::testing {

/// A fresh directory under $TMPDIR (or /tmp), removed when the object dies.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  const std::string& path() const { return path_; }
  std::string file(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

struct ProcResult {
  int exit_code = -1;     // valid when !signaled
  bool signaled = false;  // ended by a signal (a crash, for keel)
  int signal = 0;
  bool timed_out = false;
  std::string output;  // stdout and stderr, interleaved
};

/// A started child process (its own process group) whose output goes to a temp file.
struct Child {
  int pid = -1;
  std::string output_path;
};
Child spawn_process(const std::vector<std::string>& argv, const std::vector<std::string>& env = {});
Child spawn_keel(const std::vector<std::string>& args, const std::vector<std::string>& env = {});
/// Waits for `c`, killing its process group after `timeout_s`.
ProcResult wait_process(Child& c, double timeout_s = 300);

/// Runs `argv` (argv[0] is a path) with extra environment entries ("K=V"), killing it after
/// `timeout_s`. The child gets its own process group, killed as a whole on timeout.
ProcResult run_process(const std::vector<std::string>& argv, const std::vector<std::string>& env = {},
                       double timeout_s = 300);
/// Runs build/keel with `args`.
ProcResult run_keel(const std::vector<std::string>& args, const std::vector<std::string>& env = {},
                    double timeout_s = 300);

/// A TCP port that was free a moment ago on 127.0.0.1.
int free_port();

/// Runs build/keel `args` under the venv's torchrun (c10d rendezvous on a free port, `nproc`
/// ranks, --max_restarts; each attempt's output also under `log_dir`).
ProcResult run_torchrun_keel(int nproc, const std::vector<std::string>& args, const std::string& log_dir,
                             int max_restarts = 0, double timeout_s = 300);

/// A training run's files: RUN/summary.json, and (step, loss) of every line of RUN/metrics.jsonl.
std::string summary_field(const std::string& run_dir, const std::string& key);
std::vector<std::pair<long, double>> metrics_losses(const std::string& run_dir);

void write_text(const std::string& path, const std::string& text);

/// A token file: llm.c's .bin (`header`: 256 int32, magic 20240520 / version 1 for 2-byte
/// tokens, 20240801 / version 7 for 4-byte ones, header[2] = the count) or raw tokens.
/// `count` and `version` override the header's (-1: the true ones) to make bad files.
void write_token_file(const std::string& path, const std::vector<uint32_t>& tokens, int width, bool header,
                      int64_t count = -1, int32_t version = -1);
std::string read_text(const std::string& path);
bool exists(const std::string& path);
/// XORs one byte of `path`, `offset_from_end` bytes before its end, in place.
void flip_byte(const std::string& path, long offset_from_end);

/// KEEL_SOURCE_DIR + "/" + rel
std::string source_path(const std::string& rel);

}  // namespace keel::testing
