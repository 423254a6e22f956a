#include "keel/trainer/profiler.h"

#include <torch/csrc/autograd/profiler_kineto.h>

#include <cstdlib>
#include <set>

#include "keel/common/error.h"
#include "keel/common/log.h"

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
  try {
    result->save(path_);
  } catch (const std::exception& e) {  // a trace that cannot be written does not stop training
    logging::warn("profiler: cannot write {}: {}", path_, e.what());
    return;
  }
  logging::info("profiler: trace of steps {} to {} -> {} (open it in https://ui.perfetto.dev)", range_->first,
                range_->second, path_);
}

}  // namespace keel
