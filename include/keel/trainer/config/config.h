// keel/trainer/config/config.h: keel's experiment configuration, assembled.
//
// Owns: the Config that holds every section, the sections of the trainer's own components
// ([run], [train], [data], [compile], [fault]: defaults here), the one schema (each key's
// type, doc, range and choices: trainer/config/schema.cpp), reading a TOML file and
// `--section.key=value` overrides into it, validating everything in one place, and writing the
// resolved config back out as TOML. --help, `keel config-reference` and docs/config.md come
// from the schema.
// Does not own: the sections of the layers below the trainer, which live next to their owners
// (keel/models/config.h, keel/dist/config.h, keel/amp/config.h, keel/checkpoint/config.h);
// each component receives its own section and never reads argv, files or the environment for
// configuration.
//
// The key names are a contract that scripts and users rely on: add keys freely, rename only
// with an alias (FieldInfo::aliases).
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "keel/amp/config.h"
#include "keel/checkpoint/config.h"
#include "keel/common/choices.h"
#include "keel/common/error.h"
#include "keel/common/log_level.h"
#include "keel/dist/config.h"
#include "keel/models/config.h"

namespace keel {

// [run] and [train]: the training loop's. Each key's meaning, units and range are written once,
// in the config schema (trainer/config/schema.cpp, docs/config.md).

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
  bool count_tensor_memory = false;  // count live CPU tensor bytes (summary.json's cpu_tensor_*_mb)
};

/// train.activation_checkpointing: what a block's backward recomputes (dist/recompute.h).
enum class ActivationCheckpointing { None, Blocks, Selective };
inline constexpr Choices<ActivationCheckpointing, 3> kActivationCheckpointing{
    {{"none", ActivationCheckpointing::None},
     {"blocks", ActivationCheckpointing::Blocks},
     {"selective", ActivationCheckpointing::Selective}}};

struct TrainConfig {
  int64_t steps = 1000;
  int64_t epochs = 0;
  int64_t batch_size = 64;
  int64_t grad_accum = 1;
  std::string optimizer = "adamw";  // a registered optimizer (keel/trainer/trainer.h register_optimizer)
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
  int64_t ignore_index = -100;         // cross_entropy: targets equal to it count for nothing (PyTorch's default)
  double grad_clip = 0.0;
  int64_t eval_interval = 0;
  int64_t log_interval = 50;
  bool skip_nonfinite = false;
  bool grads_to_none = true;  // free gradients no DDP bucket or ZeRO shard holds between steps (zero_grad(set_to_none))
  bool fused_optimizer = true;  // one ATen kernel per step (_fused_adamw_ / _fused_sgd_); false: torch::optim's loop
  ActivationCheckpointing activation_checkpointing = ActivationCheckpointing::None;
};

// [data]: the data pipeline's (trainer/data/).
/// data.token_dtype: how a token file (data.name = "tokens") stores its tokens.
enum class TokenDtype { Auto, Uint16, Uint32 };
inline constexpr Choices<TokenDtype, 3> kTokenDtypes{
    {{"auto", TokenDtype::Auto}, {"uint16", TokenDtype::Uint16}, {"uint32", TokenDtype::Uint32}}};

struct DataConfig {
  std::string name = "fashion_mnist";
  std::string path = "";
  bool drop_last = true;
  bool shuffle = true;
  int64_t eval_batch_size = 1000;
  int64_t eval_samples = 0;  // test-split samples an evaluation uses, the first ones; 0 = all
  int64_t synthetic_size = 4096;
  double test_fraction = 0.1;
  TokenDtype token_dtype = TokenDtype::Auto;  // tokens: auto = llm.c's header says; else raw tokens
  std::string test_path = "";                 // tokens: held-out token file(s); "" = data.path's tail
};

// [compile]: the compile stage's (trainer/compile/).
enum class CompileMode { Off, Trace, Inductor };
inline constexpr Choices<CompileMode, 3> kCompileModes{
    {{"off", CompileMode::Off}, {"trace", CompileMode::Trace}, {"inductor", CompileMode::Inductor}}};

/// compile.granularity: what one inductor package holds. auto: blocks where the placement needs
/// them (dist.zero = 3 gathers each block's parameters around it), else step.
enum class CompileGranularity { Auto, Step, Blocks };
inline constexpr Choices<CompileGranularity, 3> kCompileGranularities{
    {{"auto", CompileGranularity::Auto}, {"step", CompileGranularity::Step}, {"blocks", CompileGranularity::Blocks}}};

struct CompileConfig {
  CompileMode mode = CompileMode::Off;
  CompileGranularity granularity = CompileGranularity::Auto;
  bool fullgraph = false;
  bool deterministic = false;
  int64_t max_recompiles = 8;
  std::string cache_dir = "";
  bool cuda_graphs = false;
  bool cuda_graphs_rehearsal = false;  // cuda_graphs' orchestration on the CPU, each replay re-running the step
  bool max_autotune = false;           // inductor: autotune kernels (a slower compile)
  std::string python = "";             // inductor: the packaging step's Python; "" = $KEEL_PYTHON, else keel's venv
  std::vector<std::string>
      libraries;  // inductor: shared libraries of custom ops (TORCH_LIBRARY), loaded here and there
};

// [fault]: fault injection (trainer/fault/fault.h parses the entries).
struct FaultConfig {
  std::vector<std::string> inject;  // TYPE@step=S,rank=R entries (docs/faults.md)
};

/// The whole resolved configuration. `explicit_keys` records which "section.key" names were set
/// by the file or the command line (the rest are defaults).
struct Config {
  RunConfig run;
  ModelConfig model;
  DataConfig data;
  TrainConfig train;
  DistConfig dist;
  ParallelConfig parallel;
  CompileConfig compile;
  AmpConfig amp;
  CheckpointConfig checkpoint;
  FaultConfig fault;

  std::set<std::string> explicit_keys;
  bool is_explicit(const std::string& dotted) const { return explicit_keys.count(dotted) > 0; }
};

/// A value as read from TOML or the command line, before it is stored in a field.
using Value = std::variant<bool, int64_t, double, std::string, std::vector<std::string>>;

enum class FieldType { Bool, Int, Float, String, StringList };
const char* field_type_name(FieldType t);

/// Metadata for one config key; the schema is the single source for TOML parsing, the CLI's
/// options and --help, the resolved config file and docs/config.md.
struct FieldInfo {
  std::string section;  // "train"
  std::string key;      // "lr"
  FieldType type;
  std::string doc;                   // one line: meaning, units, sentinels
  std::vector<std::string> choices;  // allowed values of a String field; empty = any
  bool has_min = false, has_max = false;
  double min = 0, max = 0;           // inclusive range of a numeric field
  bool max_exclusive = false;        // max itself is out of range: value < max (train.beta1 < 1)
  std::vector<std::string> aliases;  // older names accepted for this key
  std::function<void(Config&, const Value&)> set;
  std::function<Value(const Config&)> get;

  std::string dotted() const { return section + "." + key; }
};

/// Every config key, in section order.
const std::vector<FieldInfo>& config_schema();
/// The section names, in order.
const std::vector<std::string>& config_sections();
/// The field named "section.key" (or an alias), or nullptr.
const FieldInfo* find_field(const std::string& dotted);

/// Renders a value as a TOML literal ("0.001", "\"adamw\"", "[\"a\", \"b\"]").
std::string to_toml_literal(const Value& v);

/// Parses a TOML file into `cfg` (keys not in the file keep their values). Throws InputError
/// naming file:line:column and the key for syntax errors, unknown sections or keys, and wrong
/// types or out-of-range values.
void load_toml_file(const std::string& path, Config& cfg);

/// After the command-line layer: where the command line set one of two keys that exclude each
/// other (train.steps, train.epochs) and the file set the other, the command line wins and
/// the file's value is dropped. `cli_keys`: the "section.key" names given on the command line.
void command_line_wins(Config& cfg, const std::set<std::string>& cli_keys);
/// Parses TOML text (for tests); `origin` names the source in messages.
void load_toml_string(const std::string& text, const std::string& origin, Config& cfg);

/// Applies one command-line override `section.key` = `text` (text as typed). List fields
/// append (repeat the option to give several entries). Throws InputError naming the option.
void apply_override(Config& cfg, const std::string& dotted, const std::string& text);

/// Cross-field validation and defaults that depend on other keys (run.dir). Throws InputError.
void validate(Config& cfg);

/// Whether compile.mode = "inductor" packages the transformer block rather than the whole step:
/// compile.granularity = "blocks", or "auto" at dist.zero = 3.
bool compiles_blocks(const Config& cfg);

/// run.profile_steps: "A-B" -> (A, B) with 1 <= A <= B; "" -> nullopt. Throws InputError
/// naming the key.
std::optional<std::pair<int64_t, int64_t>> parse_profile_steps(const std::string& text);

/// The resolved config as TOML text (every key, with its doc as a comment), loadable again.
std::string dump_toml(const Config& cfg);

/// The config reference as Markdown (docs/config.md is this text; a test keeps them equal).
std::string config_reference_markdown();

/// Reads a whole regular file of at most `max_bytes` into a string (a directory, FIFO or device
/// is refused before anything is read). Throws InputError naming the file.
std::string read_file(const std::string& path, uint64_t max_bytes);

/// Largest config file keel reads.
constexpr uint64_t kMaxConfigBytes = 16u << 20;
/// Largest text, model or data file keel reads whole.
constexpr uint64_t kMaxInputBytes = uint64_t(2) << 30;

}  // namespace keel
