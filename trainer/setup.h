// trainer/setup.h: the steps that turn a config into a process ready to train, before the
// loop's components exist.
//
// Owns: the allocator tuning, the intra-op thread count, the device, the autocast choice,
// compiling on every rank with one agreed outcome, and what the build of a run needs from the
// config alone (the model it names, the dropout check, the Inductor request, the package seed).
// Each is a function of its config section (and the world), called once by Trainer.
#pragma once

#include <torch/torch.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "keel/amp/config.h"
#include "keel/dist/collectives.h"
#include "keel/dist/world.h"
#include "keel/models/config.h"
#include "keel/models/model.h"
#include "keel/trainer/config/config.h"
#include "trainer/compile/inductor.h"
#include "trainer/compile/python_model.h"
#include "trainer/compile/transforms.h"

namespace keel {

/// glibc: keeps freed memory in the heap instead of returning each large block to the kernel.
void tune_allocator();

/// Sets LibTorch's intra-op threads: run.threads, or the node's cores shared by its ranks.
/// Returns the count.
int64_t set_threads(const RunConfig& run, const dist::World& world);

/// run.device resolved: cuda:<local_rank % devices> or cpu. Throws InputError for "cuda"
/// without a usable GPU.
torch::Device resolve_device(const RunConfig& run, const dist::World& world);

/// amp.dtype on the resolved device.
struct AmpContext {
  bool enabled = false;
  c10::ScalarType dtype = c10::kBFloat16;
  /// Throws InputError for fp16 on a CPU device.
  static AmpContext resolve(const AmpConfig& cfg, const torch::Device& device);
};

/// One rank's attainable matrix-multiply throughput on `device`, in TFLOP/s: a short square
/// GEMM (CPU: float32, 512; CUDA: the autocast dtype or float32, 8192), timed for about 50 ms.
/// The denominator of MFU when run.peak_tflops is not given.
double measure_peak_tflops(const torch::Device& device, const AmpContext& amp);

/// What determines the model's graph, for the compile cache: every [model] key, the bytes of a
/// TorchScript file, and amp.dtype.
std::string compile_identity(const ModelConfig& model, const AmpConfig& amp);

/// Collective. Runs `compile` on this rank and agrees on the outcome: a CompileError on any
/// rank is thrown on every rank (instead of leaving the others waiting in DDP's first
/// collective), naming the rank whose log says why.
CompiledModel compile_on_every_rank(dist::Collectives& coll, const std::function<CompiledModel()>& compile);

/// Whether an error message is an allocation failure (CPU or CUDA).
bool is_out_of_memory(const std::string& what);

/// Dropout is the eager model's: compile.mode other than "off" with a model that drops out is
/// refused (InputError naming model.dropout); a probability from init_from's config.json is logged.
void check_dropout(const Config& cfg);

/// What compile.mode = "inductor" packages for this run: the model at the training batch, with
/// the run's precision, device and threads (`python`: model.name = "python"'s module, or null).
InductorRequest inductor_request(const Config& cfg, const models::Model& model, const torch::Device& device,
                                 const AmpContext& amp, int64_t threads, const PythonModel* python = nullptr);

/// The model cfg.model names: "python" is a user's PyTorch module (trainer/compile/python_model.h),
/// anything else comes from the model registry.
std::shared_ptr<models::Model> make_model(const Config& cfg, std::optional<models::InputKind> data_kind);

/// The checkpoint step whose stored package may seed the compile cache (checkpoint.save_graph):
/// resume_from's step, else the newest committed one, of this run's own checkpoint.dir; "" none.
std::string package_seed_dir(const CheckpointConfig& c);

}  // namespace keel
