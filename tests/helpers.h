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
/// Each step's `field` (default the loss) from run_dir/metrics.jsonl, for the steps that have it.
std::vector<std::pair<long, double>> metrics_losses(const std::string& run_dir,
                                                    const std::string& field = "loss");  // null (NaN) values left out

// How far a run's parameters may drift from a control that differs only in the order in which
// its gradients are summed (issue 44; docs/building.md): derived from the computation, never a
// figure measured on one CPU. Each step's gradient element carries up to `roundings` roundings of
// relative size u = 2^-24 (a sum of N terms in another order: N - 1; the division by the world
// size and the clip's coefficient: 2 more), amplified by at most kReorderCancellation where the
// terms cancel.
inline constexpr double kFloatRounding = 5.9604644775390625e-8;  // u = 2^-24
inline constexpr double kReorderCancellation = 100;
// AdamW: the update lr * m/sqrt(v) is invariant to a common scale of the gradients, so a relative
// gradient error delta moves an element by O(lr * delta) per step; over `steps` steps, relative to
// the parameters' root mean square, ||a - b|| / ||a|| <= steps * lr * roundings * u * 100 / rms.
// (Where a gradient is pure rounding noise AdamW can move an element by up to ~lr per step: such
// elements are few, and in the L2 norm over the model they weigh as little as their count. Each
// element on its own is bounded by adamw_element_bound.) A resume that lost or misplaced the
// optimizer state moves every element by O(lr) per step, a relative drift of order
// steps * lr / rms: four orders of magnitude above this bound.
double adamw_reorder_bound(int steps, double lr, int roundings, double rms);
// The optimizer's state (AdamW's running averages of the gradients and their squares, SGD's
// momentum): a running average of gradients each off by `roundings` x u x 100 relative is off by
// as much (twice for a square), plus what the parameters' own drift (`model_bound`) changes.
double optimizer_state_reorder_bound(int roundings, double model_bound);
// The largest difference of one element between two AdamW runs over `steps` steps: twice the
// largest AdamW update, lr * (1 - beta1) / sqrt(1 - beta2), per step.
double adamw_element_bound(int steps, double lr, double beta1 = 0.9, double beta2 = 0.999);
// SGD with momentum: a step moves the parameters by lr times the momentum buffer, whose norm is at
// most grad_norm / (1 - momentum); the same roundings over `steps` steps, relative to the
// parameters' norm: steps * lr * grad_norm / (1 - momentum) * roundings * u * 100 / ||params||.
double sgd_reorder_bound(int steps, double lr, double momentum, double grad_norm, int roundings, double param_norm);
// Under bf16 autocast the forward multiplies bf16 copies of the parameters: two runs whose fp32
// parameters differ by a rounding can round an element to neighbouring bf16 values, one bf16
// unit apart (u_bf16 = 2^-8 relative), and from the first such element on their gradients differ
// by up to u_bf16 relative, not by the reordering's few u. SGD's bound with that per-step
// relative error: steps * lr * grad_norm / (1 - momentum) * u_bf16 / ||params||. Each loss comes
// from bf16 logits: two runs' losses agree to u_bf16 relative.
inline constexpr double kBf16Rounding = 0.00390625;  // 2^-8
double sgd_bf16_bound(int steps, double lr, double momentum, double grad_norm, double param_norm);

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
