#include "trainer/setup.h"

#include <algorithm>
#include <chrono>
#include <limits>

#ifdef __GLIBC__
#include <malloc.h>
#endif

#include <optional>
#include <thread>

#include "common/log.h"
#include "keel/common/error.h"
#include "keel/trainer/config/config.h"
#include "trainer/compile/compile_cache.h"

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
    if (f.section == "model") id += f.key + "=" + to_toml_literal(f.get(c)) + ";";
  if (model.name == "torchscript") id += "file_sha256=" + sha256_hex(read_file(model.path, kMaxInputBytes));
  return id + "amp.dtype=" + choice_name(kAmpDtypes, amp.dtype);
}

CompiledModel compile_on_every_rank(dist::Collectives& coll, const std::function<CompiledModel()>& compile) {
  std::optional<CompiledModel> compiled;
  std::string error;
  try {
    compiled.emplace(compile());
  } catch (const CompileError& e) {
    error = e.what();
  }
  if (const dist::RankError e = dist::first_error(coll, error, "compile outcome")) {
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

}  // namespace keel
