#include "trainer/profiler.h"

#include <torch/csrc/autograd/profiler_kineto.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <set>

#include "common/log.h"
#include "keel/common/error.h"

namespace keel {

StepProfiler::StepProfiler(std::optional<std::pair<int64_t, int64_t>> range, std::string path,
                           const torch::Device& device)
    : range_(range), path_(std::move(path)), cuda_(device.is_cuda()) {}

StepProfiler::~StepProfiler() {
  try {
    finish();
  } catch (const std::exception& e) {
    logging::warn("run.profile_steps: {}", e.what());
  }
}

namespace {
std::set<torch::profiler::impl::ActivityType> activities(bool cuda) {
  std::set<torch::profiler::impl::ActivityType> a = {torch::profiler::impl::ActivityType::CPU};
  if (cuda) a.insert(torch::profiler::impl::ActivityType::CUDA);
  return a;
}
torch::profiler::impl::ProfilerConfig config() {
  return torch::profiler::impl::ProfilerConfig(torch::profiler::impl::ProfilerState::KINETO,
                                               /*report_input_shapes=*/true);
}

// Saves `result` as the Chrome trace `path`; "" on success, else why it could not. Kineto's
// save does not report a trace it could not write (it logs and returns, and a file that was
// never written looked saved): the trace goes to a temporary file beside `path`, made here
// first (so that a directory that cannot be written to is named with its reason), checked to
// be a regular file holding a whole JSON object, then renamed onto `path` (which fails on a
// directory there, and never leaves a half-written trace under the name).
std::string save_trace(torch::autograd::profiler::ProfilerResult& result, const std::string& path) {
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return "cannot create " + tmp + ": " + std::strerror(errno);
  ::close(fd);
  auto fail = [&](const std::string& why) {
    ::unlink(tmp.c_str());
    ::unlink((tmp + ".tmp").c_str());  // Kineto's own temporary file, should it have left one
    return why;
  };
  try {
    result.save(tmp);
  } catch (const std::exception& e) {
    return fail(e.what());
  }
  struct stat st {};
  if (::lstat(tmp.c_str(), &st) != 0)
    return fail("the profiler left no file (" + tmp + ": " + std::strerror(errno) + ")");
  if (!S_ISREG(st.st_mode)) return fail("the profiler left something other than a file at " + tmp);
  if (st.st_size == 0) return fail("the profiler wrote nothing to " + tmp + " (a full disk?)");
  // A whole trace is one JSON object: its last character other than white space is '}'.
  const int in = ::open(tmp.c_str(), O_RDONLY | O_CLOEXEC);
  if (in < 0) return fail("cannot read back " + tmp + ": " + std::strerror(errno));
  char tail[64];
  const off_t from = st.st_size > static_cast<off_t>(sizeof tail) ? st.st_size - static_cast<off_t>(sizeof tail) : 0;
  const ssize_t got = ::pread(in, tail, sizeof tail, from);
  ::close(in);
  ssize_t last = got - 1;
  while (last >= 0 && (tail[last] == ' ' || tail[last] == '\n' || tail[last] == '\r' || tail[last] == '\t')) --last;
  if (last < 0 || tail[last] != '}')
    return fail("the trace the profiler wrote is incomplete (" + std::to_string(st.st_size) + " bytes; a full disk?)");
  if (::rename(tmp.c_str(), path.c_str()) != 0)  // EISDIR: a directory holds the name
    return fail(std::string(std::strerror(errno)) + " (renaming " + tmp + " onto it)");
  return "";
}
}  // namespace

void StepProfiler::start() {
  // On a CPU device Kineto still probes for GPUs and logs "gpuGetDeviceCount failed" as an
  // ERROR on machines without one: quiet it there, unless the user set the level.
  if (!cuda_) ::setenv("KINETO_LOG_LEVEL", "5", /*overwrite=*/0);
  torch::autograd::profiler::prepareProfiler(config(), activities(cuda_));
  torch::autograd::profiler::enableProfiler(config(), activities(cuda_));
  active_ = true;
  logging::info("profiler: recording steps {} to {}", range_->first, range_->second);
}

void StepProfiler::stop() {
  active_ = false;
  auto result = torch::autograd::profiler::disableProfiler();
  // A trace that cannot be written does not stop training: warned, naming the file and why.
  const std::string problem = result ? save_trace(*result, path_) : std::string("the profiler returned no result");
  if (!problem.empty()) {
    logging::warn("profiler: cannot write the trace {}: {}; training goes on without it", path_, problem);
    return;
  }
  logging::info("profiler: trace of steps {} to {} -> {} (open it in https://ui.perfetto.dev)", range_->first,
                range_->second, path_);
}

}  // namespace keel
