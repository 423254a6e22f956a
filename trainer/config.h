// trainer/config.h: keel's experiment configuration.
//
// Owns: the plain config structs (one per TOML section), their defaults and one-line docs,
// reading a TOML file and `--section.key=value` overrides into them, validating everything
// in one place, and writing the resolved config back out as TOML.
// Does not own: what the values mean at run time; each component receives its own section
// struct and never reads argv, files or the environment for configuration itself.
//
// The key names are a contract that scripts and users rely on: add keys freely, rename only
// with an alias (FieldInfo::aliases).
#pragma once

#include <cstdint>
#include <functional>
#include <set>
#include <stdexcept>
#include <string>
#include <variant>
#include <vector>

namespace keel {

/// A problem with the user's input (config file, command line, data files): reported with a
/// message naming the key or file, and mapped to exit code 2 by the CLI.
class InputError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct RunConfig {
  std::string name = "keel";          // run name, used in logs and the default run.dir
  std::string dir = "";               // output directory; "" = runs/<run.name>
  int64_t seed = 0;                   // seeds model init, data order and synthetic data
  int64_t threads = 0;                // intra-op threads per rank; 0 = cores / local ranks
  std::string device = "auto";        // auto | cpu | cuda (auto: cuda:<local_rank> if built with CUDA)
  std::string log_level = "info";     // trace | debug | info | warn | error (rank 0; others warn)
  bool all_ranks_log = false;         // log at run.log_level on every rank, not only rank 0
  bool progress = true;               // one-line progress display when stdout is a terminal
};

struct ModelConfig {
  std::string name = "cnn";           // mlp | cnn | gpt | torchscript | a registered name
  std::string path = "";              // TorchScript file (model.name = torchscript)
  int64_t width = 0;                  // hidden width; 0 = the model's default (mlp 256, gpt 256)
  int64_t depth = 0;                  // hidden layers (mlp, default 8) or blocks (gpt, default 4)
  int64_t heads = 4;                  // attention heads (gpt)
  int64_t context = 128;              // tokens per sequence (gpt, text data)
  int64_t vocab = 256;                // vocabulary size (gpt; byte-level = 256)
  std::string input = "auto";         // torchscript input kind: auto | image | tokens
  int64_t num_classes = 10;           // classes of image models
};

struct DataConfig {
  std::string name = "fashion_mnist"; // fashion_mnist | text | synthetic | a registered name
  std::string path = "";              // data location; "" = the dataset's default
  bool drop_last = true;              // drop the incomplete last batch (keeps shapes static)
  bool shuffle = true;                // reshuffle every epoch from (run.seed, epoch)
  int64_t eval_batch_size = 1000;     // per-rank batch size for evaluation
  int64_t synthetic_size = 4096;      // samples in the synthetic train split (test: 1/4 of it)
  double test_fraction = 0.1;         // text: fraction of the file (its tail) held out for eval
};

struct TrainConfig {
  int64_t steps = 1000;               // optimizer steps; train.epochs > 0 overrides it
  int64_t epochs = 0;                 // epochs over the train split; 0 = use train.steps
  int64_t batch_size = 64;            // samples per rank per micro-batch
  int64_t grad_accum = 1;             // micro-batches per optimizer step
  std::string optimizer = "adamw";    // adamw | sgd
  double lr = 1e-3;                   // peak learning rate
  double min_lr = 0.0;                // learning rate at the end of the cosine schedule
  double weight_decay = 0.0;          // decoupled (adamw) or L2 (sgd) weight decay
  double momentum = 0.9;              // sgd momentum (0 = plain sgd)
  double beta1 = 0.9;                 // adamw beta1
  double beta2 = 0.999;               // adamw beta2
  double eps = 1e-8;                  // adamw epsilon
  int64_t warmup_steps = 0;           // linear warmup from 0 to train.lr, in steps
  std::string schedule = "cosine";    // cosine | constant (after warmup)
  double grad_clip = 0.0;             // max global gradient L2 norm; 0 = no clipping
  int64_t eval_interval = 0;          // steps between evaluations; 0 = never; else also at the end
  int64_t log_interval = 50;          // steps between log lines (metrics.jsonl has every step)
  bool skip_nonfinite = false;        // skip (on every rank) a step with inf/NaN gradients
};

struct DistConfig {
  std::string backend = "auto";       // auto | gloo | nccl (auto: nccl on CUDA, gloo on CPU)
  int64_t timeout_s = 300;            // bound on rendezvous and every collective, seconds
  double bucket_cap_mb = 25.0;        // DDP gradient bucket size, MiB
  double first_bucket_mb = 1.0;       // size of the first (earliest ready) bucket, MiB
  bool find_unused_parameters = false;// tolerate parameters that get no gradient
  std::string comm_hook = "allreduce";// allreduce | bf16 | fp16 (gradient compression)
  std::string validate = "always";    // always | first_step | off: cross-rank collective checks
};

struct CompileConfig {
  std::string mode = "off";           // off | trace
  bool fullgraph = false;             // anything that prevents one static graph is an error
  bool deterministic = false;         // non-deterministic ops in the graph are an error
  int64_t max_recompiles = 8;         // shape re-specialisations before it is an error
  std::string cache_dir = "";         // persistent compile cache; "" = none
  bool cuda_graphs = false;           // capture the whole step as a CUDA graph (CUDA builds)
};

struct AmpConfig {
  std::string dtype = "off";          // off | bf16 | fp16 (fp16: CUDA only)
  std::string loss_scaling = "auto";  // auto | dynamic | off (auto: dynamic for fp16)
  double init_scale = 65536.0;        // GradScaler initial scale
  double growth_factor = 2.0;         // scale multiplier after growth_interval clean steps
  double backoff_factor = 0.5;        // scale multiplier after a non-finite step
  int64_t growth_interval = 2000;     // clean steps between scale growths
};

struct CheckpointConfig {
  std::string dir = "";               // checkpoint root; "" = no checkpoints
  int64_t interval = 0;               // steps between saves; 0 = only the final one
  int64_t keep = 3;                   // committed steps kept (at least 2 with async)
  bool async = false;                 // write in a background thread
  std::string resume_from = "";       // a step directory to resume from; "" = newest committed
  bool save_graph = false;            // also store the traced module (compile.mode = trace)
};

struct FaultConfig {
  std::vector<std::string> inject;    // TYPE@step=S,rank=R entries; empty = no faults
};

/// The whole resolved configuration. `explicit_keys` records which "section.key" names were set
/// by the file or the command line (the rest are defaults).
struct Config {
  RunConfig run;
  ModelConfig model;
  DataConfig data;
  TrainConfig train;
  DistConfig dist;
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
  std::string section;                // "train"
  std::string key;                    // "lr"
  FieldType type;
  std::string doc;                    // one line: meaning, units, sentinels
  std::vector<std::string> choices;   // allowed values of a String field; empty = any
  bool has_min = false, has_max = false;
  double min = 0, max = 0;            // inclusive range of a numeric field
  std::vector<std::string> aliases;   // older names accepted for this key
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
