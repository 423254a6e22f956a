// trainer/loop_config.h: the [run] and [train] sections, owned by the training loop. Defaults
// here; each key's meaning, units and range are written once, in the config schema
// (trainer/config/schema.cpp, docs/config.md).
#pragma once

#include <cstdint>
#include <string>

#include "keel/common/choices.h"
#include "keel/common/log_level.h"

namespace keel {

enum class DeviceChoice { Auto, Cpu, Cuda };
inline constexpr Choices<DeviceChoice, 3> kDeviceChoices{
    {{"auto", DeviceChoice::Auto}, {"cpu", DeviceChoice::Cpu}, {"cuda", DeviceChoice::Cuda}}};

inline constexpr Choices<logging::Level, 5> kLogLevels{{{"trace", logging::Level::trace},
                                                        {"debug", logging::Level::debug},
                                                        {"info", logging::Level::info},
                                                        {"warn", logging::Level::warn},
                                                        {"error", logging::Level::error}}};

/// run.sync_debug: CUDA's sync debug mode over the steady steps (c10::cuda::SyncDebugMode).
enum class SyncDebug { Off, Warn, Error };
inline constexpr Choices<SyncDebug, 3> kSyncDebugModes{
    {{"off", SyncDebug::Off}, {"warn", SyncDebug::Warn}, {"error", SyncDebug::Error}}};

enum class OptimizerKind { AdamW, Sgd };
inline constexpr Choices<OptimizerKind, 2> kOptimizers{{{"adamw", OptimizerKind::AdamW}, {"sgd", OptimizerKind::Sgd}}};

struct RunConfig {
  std::string name = "keel";
  std::string dir = "";
  int64_t seed = 0;
  int64_t threads = 0;
  DeviceChoice device = DeviceChoice::Auto;
  logging::Level log_level = logging::Level::info;
  bool all_ranks_log = false;
  bool progress = true;
  bool tensorboard = true;         // rank 0 writes TensorBoard event files under <dir>/tb/
  std::string profile_steps = "";  // "A-B": a profiler trace of those steps (trainer/profiler.h)
  double peak_tflops = 0;          // one rank's peak for MFU; 0 = measured at start (models that report FLOPs)
  SyncDebug sync_debug = SyncDebug::Off;
};

struct TrainConfig {
  int64_t steps = 1000;
  int64_t epochs = 0;
  int64_t batch_size = 64;
  int64_t grad_accum = 1;
  OptimizerKind optimizer = OptimizerKind::AdamW;
  double lr = 1e-3;
  double min_lr = 0.0;
  double weight_decay = 0.0;
  double momentum = 0.9;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  int64_t warmup_steps = 0;
  std::string schedule = "cosine";     // a registered schedule (trainer/trainer.h register_schedule)
  std::string loss = "cross_entropy";  // a registered loss (trainer/trainer.h register_loss)
  double grad_clip = 0.0;
  int64_t eval_interval = 0;
  int64_t log_interval = 50;
  bool skip_nonfinite = false;
  bool fused_optimizer = true;  // one ATen kernel per step (_fused_adamw_ / _fused_sgd_); false: torch::optim's loop
};

}  // namespace keel
