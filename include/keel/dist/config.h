// keel/dist/config.h: the [dist] section. Defaults here; each key's meaning, units and range are
// written once, in the config schema (trainer/config/schema.cpp, docs/config.md).
#pragma once

#include <cstdint>
#include <string>

#include "keel/common/choices.h"

namespace keel {

enum class Backend { Auto, Gloo, Nccl };
inline constexpr Choices<Backend, 3> kBackends{
    {{"auto", Backend::Auto}, {"gloo", Backend::Gloo}, {"nccl", Backend::Nccl}}};

enum class CommHook { Allreduce, Bf16, Fp16 };
inline constexpr Choices<CommHook, 3> kCommHooks{
    {{"allreduce", CommHook::Allreduce}, {"bf16", CommHook::Bf16}, {"fp16", CommHook::Fp16}}};

/// dist.validate: which collectives are checked across ranks.
enum class Validate { Always, FirstStep, Off };
inline constexpr Choices<Validate, 3> kValidateModes{
    {{"always", Validate::Always}, {"first_step", Validate::FirstStep}, {"off", Validate::Off}}};

/// dist.consensus: when the host reads the per-step consensus (docs/concepts.md).
enum class Consensus { Auto, Step, Late };
inline constexpr Choices<Consensus, 3> kConsensusModes{
    {{"auto", Consensus::Auto}, {"step", Consensus::Step}, {"late", Consensus::Late}}};

struct DistConfig {
  Backend backend = Backend::Auto;
  int64_t timeout_s = 300;
  double bucket_cap_mb = 25.0;
  double first_bucket_mb = 1.0;
  bool find_unused_parameters = false;
  bool broadcast_buffers = true;
  CommHook comm_hook = CommHook::Allreduce;
  Validate validate = Validate::Always;
  Consensus consensus = Consensus::Auto;
  /// ZeRO stage (docs/zero.md): 0 = replicated optimizer state; 1 = optimizer state partitioned
  /// by parameter; 2 = also gradients reduce-scattered to their owner.
  int64_t zero = 0;
  /// Network interface(s) for the backend, comma-separated; "" = GLOO_SOCKET_IFNAME, else the
  /// one that routes to the rendezvous host.
  std::string interface;
  /// The flight recorder (docs/faults.md, "When a job hangs"): the last this many operations
  /// through the collectives' door per rank, dumped to <run.dir>/flight/rank<R>.json when a run
  /// fails, is signalled or stalls; 0 = off.
  int64_t flight_recorder = 2000;
};

/// The [parallel] section: how the world is laid out as a mesh (docs/architecture.md). The
/// product pp x dp x tp is the world size; dp = 0 takes what pp and tp leave.
struct ParallelConfig {
  int64_t dp = 0;
  int64_t tp = 1;
  bool sequence_parallel = false;    // with tp > 1: norms, dropout and residual adds on T / tp positions per rank
  int64_t pp = 1;                    // pipeline stages' ranks (docs/parallel.md)
  std::string pp_split = "even";     // "even" (by parameter count) or the first block of each stage after the first
  std::string pp_schedule = "1f1b";  // dist/pipeline/schedule.h's names
  int64_t pp_virtual_stages = 0;     // stages per rank; 0 = the schedule's own (1, or 2 for the multi-stage ones)
};

}  // namespace keel
