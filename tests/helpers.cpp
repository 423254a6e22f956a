#include "helpers.h"

#include <nlohmann/json.hpp>

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <thread>

namespace keel::testing {

namespace {
// ATEN_CPU_CAPABILITY (ctest's second numerics pass sets it: tests/CMakeLists.txt) holds MKL and
// oneDNN to the same kernel set, for this process and the ranks and keel runs it starts: set
// before any kernel runs (each library reads its variable at its first use).
const bool kKernelSetMatched = [] {
  const char* aten = std::getenv("ATEN_CPU_CAPABILITY");
  if (!aten || !*aten) return false;
  const std::string isa = aten;
  const char* mkl = isa == "avx512" ? "AVX512" : isa == "avx2" ? "AVX2" : "SSE4_2";
  const char* onednn = isa == "avx512" ? "AVX512_CORE" : isa == "avx2" ? "AVX2" : "SSE41";
  setenv("MKL_ENABLE_INSTRUCTIONS", mkl, /*overwrite=*/0);
  setenv("ONEDNN_MAX_CPU_ISA", onednn, /*overwrite=*/0);
  return true;
}();
}  // namespace

TempDir::TempDir() {
  const char* base = std::getenv("TMPDIR");
  std::string tmpl = std::string(base && *base ? base : "/tmp") + "/keel-test-XXXXXX";
  std::vector<char> buf(tmpl.begin(), tmpl.end());
  buf.push_back('\0');
  if (!mkdtemp(buf.data())) throw std::runtime_error("mkdtemp failed: " + std::string(std::strerror(errno)));
  path_ = buf.data();
}

TempDir::~TempDir() {
  std::error_code ec;
  std::filesystem::remove_all(path_, ec);
}

Child spawn_process(const std::vector<std::string>& argv, const std::vector<std::string>& env) {
  char out_tmpl[] = "/tmp/keel-proc-XXXXXX";
  int out_fd = mkstemp(out_tmpl);
  if (out_fd < 0) throw std::runtime_error("mkstemp failed");
  pid_t pid = fork();
  if (pid < 0) throw std::runtime_error("fork failed");
  if (pid == 0) {
    setpgid(0, 0);
    dup2(out_fd, STDOUT_FILENO);
    dup2(out_fd, STDERR_FILENO);
    int devnull = open("/dev/null", O_RDONLY);
    if (devnull >= 0) dup2(devnull, STDIN_FILENO);
    for (const auto& kv : env) putenv(strdup(kv.c_str()));
    std::vector<char*> args;
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    execv(args[0], args.data());
    std::fprintf(stderr, "execv %s failed: %s\n", args[0], std::strerror(errno));
    _exit(127);
  }
  setpgid(pid, pid);
  close(out_fd);
  return Child{pid, out_tmpl};
}

ProcResult wait_process(Child& c, double timeout_s) {
  ProcResult r;
  int status = 0;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  for (;;) {
    pid_t w = waitpid(c.pid, &status, WNOHANG);
    if (w == c.pid) break;
    if (std::chrono::steady_clock::now() > deadline) {
      r.timed_out = true;
      kill(-c.pid, SIGKILL);
      waitpid(c.pid, &status, 0);
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  if (WIFSIGNALED(status)) {
    r.signaled = true;
    r.signal = WTERMSIG(status);
  } else if (WIFEXITED(status)) {
    r.exit_code = WEXITSTATUS(status);
  }
  r.output = read_text(c.output_path);
  unlink(c.output_path.c_str());
  c.pid = -1;
  return r;
}

ProcResult run_process(const std::vector<std::string>& argv, const std::vector<std::string>& env, double timeout_s) {
  Child c = spawn_process(argv, env);
  return wait_process(c, timeout_s);
}

Child spawn_keel(const std::vector<std::string>& args, const std::vector<std::string>& env) {
  std::vector<std::string> argv = {KEEL_BINARY};
  argv.insert(argv.end(), args.begin(), args.end());
  return spawn_process(argv, env);
}

ProcResult run_keel(const std::vector<std::string>& args, const std::vector<std::string>& env, double timeout_s) {
  std::vector<std::string> argv = {KEEL_BINARY};
  argv.insert(argv.end(), args.begin(), args.end());
  return run_process(argv, env, timeout_s);
}

int free_port() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
  socklen_t len = sizeof a;
  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  int port = ntohs(a.sin_port);
  close(fd);
  return port;
}

ProcResult run_torchrun_keel(int nproc, const std::vector<std::string>& args, const std::string& log_dir,
                             int max_restarts, double timeout_s) {
  // An explicit endpoint on a free port (PyTorch 1.13's --standalone always took port 29400, so
  // two jobs at once shared it; 2.11's picks a free one, and Restart.* tests it).
  std::vector<std::string> argv = {
      KEEL_TORCHRUN, "--nnodes=1", "--rdzv_backend=c10d", "--rdzv_endpoint=127.0.0.1:" + std::to_string(free_port()),
      "--rdzv_id=keel-test-" + std::to_string(::getpid()), "--nproc_per_node=" + std::to_string(nproc),
      "--max_restarts=" + std::to_string(max_restarts), "--no_python",
      // --tee 3 keeps each attempt's output under log_dir as well.
      "--tee", "3", "--log_dir", log_dir, KEEL_BINARY};
  argv.insert(argv.end(), args.begin(), args.end());
  return run_process(argv, {}, timeout_s);
}

std::string summary_field(const std::string& run_dir, const std::string& key) {
  auto j = nlohmann::json::parse(read_text(run_dir + "/summary.json"));
  return j.contains(key) ? j[key].dump() : "<absent>";
}

double adamw_reorder_bound(int steps, double lr, int roundings, double rms) {
  return steps * lr * roundings * kFloatRounding * kReorderCancellation / rms;
}

double optimizer_state_reorder_bound(int roundings, double model_bound) {
  return 2 * roundings * kFloatRounding * kReorderCancellation + model_bound;
}

double adamw_element_bound(int steps, double lr, double beta1, double beta2) {
  return steps * 2 * lr * (1 - beta1) / std::sqrt(1 - beta2);
}

double sgd_reorder_bound(int steps, double lr, double momentum, double grad_norm, int roundings, double param_norm) {
  return steps * lr * grad_norm / (1 - momentum) * roundings * kFloatRounding * kReorderCancellation / param_norm;
}

double sgd_bf16_bound(int steps, double lr, double momentum, double grad_norm, double param_norm) {
  return steps * lr * grad_norm / (1 - momentum) * kBf16Rounding / param_norm;
}

std::vector<std::pair<long, double>> metrics_losses(const std::string& run_dir, const std::string& field) {
  std::vector<std::pair<long, double>> out;
  std::ifstream in(run_dir + "/metrics.jsonl");
  std::string line;
  while (std::getline(in, line)) {
    auto j = nlohmann::json::parse(line);
    if (j.contains(field) && !j[field].is_null()) out.emplace_back(j["step"].get<long>(), j[field].get<double>());
  }
  return out;
}

void write_token_file(const std::string& path, const std::vector<uint32_t>& tokens, int width, bool header,
                      int64_t count, int32_t version) {
  std::string bytes;
  if (header) {
    std::vector<int32_t> h(256, 0);
    h[0] = width == 2 ? 20240520 : 20240801;
    h[1] = version >= 0 ? version : (width == 2 ? 1 : 7);
    h[2] = static_cast<int32_t>(count >= 0 ? count : static_cast<int64_t>(tokens.size()));
    bytes.append(reinterpret_cast<const char*>(h.data()), h.size() * sizeof(int32_t));
  }
  for (const uint32_t t : tokens) {
    const uint16_t narrow = static_cast<uint16_t>(t);
    if (width == 2)
      bytes.append(reinterpret_cast<const char*>(&narrow), 2);
    else
      bytes.append(reinterpret_cast<const char*>(&t), 4);
  }
  write_text(path, bytes);
}

void write_text(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary);
  out << text;
  if (!out) throw std::runtime_error("cannot write " + path);
}

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

bool exists(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0;
}

std::string source_path(const std::string& rel) { return std::string(KEEL_SOURCE_DIR) + "/" + rel; }

void flip_byte(const std::string& path, long offset_from_end) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(-offset_from_end, std::ios::end);
  char c;
  f.read(&c, 1);
  c = static_cast<char>(c ^ 0x5a);
  f.seekp(-offset_from_end, std::ios::end);
  f.write(&c, 1);
}

}  // namespace keel::testing
