#include "trainer/app/cli.h"

#include <torch/torch.h>
#include <CLI/CLI.hpp>
#include "common/log.h"
#include "common/stop.h"

#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <csignal>
#include <cstring>
#include <functional>
#include <iostream>
#include <map>
#include <optional>
#include <set>
#include <vector>

#include "checkpoint/inspect.h"
#include "keel/dist/world.h"
#include "keel/trainer/config/config.h"
#include "keel/trainer/trainer.h"
#include "keel/version.h"
#include "trainer/app/doctor.h"
#include "trainer/app/export.h"
#include "trainer/app/plot.h"
#include "trainer/compile/inductor.h"
#include "trainer/compile/packaging.h"
#include "trainer/config/pipeline.h"

namespace keel {
namespace {

constexpr int kExitInput = 2;
constexpr int kExitFailure = 1;

std::string first_line(const std::string& s) { return s.substr(0, s.find('\n')); }

// What the user reads of an error: a c10::Error carries the C++ backtrace of where it was raised,
// also inside another error's message that wraps its what(); it is cut off there.
std::string without_backtrace(const std::string& s) {
  const auto at = s.find("\nException raised from ");
  return at == std::string::npos ? s : s.substr(0, at);
}

}  // namespace

std::string version_string() { return std::string("keel ") + KEEL_VERSION + " (LibTorch " + TORCH_VERSION + ")"; }

namespace {

bool looks_like_option(const std::string& a) {
  return a.size() > 1 && a[0] == '-' && !std::isdigit(static_cast<unsigned char>(a[1])) && a[1] != '.';
}

// The first word after `train` that is neither an option nor the one value of the option
// before it: "--train.lr=0.5 0.7", "--run.name=my experiment", a trailing word. CLI11 would
// append such words to the previous option's values (and the last one would win).
std::optional<std::string> stray_train_argument(int argc, char** argv) {
  int k = 1;
  while (k < argc && std::string(argv[k]) != "train") ++k;
  for (++k; k < argc; ++k) {
    const std::string a = argv[k];
    if (a == "--") return std::nullopt;
    if (!looks_like_option(a)) return a;
    const bool no_value = a == "--print-config" || a == "--help" || a == "-h";
    if (a.find('=') == std::string::npos && !no_value && k + 1 < argc && !looks_like_option(argv[k + 1])) ++k;
  }
  return std::nullopt;
}

}  // namespace

namespace {

// One option per config key, generated from the schema. Values are kept as text and applied
// after the file, in schema order, so the command line wins.
void add_config_options(CLI::App& train, std::map<std::string, std::vector<std::string>>& given) {
  const Config defaults;
  for (const auto& f : config_schema()) {
    auto* opt = train.add_option("--" + f.dotted(), given[f.dotted()], f.doc);
    opt->group("[" + f.section + "]");
    opt->type_name(std::string(field_type_name(f.type)) == "list of strings" ? "TEXT (repeatable)"
                                                                             : field_type_name(f.type));
    opt->default_str(to_toml_literal(f.get(defaults)));
    if (f.type == FieldType::Bool || f.type == FieldType::String || f.type == FieldType::StringList) {
      // `--data.drop_last` alone means true; `--compile.cache_dir=` sets "" (CLI11 sees no value).
      opt->expected(0, 1);
    } else {
      opt->expected(1);
    }
    opt->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
    if (!f.choices.empty()) {
      std::string c;
      for (const auto& x : f.choices) c += (c.empty() ? "" : "|") + x;
      opt->type_name(c);
    }
  }
}

// Runs `body`: exit 0; 2 for the user's input (said on stderr); 1 otherwise.
int exit_code_of(const std::function<void()>& body) {
  try {
    body();
    return 0;
  } catch (const InputError& e) {
    std::cerr << "keel: error: " << without_backtrace(e.what()) << "\n";
    return kExitInput;
  } catch (const std::exception& e) {
    std::cerr << "keel: error: " << without_backtrace(e.what()) << "\n";
    return kExitFailure;
  }
}

// Prints the files `write` made, one a line: exit 0; 2 for the user's input; 1 otherwise.
int print_files(const std::function<std::vector<std::string>()>& write) {
  return exit_code_of([&] {
    for (const auto& f : write()) std::cout << f << "\n";
  });
}

struct ExportArgs {
  std::string step, out, max_shard_size = "5GB", dtype = "float32";
  bool hf = false;
};

// What the subcommands' options parse into (CLI11 writes into these while it parses).
struct CliArgs {
  std::string plot_dir, plot_out;
  std::string inspect_dir;
  bool inspect_json = false;
  std::string doctor_dir;
  bool doctor_json = false;
  ExportArgs export_args;
  std::string config_path, compile_config_path;  // train's and compile's --config
  bool print_config = false;                     // train's --print-config
  bool print_schedule = false;                   // train's --print-schedule
  // The config keys given to train and to compile, as text (add_config_options).
  std::map<std::string, std::vector<std::string>> given, given_compile;
};

int print_config_reference(const CLI::App&, CliArgs&) {
  std::cout << config_reference_markdown();
  return 0;
}

int print_summary_reference(const CLI::App&, CliArgs&) {
  std::cout << Summary::reference_markdown();
  return 0;
}

void add_plot_options(CLI::App* cmd, CliArgs& a) {
  cmd->add_option("run_dir", a.plot_dir, "a run directory (run.dir)")->required();
  cmd->add_option("--out", a.plot_out, "where to write the PNGs (default RUN_DIR/plots)");
}

int run_plot(const CLI::App&, CliArgs& a) {
  return print_files([&] { return plot_run(a.plot_dir, a.plot_out); });
}

void add_inspect_options(CLI::App* cmd, CliArgs& a) {
  cmd->add_option("dir", a.inspect_dir, "checkpoint.dir, or one step_<N> directory")->required();
  cmd->add_flag("--json", a.inspect_json, "print the report as JSON");
}

void add_export_options(CLI::App* cmd, CliArgs& args) {
  ExportArgs& a = args.export_args;
  cmd->add_flag("--hf", a.hf, "write config.json and safetensors under transformers' names, for from_pretrained");
  cmd->add_option("step", a.step, "a checkpoint step directory (checkpoint.dir/step_<N>)")->required();
  cmd->add_option("out", a.out, "the directory to write (new, or empty)")->required();
  cmd->add_option("--max-shard-size", a.max_shard_size,
                  "largest safetensors file, as transformers' max_shard_size (\"5GB\", \"500MB\", \"64KiB\"; whole "
                  "tensors); a larger model is sharded with an index")
      ->capture_default_str();
  cmd->add_option("--dtype", a.dtype,
                  "the floating-point tensors' dtype in the files (and config.json's with --hf): float32 (as "
                  "trained), bfloat16 or float16, rounded to nearest")
      ->capture_default_str();
}

int run_export(const CLI::App&, CliArgs& args) {
  const ExportArgs& a = args.export_args;
  return print_files([&] {
    return export_model(a.step, a.out, parse_shard_size(a.max_shard_size), a.hf, parse_export_dtype(a.dtype));
  });
}

// Exit 0: every committed step verifies; 1: some step is corrupt or uncommitted; 2: no
// checkpoint there.
int run_inspect(const CLI::App&, CliArgs& a) {
  try {
    const nlohmann::json r = checkpoint::inspect(a.inspect_dir);
    std::cout << (a.inspect_json ? r.dump(2) + "\n" : checkpoint::format_inspect(r));
    for (const auto& s : r["steps"])
      if (!s["verified"].get<bool>()) return kExitFailure;
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "keel: error: " << without_backtrace(e.what()) << "\n";
    return kExitInput;
  }
}

void add_doctor_options(CLI::App* cmd, CliArgs& a) {
  cmd->add_option("run_dir", a.doctor_dir,
                  "a run directory (run.dir), or a folder of flight records copied from several hosts")
      ->required();
  cmd->add_flag("--json", a.doctor_json, "print the diagnosis as JSON");
}

// Exit 0 with the diagnosis; 2 when there is no flight record to read.
int run_doctor(const CLI::App&, CliArgs& a) {
  return exit_code_of([&] {
    const doctor::Report r = doctor::diagnose_dir(a.doctor_dir);
    std::cout << (a.doctor_json ? r.json.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) + "\n" : r.text);
  });
}

int run_train(const Config& cfg) {
  try {
    dist::World world = dist::detect_world(dist::current_env());
    Trainer trainer(cfg, world);
    const Summary summary = trainer.run();
    return summary.stop_signal ? 128 + *summary.stop_signal : 0;
  } catch (const Stopped& e) {  // before training: nothing to save
    logging::warn("{}", e.what());
    std::cerr << "keel: " << without_backtrace(e.what()) << "\n";
    return 128 + e.signo;
  } catch (const InputError& e) {
    logging::error("{}", without_backtrace(e.what()));
    std::cerr << "keel: error: " << without_backtrace(e.what()) << "\n";
    return kExitInput;
  } catch (const c10::Error& e) {
    std::cerr << "keel: error: " << first_line(e.what_without_backtrace()) << "\n";
    return kExitFailure;
  } catch (const std::exception& e) {
    std::cerr << "keel: error: " << without_backtrace(e.what()) << "\n";
    return kExitFailure;
  }
}

// `keel compile`: 0 with the package's path; 2 for the user's input (a step that cannot be
// captured, a model keel cannot package); 1 when the packaging step fails.
int run_compile(Config cfg) {
  try {
    cfg.compile.mode = CompileMode::Inductor;
    const CompileReport r = package_training_step(cfg);
    std::cout << r.package << "\n";
    std::cerr << "keel: "
              << (r.cache == "hit"          ? "already in the compile cache"
                  : r.cache == "waited"     ? "made by another process meanwhile"
                  : r.cache == "checkpoint" ? "taken from the checkpoint"
                                            : "compiled")
              << " in " << static_cast<int64_t>(r.compile_ms) << " ms (sha256 " << r.package_sha256 << ")\n";
    return 0;
  } catch (const InputError& e) {
    std::cerr << "keel: error: " << without_backtrace(e.what()) << "\n";
    return kExitInput;
  } catch (const CompileError& e) {
    std::cerr << "keel: error: " << without_backtrace(e.what()) << "\n";
    return kExitInput;
  } catch (const std::exception& e) {
    std::cerr << "keel: error: " << without_backtrace(e.what()) << "\n";
    return kExitFailure;
  }
}

// `keel tokenize ARGS`: trainer/data/tokenize.py run by keel's venv Python (as the packaging step
// finds it: $KEEL_PYTHON, the build's venv, ~/.cache/keel/venv), ARGS passed as they are; the
// script's exit status is keel's.
int run_tokenize(int argc, char** argv) {
  std::string py, script;
  try {
    py = aot::python_for(CompileConfig{});
    script = aot::keel_script("trainer/data/tokenize.py", "KEEL_TOKENIZE_SCRIPT");
  } catch (const std::runtime_error& e) {
    std::cerr << "keel: error: " << without_backtrace(e.what()) << "\n";
    return kExitFailure;
  }
  if (!aot::is_file(py)) {
    std::cerr << "keel: error: keel tokenize runs keel's venv Python, and " << py
              << " is not there: run scripts/setup.sh, or set KEEL_PYTHON\n";
    return kExitFailure;
  }
  std::vector<char*> args = {py.data(), script.data()};
  for (int i = 2; i < argc; ++i) args.push_back(argv[i]);
  args.push_back(nullptr);
  std::cout.flush();
  ::execv(py.c_str(), args.data());
  std::cerr << "keel: error: cannot run " << py << ": " << std::strerror(errno) << "\n";
  return kExitFailure;
}

// The config of `keel train` / `keel compile`: the TOML file, then the keys the command line
// gives (`options`, as `sub` parsed them), validated. Throws InputError.
Config resolve_config(const std::string& config_path, const CLI::App& sub,
                      std::map<std::string, std::vector<std::string>>& options) {
  Config cfg;
  if (!config_path.empty()) load_toml_file(config_path, cfg);
  std::set<std::string> cli_keys;
  for (const auto& f : config_schema()) {
    const auto& values = options[f.dotted()];
    if (sub.count("--" + f.dotted()) == 0) continue;
    cli_keys.insert(f.dotted());
    if (values.empty()) {  // a bare flag: true for a bool, "" (or an empty list) otherwise
      apply_override(cfg, f.dotted(), f.type == FieldType::Bool ? "true" : "");
      continue;
    }
    if (f.type == FieldType::StringList) {
      for (const auto& v : values) apply_override(cfg, f.dotted(), v);
    } else {
      apply_override(cfg, f.dotted(), values.back());
    }
  }
  command_line_wins(cfg, cli_keys);
  validate(cfg);
  return cfg;
}

// resolve_config, or nothing once an InputError is printed (the command then exits kExitInput).
std::optional<Config> resolved_config(const std::string& config_path, const CLI::App& sub,
                                      std::map<std::string, std::vector<std::string>>& options) {
  try {
    return resolve_config(config_path, sub, options);
  } catch (const InputError& e) {
    std::cerr << "keel: error: " << without_backtrace(e.what()) << "\n";
    return std::nullopt;
  }
}

void add_train_options(CLI::App* cmd, CliArgs& a) {
  cmd->add_option("--config,-c", a.config_path, "TOML experiment file (configs/*.toml); keys below override it");
  cmd->add_flag("--print-config", a.print_config, "print the resolved config as TOML and exit");
  cmd->add_flag("--print-schedule", a.print_schedule,
                "print the pipeline schedule (parallel.pp, parallel.pp_schedule, train.grad_accum micro-batches): "
                "which rank runs which forward, backward and send when, and what its simulation found; then exit");
  add_config_options(*cmd, a.given);
}

int train_command(const CLI::App& cmd, CliArgs& a) {
  const std::optional<Config> cfg = resolved_config(a.config_path, cmd, a.given);
  if (!cfg) return kExitInput;
  if (a.print_config) {
    std::cout << dump_toml(*cfg);
    return 0;
  }
  if (a.print_schedule) {
    try {
      std::cout << describe_schedule(*cfg);
    } catch (const InputError& e) {  // parallel.pp = 1 is not checked by validate(): no schedule runs
      std::cerr << "keel: error: " << without_backtrace(e.what()) << "\n";
      return kExitInput;
    }
    return 0;
  }
  return run_train(*cfg);
}

// `keel compile`: the packaging step of compile.mode = "inductor" by hand, for the run the
// same options describe (the package lands in the compile cache, where `keel train` finds it).
void add_compile_options(CLI::App* cmd, CliArgs& a) {
  cmd->add_option("--config,-c", a.compile_config_path, "TOML experiment file; keys below override it");
  add_config_options(*cmd, a.given_compile);
}

int compile_command(const CLI::App& cmd, CliArgs& a) {
  const std::optional<Config> cfg = resolved_config(a.compile_config_path, cmd, a.given_compile);
  if (!cfg) return kExitInput;
  return run_compile(*cfg);
}

// A subcommand of `keel`: its name and description (`keel --help`), the function that adds its
// options bound to CliArgs (nullptr: none), and its entry, run once CLI11 has parsed the command
// line. A command that parses its own arguments has `raw` instead: run_cli calls it with the
// whole command line, before CLI11, when the command is the first argument.
struct Command {
  const char* name;
  const char* description;
  void (*add_options)(CLI::App* cmd, CliArgs& args);
  int (*run)(const CLI::App& cmd, CliArgs& args);
  int (*raw)(int argc, char** argv);
};

// keel's subcommands, in `keel --help`'s order: a new command is one row here.
constexpr Command kCommands[] = {
    {"config-reference", "print every config key as Markdown (docs/config.md)", nullptr, print_config_reference,
     nullptr},
    {"summary-reference", "print every key of summary.json as Markdown (docs/summary.md)", nullptr,
     print_summary_reference, nullptr},
    {"train", "train a model described by a TOML config", add_train_options, train_command, nullptr},
    {"tokenize", "text files -> a token file for data.name = \"tokens\" (keel's venv Python; keel tokenize --help)",
     nullptr, nullptr, run_tokenize},
    {"plot", "PNG curves of a run (loss, throughput, loss scale) from its metrics.jsonl", add_plot_options, run_plot,
     nullptr},
    {"inspect", "list checkpoint steps: committed, checksums verified, tensors", add_inspect_options, run_inspect,
     nullptr},
    {"doctor",
     "which rank hung, where and why: reads every rank's flight record (RUN_DIR/flight, dist.flight_recorder)",
     add_doctor_options, run_doctor, nullptr},
    {"export",
     "a checkpoint step's model as one safetensors file (or shards and an index), or with --hf a Hugging Face "
     "model directory (model.name = gpt2 | llama)",
     add_export_options, run_export, nullptr},
    {"compile",
     "package the training step with AOTInductor (compile.mode = \"inductor\") "
     "into the compile cache, without training",
     add_compile_options, compile_command, nullptr},
};

}  // namespace

int run_cli(int argc, char** argv) {
  // As every PyTorch process (Python ignores SIGPIPE at start): a write to a socket whose peer
  // is gone (Gloo's TCP pairs write without MSG_NOSIGNAL) must fail with EPIPE and reach keel's
  // error handling, not kill the rank silently. Set here, in the binary's entry: a library
  // user's own process keeps its own disposition (docs/getting-started.md).
  std::signal(SIGPIPE, SIG_IGN);
  for (const Command& c : kCommands)
    if (c.raw && argc >= 2 && std::string(argv[1]) == c.name) return c.raw(argc, argv);
  CLI::App app{"keel: data- and tensor-parallel training (DDP, ZeRO 1-3, tp/sp) on LibTorch, from C++", "keel"};
  app.set_version_flag("--version", version_string());
  app.require_subcommand(1);
  CliArgs args;
  std::vector<CLI::App*> subs;
  for (const Command& c : kCommands) {
    subs.push_back(app.add_subcommand(c.name, c.description));
    if (c.add_options) c.add_options(subs.back(), args);
  }

  if (const auto stray = stray_train_argument(argc, argv)) {
    std::cerr << "keel: error: unexpected argument '" << *stray
              << "': every value belongs to an option, one value each (--section.key=value; quote a value "
                 "that holds spaces)\n";
    return kExitInput;
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    app.exit(e);  // prints the message and a hint
    return kExitInput;
  }
  // Exactly one subcommand is parsed (require_subcommand(1)). CLI11 parses `tokenize` only when
  // it is not the first argument: it has no entry there, and that exits kExitInput.
  for (size_t i = 0; i < subs.size(); ++i)
    if (kCommands[i].run && subs[i]->parsed()) return kCommands[i].run(*subs[i], args);
  return kExitInput;
}

}  // namespace keel
