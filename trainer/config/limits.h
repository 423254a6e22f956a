// trainer/config/limits.h: what a config may ask for beyond the schema's per-key ranges.
//
// Owns: the memory a config needs before anything is allocated: the parameters, gradients and optimizer
// state of a built-in model (mlp, cnn, gpt, gpt2, llama), one micro-batch's activations and the
// synthetic dataset, per rank of the mesh (parallel.tp's slices, ZeRO's shards over dp), all
// computed from the config alone, against the memory this host has available.
// A config that cannot fit is bad input (exit 2) naming the keys and the sizes, instead of an
// allocator failure naming nothing.
// Does not own: the schema (trainer/config/schema.cpp), the models (models/), the datasets
// (trainer/data/).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "keel/trainer/config/config.h"

namespace keel {

/// Parameters of a built-in model (mlp, cnn, gpt) as `model` makes it, counted from the
/// config without building it (the same count as Model::num_parameters()); nullopt for any
/// other model (torchscript, registered models). A double: the documented maxima reach 10^13.
std::optional<double> estimate_parameters(const ModelConfig& model);

/// Of those, the parameters a tensor-parallel rank holds whole (what the family's tp plan does not
/// split: norms, row-parallel biases, a position embedding) for gpt, gpt2 and llama; nullopt for
/// any other model. docs/parallel.md's P_r: a rank of parallel.tp = t holds (P - P_r) / t + P_r.
std::optional<double> estimate_replicated_parameters(const ModelConfig& model);

/// One part of what a rank needs, for the message.
struct MemoryItem {
  std::string text;     // "model.width = 65536, ... make the mlp model 1.3e+10 parameters: 207.0 GB with ..."
  std::string culprit;  // the key of this part that is furthest above its default
  double bytes = 0;
};

/// Lower bounds of what one rank allocates, from the config alone: what is counted is
/// allocated for certain (keel allocates more: DDP buckets, temporaries, the allocator's
/// slack), so a config refused by it cannot run.
struct MemoryEstimate {
  double parameters = 0;          // of a built-in model; 0 = not known
  double model_bytes = 0;         // parameters + gradients + optimizer state (float32)
  double activation_bytes = 0;    // one training micro-batch: tensors saved for backward
  double data_bytes = 0;          // the synthetic dataset: its peak while it is made, or kept + the sampler's order
  double host_bytes = 0;          // one rank's peak in host memory (the phases of a run, each a sum)
  double device_bytes = 0;        // on a GPU, one rank's peak there (model state, activations); 0 on the CPU
  std::vector<MemoryItem> items;  // what is in host memory, largest first
  std::vector<MemoryItem> device_items;  // what is in GPU memory, largest first (on a GPU)
};

/// `dp_size`: the data-parallel degree (dist::Mesh::dp(); ZeRO partitions over it, the data is split by it);
/// `on_cuda`: the rank trains on a GPU (then only the parameters, built on the CPU first, and
/// the data are in host memory; the rest is in device_bytes).
MemoryEstimate estimate_memory(const Config& cfg, int64_t dp_size, bool on_cuda);

/// Whether the model is built as each rank's shards (models/deferred_init.h): model.sharded_init,
/// at dist.zero = 3 or parallel.tp > 1, for a family that builds deferred (models::builds_deferred:
/// gpt, gpt2, llama; mlp and cnn, which have no tp plan, at dist.zero = 3).
bool builds_sharded(const Config& cfg);

/// This process's peak resident memory so far (getrusage), MiB.
double peak_resident_mib();

/// Bytes this process can still get: /proc/meminfo's MemAvailable (else the physical memory),
/// at most the cgroup's memory limit, plus SwapFree. nullopt when nothing can be read.
std::optional<double> available_memory_bytes();

/// Free bytes of CUDA device `index` (LibTorch's CUDA allocator: cudaMemGetInfo); nullopt when
/// it cannot be asked (a CPU-only LibTorch, no such device).
std::optional<double> device_free_bytes(int index);

/// "" when `ranks_on_host` ranks of `cfg` fit in `available_bytes` of host memory (and, on a
/// GPU with `device_available_bytes` known, one rank in that), else the message naming the
/// keys and the sizes ("... needs at least 207.0 GB of memory but 20.0 GB is available ...;
/// lower model.width"). At most about 1 KiB.
std::string memory_problem(const Config& cfg, int64_t dp_size, int64_t ranks_on_host, bool on_cuda,
                           double available_bytes, std::optional<double> device_available_bytes = std::nullopt);

/// memory_problem() against available_memory_bytes() and, with `device_index` >= 0 on a GPU,
/// device_free_bytes(device_index); throws InputError (exit 2) with it. Call once per rank
/// before the model and the data are built. Nothing is checked where the memory is unknown.
void check_memory(const Config& cfg, int64_t dp_size, int64_t ranks_on_host, bool on_cuda, int device_index = -1);

}  // namespace keel
