// trainer/config/config.h: keel's experiment configuration, assembled.
//
// Owns: the Config that holds every section, the one schema (each key's type, doc, range and
// choices: trainer/config/schema.cpp), reading a TOML file and `--section.key=value`
// overrides into it, validating everything in one place, and writing the resolved config back
// out as TOML. --help, `keel config-reference` and docs/config.md come from the schema.
// Does not own: the section structs and their defaults, which live next to their owners
// (models/config.h, dist/config.h, amp/config.h, checkpoint/config.h, trainer/data/config.h,
// trainer/compile/config.h, trainer/fault/config.h, trainer/loop_config.h); each component
// receives its own section and never reads argv, files or the environment for configuration.
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
#include "keel/common/error.h"
#include "keel/dist/config.h"
#include "keel/models/config.h"
#include "keel/trainer/compile/config.h"
#include "keel/trainer/data/config.h"
#include "keel/trainer/fault/config.h"
#include "keel/trainer/loop_config.h"

namespace keel {

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
