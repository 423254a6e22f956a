// Config parsing and validation. toml++ is the strict parser (it reports line and column);
// everything else (unknown keys, types, ranges, cross-field rules) is checked here against the
// schema in config_schema.cpp, so there is one place that decides what a valid config is.
#include "keel/trainer/config/config.h"

#include "common/file.h"

#include <toml++/toml.h>

#include "dist/network.h"
#include "dist/placement.h"
#include "models/hf.h"
#include "trainer/config/pipeline.h"
#include "trainer/fault/fault.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>
#include <sstream>

namespace keel {
namespace {

std::string join(const std::vector<std::string>& v, const char* sep) {
  std::string out;
  for (size_t i = 0; i < v.size(); ++i) out += (i ? sep : "") + v[i];
  return out;
}

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (size_t j = 1; j <= b.size(); ++j)
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (a[i - 1] != b[j - 1])});
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

// " (did you mean 'train.lr'?)" for a near miss, else "".
std::string suggestion(const std::string& dotted) {
  const FieldInfo* best = nullptr;
  size_t best_d = 4;
  for (const auto& f : config_schema()) {
    size_t d = edit_distance(dotted, f.dotted());
    if (d < best_d) best_d = d, best = &f;
  }
  return best ? " (did you mean '" + best->dotted() + "'?)" : "";
}

std::string where(const std::string& origin, const toml::source_region& r) {
  std::ostringstream os;
  os << origin << ":" << r.begin.line << ":" << r.begin.column;
  return os.str();
}

bool is_known_section(const std::string& s) {
  for (const auto& k : config_sections())
    if (k == s) return true;
  return false;
}

std::string describe_node_type(const toml::node& n) {
  switch (n.type()) {
    case toml::node_type::string:
      return "string";
    case toml::node_type::integer:
      return "integer";
    case toml::node_type::floating_point:
      return "float";
    case toml::node_type::boolean:
      return "bool";
    case toml::node_type::array:
      return "array";
    case toml::node_type::table:
      return "table";
    case toml::node_type::date:
      return "date";
    case toml::node_type::time:
      return "time";
    case toml::node_type::date_time:
      return "date-time";
    default:
      return "value";
  }
}

// Converts a TOML node to the field's type, refusing anything else.
Value from_node(const FieldInfo& f, const toml::node& n, const std::string& at) {
  auto wrong = [&]() {
    return InputError(at + ": key '" + f.dotted() + "' expects " + field_type_name(f.type) + ", got " +
                      describe_node_type(n));
  };
  switch (f.type) {
    case FieldType::Bool:
      if (auto b = n.as_boolean()) return b->get();
      throw wrong();
    case FieldType::Int:
      if (auto i = n.as_integer()) return static_cast<int64_t>(i->get());
      throw wrong();
    case FieldType::Float:
      if (auto d = n.as_floating_point()) return d->get();
      if (auto i = n.as_integer()) return static_cast<double>(i->get());
      throw wrong();
    case FieldType::String:
      if (auto s = n.as_string()) return s->get();
      throw wrong();
    case FieldType::StringList: {
      auto arr = n.as_array();
      if (!arr) {
        if (auto s = n.as_string()) return std::vector<std::string>{s->get()};
        throw wrong();
      }
      std::vector<std::string> out;
      for (const auto& e : *arr) {
        auto s = e.as_string();
        if (!s) throw wrong();
        out.push_back(s->get());
      }
      return out;
    }
  }
  throw wrong();
}

std::string format_number(double d) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.17g", d);
  // Prefer the shortest form that reads back identically.
  for (int prec = 1; prec <= 17; ++prec) {
    char b2[64];
    std::snprintf(b2, sizeof b2, "%.*g", prec, d);
    if (std::strtod(b2, nullptr) == d) {
      std::snprintf(buf, sizeof buf, "%s", b2);
      break;
    }
  }
  return buf;
}

// The offset of the first byte that does not belong to a well-formed UTF-8 sequence (overlong
// forms, surrogates and code points above U+10FFFF included), or nullopt.
std::optional<size_t> invalid_utf8_offset(const std::string& s) {
  const auto* b = reinterpret_cast<const unsigned char*>(s.data());
  const size_t n = s.size();
  for (size_t i = 0; i < n;) {
    const unsigned c = b[i];
    size_t len = 0;
    uint32_t cp = 0, min = 0;
    if (c < 0x80)
      len = 1, cp = c;
    else if ((c & 0xE0) == 0xC0)
      len = 2, cp = c & 0x1F, min = 0x80;
    else if ((c & 0xF0) == 0xE0)
      len = 3, cp = c & 0x0F, min = 0x800;
    else if ((c & 0xF8) == 0xF0)
      len = 4, cp = c & 0x07, min = 0x10000;
    else
      return i;
    if (i + len > n) return i;
    for (size_t k = 1; k < len; ++k) {
      if ((b[i + k] & 0xC0) != 0x80) return i;
      cp = (cp << 6) | (b[i + k] & 0x3F);
    }
    if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return i;
    i += len;
  }
  return std::nullopt;
}

// Range and choice checks shared by the file and command-line paths.
void check_value(const FieldInfo& f, const Value& v, const std::string& at) {
  auto num = [&]() -> std::optional<double> {
    if (auto i = std::get_if<int64_t>(&v)) return static_cast<double>(*i);
    if (auto d = std::get_if<double>(&v)) return *d;
    return std::nullopt;
  }();
  if (num) {
    if (!std::isfinite(*num))
      throw InputError(at + ": key '" + f.dotted() + "' must be a finite number, got " + to_toml_literal(v));
    if ((f.has_min && *num < f.min) || (f.has_max && (f.max_exclusive ? *num >= f.max : *num > f.max))) {
      std::string range = f.has_max
                              ? "[" + format_number(f.min) + ", " + format_number(f.max) + (f.max_exclusive ? ")" : "]")
                              : ">= " + format_number(f.min);
      throw InputError(at + ": key '" + f.dotted() + "' = " + to_toml_literal(v) + " is out of range: must be " +
                       range + " (" + f.doc + ")");
    }
  }
  // TOML holds UTF-8 text: a value that is not (a byte string from the command line) could be
  // used but never written into the run's config.toml and read back.
  auto check_utf8 = [&](const std::string& s) {
    if (const auto bad = invalid_utf8_offset(s))
      throw InputError(at + ": key '" + f.dotted() + "' is not valid UTF-8 (byte " + std::to_string(*bad) +
                       "); a config is TOML, which holds UTF-8 text only");
  };
  if (auto s = std::get_if<std::string>(&v)) check_utf8(*s);
  if (auto l = std::get_if<std::vector<std::string>>(&v))
    for (const auto& s : *l) check_utf8(s);
  if (auto s = std::get_if<std::string>(&v); s && !f.choices.empty()) {
    bool ok = false;
    for (const auto& c : f.choices) ok |= (c == *s);
    if (!ok)
      throw InputError(at + ": key '" + f.dotted() + "' = \"" + *s + "\" is not one of: " + join(f.choices, ", "));
  }
}

void load_table(const toml::table& tbl, const std::string& origin, Config& cfg) {
  for (auto&& [sec_key, sec_node] : tbl) {
    std::string sec(sec_key.str());
    std::string at = where(origin, sec_node.source());
    if (!sec_node.is_table()) {
      throw InputError(at + ": key '" + sec + "' is outside any section; keys belong to one of [" +
                       join(config_sections(), "], [") + "]");
    }
    if (!is_known_section(sec))
      throw InputError(at + ": unknown section [" + sec + "]; known sections: " + join(config_sections(), ", "));
    for (auto&& [key, node] : *sec_node.as_table()) {
      std::string dotted = sec + "." + std::string(key.str());
      std::string kat = where(origin, node.source());
      const FieldInfo* f = find_field(dotted);
      if (!f) throw InputError(kat + ": unknown key '" + dotted + "'" + suggestion(dotted));
      Value v = from_node(*f, node, kat);
      check_value(*f, v, kat);
      f->set(cfg, v);
      cfg.explicit_keys.insert(f->dotted());
    }
  }
}

bool parse_bool(const std::string& s, bool& out) {
  if (s == "true" || s == "1") return out = true, true;
  if (s == "false" || s == "0") return out = false, true;
  return false;
}

}  // namespace

std::string to_toml_literal(const Value& v) {
  struct Visitor {
    std::string operator()(bool b) const { return b ? "true" : "false"; }
    std::string operator()(int64_t i) const { return std::to_string(i); }
    std::string operator()(double d) const {
      if (std::isnan(d)) return "nan";
      if (std::isinf(d)) return d > 0 ? "inf" : "-inf";
      std::string s = format_number(d);
      if (s.find_first_of(".en") == std::string::npos) s += ".0";
      return s;
    }
    std::string operator()(const std::string& s) const {
      std::string out = "\"";
      for (unsigned char c : s) {
        if (c == '"')
          out += "\\\"";
        else if (c == '\\')
          out += "\\\\";
        else if (c < 0x20 || c == 0x7f) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", c);
          out += buf;
        } else
          out += static_cast<char>(c);
      }
      return out + "\"";
    }
    std::string operator()(const std::vector<std::string>& l) const {
      std::string out = "[";
      for (size_t i = 0; i < l.size(); ++i) out += (i ? ", " : "") + (*this)(l[i]);
      return out + "]";
    }
  };
  return std::visit(Visitor{}, v);
}

std::string read_file(const std::string& path, uint64_t max_bytes) {
  try {
    return read_regular_file(path, max_bytes);  // kind first, then a bounded read
  } catch (const std::runtime_error& e) {
    throw InputError(e.what());
  }
}

void load_toml_string(const std::string& text, const std::string& origin, Config& cfg) {
  // A config is small text; refuse binary files before the parser sees them.
  if (text.size() > kMaxConfigBytes)
    throw InputError(origin + ": " + std::to_string(text.size()) + " bytes is too large for a config file");
  if (auto nul = text.find('\0'); nul != std::string::npos)
    throw InputError(origin + ": not a TOML file (binary data: NUL byte at offset " + std::to_string(nul) + ")");
  toml::table tbl;
  try {
    tbl = toml::parse(std::string_view(text), origin);
  } catch (const toml::parse_error& e) {
    throw InputError(where(origin, e.source()) + ": TOML syntax error: " + std::string(e.description()));
  }
  load_table(tbl, origin, cfg);
}

void load_toml_file(const std::string& path, Config& cfg) {
  load_toml_string(read_file(path, kMaxConfigBytes), path, cfg);
}

void apply_override(Config& cfg, const std::string& dotted, const std::string& text) {
  const FieldInfo* f = find_field(dotted);
  const std::string at = "command line";
  if (!f) throw InputError(at + ": unknown option --" + dotted + suggestion(dotted));
  auto bad = [&](const char* what) { return InputError(at + ": --" + f->dotted() + "=" + text + ": expects " + what); };
  Value v;
  switch (f->type) {
    case FieldType::Bool: {
      bool b;
      if (!parse_bool(text, b)) throw bad("true or false");
      v = b;
      break;
    }
    case FieldType::Int: {
      errno = 0;
      char* end = nullptr;
      long long i = std::strtoll(text.c_str(), &end, 10);
      if (text.empty() || *end != '\0' || errno == ERANGE) throw bad("an integer");
      v = static_cast<int64_t>(i);
      break;
    }
    case FieldType::Float: {
      errno = 0;
      char* end = nullptr;
      double d = std::strtod(text.c_str(), &end);
      if (text.empty() || *end != '\0' || errno == ERANGE) throw bad("a number");
      v = d;
      break;
    }
    case FieldType::String: {
      std::string s = text;
      if (s.size() >= 2 && ((s.front() == '"' && s.back() == '"') || (s.front() == '\'' && s.back() == '\'')))
        s = s.substr(1, s.size() - 2);
      v = s;
      break;
    }
    case FieldType::StringList: {
      // The first command-line entry replaces the file's list; later ones append.
      std::vector<std::string> list;
      const std::string marker = "cli:" + f->dotted();
      if (cfg.explicit_keys.count(marker)) list = std::get<std::vector<std::string>>(f->get(cfg));
      if (!text.empty()) list.push_back(text);
      cfg.explicit_keys.insert(marker);
      v = list;
      break;
    }
  }
  check_value(*f, v, at + ": --" + f->dotted());
  f->set(cfg, v);
  cfg.explicit_keys.insert(f->dotted());
}

void command_line_wins(Config& cfg, const std::set<std::string>& cli_keys) {
  const bool steps = cli_keys.count("train.steps") > 0, epochs = cli_keys.count("train.epochs") > 0;
  if (steps && !epochs && cfg.is_explicit("train.epochs")) {
    cfg.train.epochs = TrainConfig{}.epochs;  // 0: train.steps counts
    cfg.explicit_keys.erase("train.epochs");
  }
  if (epochs && !steps && cfg.is_explicit("train.steps")) {
    cfg.train.steps = TrainConfig{}.steps;
    cfg.explicit_keys.erase("train.steps");
  }
}

std::optional<std::pair<int64_t, int64_t>> parse_profile_steps(const std::string& text) {
  if (text.empty()) return std::nullopt;
  auto bad = [&] {
    return InputError("config: run.profile_steps = \"" + text +
                      "\": want \"A-B\", the first and last optimizer step to record, 1 <= A <= B (e.g. \"10-12\"), "
                      "or \"\" for none");
  };
  const size_t dash = text.find('-');
  if (dash == std::string::npos || dash == 0 || dash + 1 == text.size()) throw bad();
  auto number = [&](const std::string& s) {
    if (s.size() > 15 || s.find_first_not_of("0123456789") != std::string::npos) throw bad();
    return static_cast<int64_t>(std::stoll(s));
  };
  const int64_t a = number(text.substr(0, dash)), b = number(text.substr(dash + 1));
  if (a < 1 || b < a) throw bad();
  return std::make_pair(a, b);
}

namespace {

// [data]: what the keys alone decide (the files are read when the dataset is built).
void validate_data(const DataConfig& data) {
  auto fail = [](const std::string& m) { throw InputError("config: " + m); };
  if (data.name.empty()) fail("data.name must not be empty");
  // The token-file keys, given to a built-in dataset that does not read them, would be ignored.
  if (data.name == "fashion_mnist" || data.name == "text" || data.name == "synthetic") {
    if (data.token_dtype != TokenDtype::Auto)
      fail("data.token_dtype is read only with data.name = \"tokens\" (data.name = \"" + data.name + "\")");
    if (!data.test_path.empty())
      fail("data.test_path is read only with data.name = \"tokens\" (data.name = \"" + data.name +
           "\"; text holds out data.test_fraction of its file)");
  }
}

// [model]: the Hugging Face families' keys, given to a built-in model that does not read them,
// would be ignored (a model a user registers gets the whole ModelConfig and may read any).
void validate_model(const ModelConfig& m) {
  const ModelConfig d;
  const bool hf = m.name == "gpt2" || m.name == "llama";
  const bool builtin =
      hf || m.name == "mlp" || m.name == "cnn" || m.name == "gpt" || m.name == "torchscript" || m.name == "python";
  if (m.dropout < 0 && m.dropout != -1.0)
    throw InputError("config: model.dropout = " + std::to_string(m.dropout) +
                     " is not a probability: give one in [0, 0.95], or -1 for init_from's config.json's (else 0)");
  if (builtin && !hf && m.name != "gpt" && m.dropout != d.dropout)
    throw InputError(
        "config: model.dropout is read only with model.name = \"gpt\", \"gpt2\" or \"llama\" "
        "(model.name = \"" +
        m.name + "\")");
  if (!builtin || m.name == "llama") return;
  struct Key {
    const char* name;
    bool set;
    bool llama_only;
  };
  for (const Key& k :
       {Key{"kv_heads", m.kv_heads != d.kv_heads, true}, Key{"rope_theta", m.rope_theta != d.rope_theta, true},
        Key{"ffn_width", m.ffn_width != d.ffn_width, false}, Key{"norm_eps", m.norm_eps != d.norm_eps, false},
        Key{"tie_embeddings", m.tie_embeddings != d.tie_embeddings, false}})
    if (k.set && (k.llama_only || !hf))
      throw InputError(std::string("config: model.") + k.name + " is read only with model.name = " +
                       (k.llama_only ? "\"llama\"" : "\"gpt2\" or \"llama\"") + " (model.name = \"" + m.name + "\")");
}

}  // namespace

// The placement of dist.zero (docs/zero.md): what it cannot be combined with is refused by name.
static void validate_placement(const Config& cfg) {
  const dist::Placement placement(cfg.dist.zero);
  if (placement.shards_gradients() && cfg.dist.comm_hook != CommHook::Allreduce)
    throw InputError("config: " + placement.key() +
                     " reduce-scatters gradients and cannot be combined with dist.comm_hook = \"" +
                     choice_name(kCommHooks, cfg.dist.comm_hook) +
                     "\" (compressed all-reduce); use dist.zero = 1 or comm_hook = \"allreduce\"");
  if (!placement.shards_parameters()) return;
  auto fail = [&](const std::string& m) { throw InputError("config: " + placement.key() + " " + m); };
  if (cfg.compile.mode == CompileMode::Trace)
    fail(
        "gathers each block's parameters around it, which compile.mode = \"trace\" does not let it do (the traced "
        "forward takes the whole model): set compile.mode = \"off\", or \"inductor\" for gpt, gpt2 and llama (their "
        "blocks compiled)");
  if (cfg.compile.mode == CompileMode::Inductor && cfg.compile.granularity == CompileGranularity::Step)
    fail(
        "gathers each block's parameters around it, which compile.granularity = \"step\" does not let it do (one "
        "package takes the whole model): set compile.granularity = \"blocks\" or \"auto\"");
  if (cfg.model.name == "torchscript")
    fail("shards a model's parameters behind its back, which a TorchScript module does not take: use dist.zero = 2");
}

// [parallel]: what tensor parallelism serves yet (issue 45) is gpt, gpt2 and llama, eager or with
// their blocks' regions compiled (inductor), over DDP or ZeRO 1-3; everything else with parallel.tp > 1 is refused by
// name. The product with the world size is checked when the mesh is built (the world is not known here).
static void validate_parallel(const Config& cfg) {
  const int64_t tp = cfg.parallel.tp;
  if (tp < 1 || cfg.parallel.dp < 0)  // (a Config built in code skips the parser's ranges)
    throw InputError("config: parallel.tp = " + std::to_string(tp) + " and parallel.dp = " +
                     std::to_string(cfg.parallel.dp) + ": tp must be at least 1 and dp at least 0 (0 = world / tp)");
  if (tp == 1) return;
  const std::string key = "parallel.tp = " + std::to_string(tp);
  auto fail = [&](const std::string& m) { throw InputError("config: " + key + " " + m); };
  const ModelConfig& m = cfg.model;
  struct Split {
    std::string what;  // the key that sets it
    int64_t n;
    std::string origin;  // where its value came from, when not that key: "n_head in DIR/config.json"
  };
  std::vector<Split> splits;  // what tp splits
  if (m.name == "gpt") {
    const int64_t width = m.width > 0 ? m.width : 256;
    splits = {{"model.heads", m.heads, ""},
              {"model.vocab", m.vocab, ""},
              {"the MLP's width (4 x model.width)", 4 * width, ""}};
  } else if (models::is_hf_family(m.name)) {
    // The values the model is built with, each named where it came from: the [model] key, or
    // init_from's config.json field (issue 64: a refusal named model.heads for the file's n_head).
    const models::HfShape s = models::hf_shape(m);
    auto origin = [&](const std::string& key) { return s.source.empty() ? std::string() : s.origin(key); };
    splits = {{"model.heads", s.heads, origin("model.heads")},
              {"model.kv_heads", s.kv_heads, origin("model.kv_heads")},
              {"model.vocab", s.vocab, origin("model.vocab")},
              {"the MLP's width (model.ffn_width)", s.ffn, origin("model.ffn_width")}};
  } else {
    fail("needs a model with a tensor-parallel plan: model.name = \"" + m.name +
         "\" has none (gpt, gpt2 and llama have one)");
  }
  for (const auto& [what, n, origin] : splits)
    if (n % tp != 0)
      fail("splits " + what + " = " + std::to_string(n) + (origin.empty() ? "" : " (" + origin + ")") +
           " over tp ranks: it does not divide by " + std::to_string(tp) +
           (what == "model.kv_heads" ? " (each tp rank holds whole key/value heads; fewer than tp are not replicated)"
                                     : ""));
  if (cfg.parallel.sequence_parallel && m.context % tp != 0)
    fail("with parallel.sequence_parallel = true splits model.context = " + std::to_string(m.context) +
         " positions over tp ranks: it does not divide by " + std::to_string(tp));
  auto not_yet = [&](bool set, const std::string& what) {
    if (set)
      fail("cannot be combined with " + what + " yet (tensor parallelism runs eager or compile.mode = \"inductor\")");
  };
  // compile.mode = "inductor" packages the block's regions between tp's collectives (blocks).
  not_yet(cfg.compile.mode != CompileMode::Off && cfg.compile.mode != CompileMode::Inductor,
          "compile.mode = \"" + std::string(choice_name(kCompileModes, cfg.compile.mode)) + "\"");
  if (cfg.compile.mode == CompileMode::Inductor && cfg.compile.granularity == CompileGranularity::Step)
    fail(
        "has collectives inside each block, which compile.granularity = \"step\" (one package for the whole step) "
        "cannot run between: set compile.granularity = \"blocks\" or \"auto\"");
  not_yet(cfg.train.loss != "cross_entropy",
          "train.loss = \"" + cfg.train.loss + "\" (the loss is computed over vocabulary shards)");
  not_yet(cfg.run.sync_debug != SyncDebug::Off, "run.sync_debug (each tp collective's validation reads the host)");
  for (const auto& entry : cfg.fault.inject)
    not_yet(entry.rfind("graph_break", 0) == 0, "fault.inject = \"" + entry + "\" (a wrapped model cannot be sharded)");
}

bool compiles_blocks(const Config& cfg) {
  return cfg.compile.mode == CompileMode::Inductor &&
         (cfg.compile.granularity == CompileGranularity::Blocks ||
          (cfg.compile.granularity == CompileGranularity::Auto &&
           (dist::Placement(cfg.dist.zero).shards_parameters() || cfg.parallel.tp > 1 || cfg.parallel.pp > 1)));
}

// compile.granularity = "blocks" (or "auto" resolving to it): what it serves so far.
static void validate_granularity(const Config& cfg) {
  if (!compiles_blocks(cfg)) return;
  const std::string key =
      cfg.compile.granularity == CompileGranularity::Blocks
          ? "compile.granularity = \"blocks\""
          : "compile.granularity = \"auto\" (blocks at dist.zero = 3, parallel.tp > 1 or parallel.pp > 1)";
  auto fail = [&](const std::string& m) { throw InputError("config: " + key + " " + m); };
  // The built-in models without blocks; a registered model declares its own (BlockStructure), and
  // compile_blocks says so when it has none.
  for (const char* none : {"mlp", "cnn", "torchscript", "python"})
    if (cfg.model.name == none)
      fail(
          "packages a model's blocks (gpt, gpt2, llama, or a registered model that declares them with "
          "BlockStructure); model.name = \"" +
          cfg.model.name +
          "\" has none (use dist.zero <= 2 with compile.granularity = \"step\", or compile.mode = \"off\")");
}

// [parallel]'s pipeline keys: the schedule must exist for parallel.pp, train.grad_accum and the
// virtual stages (its simulator proves it deadlock-free when the run starts: dist/pipeline), the
// split must parse, and the model must declare its blocks; the blocks themselves are counted when
// the model is built (dist/stages.h).
static void validate_pipeline(const Config& cfg) {
  const ParallelConfig& p = cfg.parallel;
  if (p.pp < 1 || p.pp_virtual_stages < 0)  // (a Config built in code skips the parser's ranges)
    throw InputError("config: parallel.pp = " + std::to_string(p.pp) + " and parallel.pp_virtual_stages = " +
                     std::to_string(p.pp_virtual_stages) + ": pp must be at least 1, the virtual stages at least 0");
  if (p.pp == 1) return;  // the other pipeline keys have no effect
  pipeline_schedule(cfg);
  pipeline_split_points(p);
  // A stage runs some of the blocks: each block compiled on its own (compile.granularity = "blocks").
  if (cfg.compile.mode == CompileMode::Inductor && cfg.compile.granularity == CompileGranularity::Step)
    throw InputError("config: parallel.pp = " + std::to_string(p.pp) +
                     " runs some of the model's blocks on each stage, which compile.granularity = \"step\" (one "
                     "package for the whole step) cannot split: set compile.granularity = \"blocks\" or \"auto\"");
  for (const char* none : {"mlp", "cnn", "torchscript", "python"})
    if (cfg.model.name == none)
      throw InputError("config: parallel.pp = " + std::to_string(p.pp) +
                       " splits a model's blocks into stages (gpt, gpt2, llama, or a registered model that declares "
                       "them with BlockStructure); model.name = \"" +
                       cfg.model.name + "\" has none");
}

// train.activation_checkpointing: what it does not serve is refused by name (the model's kind is
// checked when the blocks are wrapped: dist/recompute.h).
static void validate_recompute(const Config& cfg) {
  const ActivationCheckpointing ac = cfg.train.activation_checkpointing;
  if (ac == ActivationCheckpointing::None) return;
  const std::string key =
      std::string("config: train.activation_checkpointing = \"") + choice_name(kActivationCheckpointing, ac) + "\"";
  if (cfg.compile.mode != CompileMode::Off)
    throw InputError(key + " recomputes the eager blocks and cannot be combined with compile.mode = \"" +
                     choice_name(kCompileModes, cfg.compile.mode) + "\" yet: set compile.mode = \"off\"");
  // DDP's Reducer would look for the blocks' parameters in the forward's graph, where the
  // recomputing node hides them (they are reached in its own backward), mark them unused and
  // then see them ready a second time (PyTorch's reentrant checkpoint has the same limit).
  if (cfg.dist.find_unused_parameters && cfg.dist.zero <= 1)
    throw InputError(key + " cannot be combined with dist.find_unused_parameters = true at dist.zero = " +
                     std::to_string(cfg.dist.zero) +
                     " (DDP's Reducer would take the recomputed blocks' parameters for unused ones): set "
                     "find_unused_parameters = false, or dist.zero = 2 or 3");
}

// compile.cuda_graphs: a captured step replays the same kernels on the same memory, so what
// cannot be captured, or changes from step to step, is refused by its keys. The rehearsal
// (compile.cuda_graphs_rehearsal, on the CPU) takes the same refusals, except the device and
// the backend it runs on.
static void validate_cuda_graphs(const Config& cfg) {
  auto fail = [](const std::string& m) { throw InputError("config: " + m); };
  const CompileConfig& c = cfg.compile;
  if (c.cuda_graphs_rehearsal && !c.cuda_graphs)
    fail("compile.cuda_graphs_rehearsal = true rehearses compile.cuda_graphs, which is false: set both, or neither");
  if (!c.cuda_graphs) return;
  const std::string on = "compile.cuda_graphs = true";
  if (c.cuda_graphs_rehearsal) {
    if (cfg.run.device != DeviceChoice::Cpu)
      fail("compile.cuda_graphs_rehearsal = true runs on the CPU: set run.device = \"cpu\"");
  } else {
    if (cfg.run.device == DeviceChoice::Cpu)
      fail(on +
           " needs a GPU: run.device = \"cpu\" has no CUDA graphs (set run.device = \"cuda\" or \"auto\", or "
           "compile.cuda_graphs = false; compile.cuda_graphs_rehearsal = true runs its orchestration on the CPU)");
    if (cfg.dist.backend == Backend::Gloo)
      fail(on +
           " needs NCCL: a dist.backend = \"gloo\" collective runs on the host and cannot be captured in a CUDA "
           "graph (set dist.backend = \"nccl\" or \"auto\", or compile.cuda_graphs = false)");
  }
  if (cfg.dist.find_unused_parameters)
    fail(on +
         " cannot serve dist.find_unused_parameters = true: which gradients are reduced changes from step to step, "
         "and a graph replays one step (set one of them to false)");
  if (cfg.dist.consensus == Consensus::Step)
    fail(on +
         " needs the update decided on the device (the host reads nothing inside a captured step): "
         "dist.consensus = \"step\" reads the verdict before the update (set dist.consensus = \"late\" or \"auto\")");
  if (!cfg.train.fused_optimizer)
    fail(on +
         " captures the update as the fused optimizer's kernel, which reads the learning rate and the verdict from "
         "the device: set train.fused_optimizer = true");
  if (cfg.train.grads_to_none && cfg.is_explicit("train.grads_to_none"))
    fail(on +
         " replays a backward that accumulates into the gradients it was captured with: train.grads_to_none = true "
         "frees them every step (set it to false, or leave it unset: graphs zero them in place)");
  if (cfg.dist.zero >= 3)
    fail(on +
         " replays kernels on the memory they were captured with; dist.zero = 3 gathers and frees each block's "
         "parameters anew every step (use dist.zero 0-2, or compile.cuda_graphs = false)");
  // Both read and set the CUDA generator's state on the host inside the step, which a capture
  // cannot take (and a replay would not repeat).
  if (cfg.train.activation_checkpointing != ActivationCheckpointing::None)
    fail(on + " cannot capture train.activation_checkpointing = \"" +
         choice_name(kActivationCheckpointing, cfg.train.activation_checkpointing) +
         "\": its recomputation sets the generators' state on the host (set it to \"none\")");
  // The dropout the model is built with: model.dropout, or init_from's config.json's.
  if (cfg.parallel.tp > 1 && models::model_dropout(cfg.model) > 0)
    fail(on + " cannot capture parallel.tp > 1 with dropout " + to_toml_literal(models::model_dropout(cfg.model)) +
         " (" + models::dropout_origin(cfg.model) +
         "): each tp rank's own masks seed the generator from the host every step (set model.dropout = 0)");
}

// model.init_from's config.json decides a Hugging Face family's shape: a [model] key set on the
// command line or in the file to another value than config.json's is refused, naming both
// (docs/models.md), whatever the value (issue 64: a key set to keel's default, and rope_theta,
// norm_eps, tie_embeddings, were taken silently as the file's). model.dropout is the run's choice
// over the file's, and model.context the run's sequence length: neither is the file's.
static void validate_init_from_agrees(const Config& cfg) {
  const ModelConfig& m = cfg.model;
  if (!models::is_hf_family(m.name) || m.init_from.empty()) return;
  const models::HfShape s = models::hf_shape(m);
  if (s.source.empty()) return;
  const bool llama = s.family == "llama";
  auto text = [](double v) {
    std::ostringstream os;
    os << v;
    return os.str();
  };
  struct Key {
    const char* key;
    std::string set, file;  // as text (numbers of 6 digits; differ() compares them whole)
    const char* field;
    bool differ = false;
  };
  std::vector<Key> keys = {
      {"vocab", std::to_string(m.vocab), std::to_string(s.vocab), "vocab_size"},
      {"width", std::to_string(m.width), std::to_string(s.width), llama ? "hidden_size" : "n_embd"},
      {"depth", std::to_string(m.depth), std::to_string(s.layers), llama ? "num_hidden_layers" : "n_layer"},
      {"heads", std::to_string(m.heads), std::to_string(s.heads), llama ? "num_attention_heads" : "n_head"},
      {"ffn_width", std::to_string(m.ffn_width), std::to_string(s.ffn), llama ? "intermediate_size" : "n_inner"},
      {"norm_eps", text(m.norm_eps), text(s.eps), llama ? "rms_norm_eps" : "layer_norm_epsilon"},
      {"tie_embeddings", m.tie_embeddings ? "true" : "false", s.tied ? "true" : "false", "tie_word_embeddings"}};
  if (llama) {
    keys.push_back({"kv_heads", std::to_string(m.kv_heads), std::to_string(s.kv_heads), "num_key_value_heads"});
    keys.push_back({"rope_theta", text(m.rope_theta), text(s.rope_theta), "rope_theta"});
  }
  for (Key& k : keys)  // kv_heads and ffn_width = 0 say "the default": whatever the file has
    k.differ =
        k.set != k.file && !(k.set == "0" && (std::string(k.key) == "kv_heads" || std::string(k.key) == "ffn_width"));
  keys[5].differ = m.norm_eps != s.eps;  // the floating-point ones, compared as numbers
  if (llama) keys.back().differ = m.rope_theta != s.rope_theta;
  for (const Key& k : keys)
    if (cfg.is_explicit(std::string("model.") + k.key) && k.differ)
      throw InputError("config: model." + std::string(k.key) + " = " + k.set + ", but " + s.source + " has " + k.field +
                       " = " + k.file + " (model.init_from's config.json decides the shape): set model." + k.key +
                       " = " + k.file + ", or leave it out to take the file's");
}

// A directory a run writes must not lie inside checkpoint.dir: each step's commit renames a
// step directory into place and the rotation removes old ones whole, with whatever else is in them
// (issue 64: run.dir = <checkpoint.dir>/step_5 lost its metrics, exit 1). checkpoint.dir inside
// run.dir is fine (nothing of the run's is removed), and so are the two the same directory.
static void validate_directories(const Config& cfg) {
  if (cfg.checkpoint.dir.empty()) return;
  namespace fs = std::filesystem;
  auto resolved = [](const std::string& p) {
    std::error_code ec;
    fs::path abs = fs::absolute(p, ec);
    if (ec) return fs::path(p).lexically_normal();
    fs::path canon = fs::weakly_canonical(abs, ec);  // symbolic links followed where the path exists
    fs::path r = (ec ? abs : canon).lexically_normal();
    return !r.has_filename() && r != r.root_path() ? r.parent_path() : r;  // "ckpt/" is "ckpt"
  };
  const fs::path ckpt = resolved(cfg.checkpoint.dir);
  auto inside = [&](const fs::path& p) {
    const auto [c, q] = std::mismatch(ckpt.begin(), ckpt.end(), p.begin(), p.end());
    return c == ckpt.end() && q != p.end() && !q->empty();
  };
  for (const auto& [key, dir] :
       {std::pair<const char*, std::string>{"run.dir", cfg.run.dir}, {"compile.cache_dir", cfg.compile.cache_dir}})
    if (!dir.empty() && inside(resolved(dir)))
      throw InputError("config: " + std::string(key) + " = \"" + dir + "\" is inside checkpoint.dir = \"" +
                       cfg.checkpoint.dir + "\", whose commits and rotation replace and remove what is in it: give " +
                       key + " a directory outside checkpoint.dir (checkpoint.dir may be inside it, or the same)");
}

void validate(Config& cfg) {
  auto fail = [](const std::string& m) { throw InputError("config: " + m); };
  if (cfg.run.name.empty()) fail("run.name must not be empty");
  if (cfg.run.name.find('/') != std::string::npos || cfg.run.name == "." || cfg.run.name == "..")
    fail("run.name = \"" + cfg.run.name +
         "\" must be a plain name (no '/', not . or ..): it names runs/<run.name>; "
         "set run.dir to write elsewhere");
  if (cfg.run.dir.empty()) cfg.run.dir = "runs/" + cfg.run.name;
  if (cfg.is_explicit("train.steps") && cfg.is_explicit("train.epochs") && cfg.train.epochs > 0)
    fail("set train.steps or train.epochs, not both (train.steps = " + std::to_string(cfg.train.steps) +
         ", train.epochs = " + std::to_string(cfg.train.epochs) + ")");
  if (cfg.train.min_lr > cfg.train.lr)
    fail("train.min_lr = " + to_toml_literal(cfg.train.min_lr) +
         " is above train.lr = " + to_toml_literal(cfg.train.lr));
  if (cfg.model.name.empty()) fail("model.name must not be empty");
  if (cfg.model.name == "torchscript" && cfg.model.path.empty())
    fail("model.name = \"torchscript\" needs model.path (a TorchScript file)");
  if (cfg.model.name == "python") {
    const std::string& p = cfg.model.path;
    if (p.size() < 4 || p.compare(p.size() - 3, 3, ".py") != 0)
      fail("model.name = \"python\" needs model.path = a Python file (*.py) defining model.factory (got \"" + p +
           "\")");
    const std::string& f = cfg.model.factory;
    if (f.empty() || std::isdigit(static_cast<unsigned char>(f[0])) ||
        f.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_") != std::string::npos)
      fail("model.factory = \"" + f + "\" is not a Python function name");
    if (cfg.train.loss != "cross_entropy")
      fail("model.name = \"python\" compiles keel's cross-entropy into its package; train.loss = \"" + cfg.train.loss +
           "\" cannot be (use train.loss = \"cross_entropy\")");
    if (cfg.compile.mode != CompileMode::Inductor)
      fail(std::string("model.name = \"python\" runs the module as an AOTInductor package and needs "
                       "compile.mode = \"inductor\" (got \"") +
           choice_name(kCompileModes, cfg.compile.mode) + "\")");
  }
  validate_data(cfg.data);
  validate_model(cfg.model);
  validate_parallel(cfg);
  validate_pipeline(cfg);
  validate_recompute(cfg);
  if (cfg.checkpoint.async && cfg.checkpoint.keep < 2)
    fail("checkpoint.keep must be at least 2 with checkpoint.async = true (got " + std::to_string(cfg.checkpoint.keep) +
         ")");
#ifndef KEEL_WITH_CUDA
  if (cfg.dist.backend == Backend::Nccl)
    fail(
        "dist.backend = \"nccl\" needs a CUDA build of keel; this build is CPU-only "
        "(use \"gloo\" or \"auto\")");
  if (cfg.run.device == DeviceChoice::Cuda)
    fail("run.device = \"cuda\" needs a CUDA build of keel; this build is CPU-only");
  if (cfg.compile.cuda_graphs && !cfg.compile.cuda_graphs_rehearsal)
    fail(
        "compile.cuda_graphs = true needs a CUDA build of keel (CUDA graphs capture GPU work); this build is CPU-only "
        "(compile.cuda_graphs_rehearsal = true with run.device = \"cpu\" runs its orchestration here)");
  if (cfg.amp.dtype == AmpDtype::Fp16)
    fail("amp.dtype = \"fp16\" needs CUDA (fp16 autocast is CUDA-only); this build is CPU-only: use \"bf16\"");
#endif
  validate_cuda_graphs(cfg);
  if (cfg.dist.consensus == Consensus::Late && !cfg.train.fused_optimizer)
    fail(
        "dist.consensus = \"late\" needs train.fused_optimizer = true: the update is skipped on the device through "
        "the fused kernel's found_inf, which torch::optim's loop cannot take (set train.fused_optimizer = true, or "
        "dist.consensus = \"step\" or \"auto\")");
  // fault.inject syntax and types (the rank bound is checked when the world size is known).
  FaultPlan(cfg.fault.inject, std::numeric_limits<int64_t>::max());
  if (cfg.checkpoint.save_graph && cfg.compile.mode != CompileMode::Trace && cfg.compile.mode != CompileMode::Inductor)
    fail(std::string("checkpoint.save_graph = true stores the compiled graph and needs compile.mode = \"inductor\" "
                     "(the AOTInductor package) or \"trace\" (got \"") +
         choice_name(kCompileModes, cfg.compile.mode) + "\")");
  if (cfg.checkpoint.save_graph && cfg.checkpoint.dir.empty())
    fail("checkpoint.save_graph = true needs checkpoint.dir");
  parse_profile_steps(cfg.run.profile_steps);
  validate_placement(cfg);
  validate_granularity(cfg);
  validate_directories(cfg);
  validate_init_from_agrees(cfg);
  if (!cfg.checkpoint.resume_from.empty() && cfg.checkpoint.dir.empty())
    fail("checkpoint.resume_from = \"" + cfg.checkpoint.resume_from + "\" needs checkpoint.dir");
  try {  // the same verdict at every world size (the 2-rank path chooses an interface from it)
    dist::parse_interface_list(cfg.dist.interface, "dist.interface");
  } catch (const InputError& e) {
    fail(e.what());
  }
}

std::string config_reference_markdown() {
  std::ostringstream os;
  const Config defaults;
  os << "# Configuration reference\n\n"
     << "Generated by `keel config-reference` from the config schema (trainer/config/schema.cpp); "
     << "`keel train --help` lists the same keys. Every key `[section] key` is also the command-line "
     << "option `--section.key=value`, which overrides the file.\n";
  std::string section;
  for (const auto& f : config_schema()) {
    if (f.section != section) {
      section = f.section;
      os << "\n## [" << section << "]\n\n| key | type | default | meaning |\n| --- | --- | --- | --- |\n";
    }
    std::string type = field_type_name(f.type);
    if (!f.choices.empty()) {
      type.clear();
      for (const auto& c : f.choices) type += (type.empty() ? "" : " \\| ") + c;
    }
    if (f.has_min || f.has_max) {
      Value lo = f.type == FieldType::Int ? Value(static_cast<int64_t>(f.min)) : Value(f.min);
      type += ", >= " + to_toml_literal(lo);
      if (f.has_max) {
        Value hi = f.type == FieldType::Int ? Value(static_cast<int64_t>(f.max)) : Value(f.max);
        type += (f.max_exclusive ? ", < " : ", <= ") + to_toml_literal(hi);
      }
    }
    std::string doc = f.doc;
    for (size_t p = 0; (p = doc.find('|', p)) != std::string::npos; p += 2) doc.replace(p, 1, "\\|");
    os << "| `" << f.key << "` | " << type << " | `" << to_toml_literal(f.get(defaults)) << "` | " << doc << " |\n";
  }
  return os.str();
}

// The [model] keys init_from's config.json decides, set to the file's values: what the run
// trains, and what validate_init_from_agrees() accepts when the resolved config is replayed.
static Config with_init_from_shape(const Config& cfg) {
  Config c = cfg;
  ModelConfig& m = c.model;
  if (!models::is_hf_family(m.name) || m.init_from.empty()) return c;
  const models::HfShape s = models::hf_shape(m);
  if (s.source.empty()) return c;
  m.vocab = s.vocab;
  m.width = s.width;
  m.depth = s.layers;
  m.heads = s.heads;
  m.ffn_width = s.ffn;
  m.norm_eps = s.eps;
  m.tie_embeddings = s.tied;
  if (s.family == "llama") {
    m.kv_heads = s.kv_heads;
    m.rope_theta = s.rope_theta;
  }
  return c;
}

std::string dump_toml(const Config& config) {
  const Config cfg = with_init_from_shape(config);
  std::ostringstream os;
  os << "# keel resolved configuration: every key, defaults included.\n"
     << "# Replay this run with: keel train --config <this file>\n";
  std::string section;
  for (const auto& f : config_schema()) {
    if (f.section != section) {
      section = f.section;
      os << "\n[" << section << "]\n";
    }
    // train.steps and train.epochs exclude each other: the one that does not count is written
    // as a comment, so that this file is a valid input that replays the run.
    const bool unused = f.dotted() == "train.steps" && cfg.train.epochs > 0;
    os << (unused ? "# " : "") << f.key << " = " << to_toml_literal(f.get(cfg)) << "  # "
       << (unused ? "not used: train.epochs counts. " : "") << f.doc << "\n";
  }
  return os.str();
}

}  // namespace keel
