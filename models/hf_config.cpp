// The Hugging Face families' shapes (models/hf.h): config.json in, config.json out.
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <sstream>
#include <utility>
#include <vector>

#include "common/file.h"
#include "models/hf.h"

namespace keel::models {
namespace {

using nlohmann::json;

// A field of a config.json, with the file named in any error.
struct ConfigFile {
  const json& j;
  std::string path;

  [[noreturn]] void fail(const std::string& field, const std::string& what) const {
    throw InputError("model.init_from: " + path + ": \"" + field + "\" " + what);
  }
  bool has(const std::string& field) const { return j.contains(field) && !j[field].is_null(); }
  int64_t integer(const std::string& field, int64_t min) const {
    if (!has(field)) fail(field, "is missing");
    if (!j[field].is_number_integer() || j[field].get<int64_t>() < min)
      fail(field, "must be an integer >= " + std::to_string(min) + ", got " + j[field].dump());
    return j[field].get<int64_t>();
  }
  int64_t integer_or(const std::string& field, int64_t min, int64_t dflt) const {
    return has(field) ? integer(field, min) : dflt;
  }
  double number_or(const std::string& field, double dflt) const {
    if (!has(field)) return dflt;
    if (!j[field].is_number() || !(j[field].get<double>() > 0)) fail(field, "must be a positive number");
    return j[field].get<double>();
  }
  double probability_or(const std::string& field, double dflt) const {
    if (!has(field)) return dflt;
    if (!j[field].is_number() || !(j[field].get<double>() >= 0 && j[field].get<double>() < 1))
      fail(field, "must be a probability in [0, 1), got " + j[field].dump());
    return j[field].get<double>();
  }
  bool flag_or(const std::string& field, bool dflt) const {
    if (!has(field)) return dflt;
    if (!j[field].is_boolean()) fail(field, "must be true or false, got " + j[field].dump());
    return j[field].get<bool>();
  }
  std::string text_or(const std::string& field, const std::string& dflt) const {
    if (!has(field)) return dflt;
    if (!j[field].is_string()) fail(field, "must be a string, got " + j[field].dump());
    return j[field].get<std::string>();
  }
};

// A [model] key the user set (it differs from keel's default) must agree with the file.
void agree(const ModelConfig& cfg, const ModelConfig& dflt, const std::string& key, int64_t ModelConfig::*member,
           int64_t file_value, const std::string& field, const std::string& path) {
  const int64_t v = cfg.*member;
  if (v != dflt.*member && v != file_value)
    throw InputError("model." + key + " = " + std::to_string(v) + ", but " + path + " has " + field + " = " +
                     std::to_string(file_value) + ": set model." + key + " = " + std::to_string(file_value) +
                     ", or leave it out to take the file's");
}

void read_gpt2(const ConfigFile& f, HfShape& s) {
  s.vocab = f.integer("vocab_size", 2);
  s.positions = f.integer("n_positions", 1);
  s.width = f.integer("n_embd", 1);
  s.layers = f.integer("n_layer", 1);
  s.heads = f.integer("n_head", 1);
  s.ffn = f.integer_or("n_inner", 1, 4 * s.width);
  s.eps = f.number_or("layer_norm_epsilon", 1e-5);
  s.tied = f.flag_or("tie_word_embeddings", true);
  const std::string act = f.text_or("activation_function", "gelu_new");
  if (act == "gelu")
    s.tanh_gelu = false;
  else if (act != "gelu_new" && act != "gelu_pytorch_tanh")
    f.fail("activation_function", "is \"" + act + "\"; keel's gpt2 has gelu_new, gelu_pytorch_tanh and gelu");
  if (!f.flag_or("scale_attn_weights", true)) f.fail("scale_attn_weights", "false is not supported");
  // transformers' GPT2Config defaults: 0.1 each.
  s.embd_pdrop = f.probability_or("embd_pdrop", 0.1);
  s.attn_pdrop = f.probability_or("attn_pdrop", 0.1);
  s.resid_pdrop = f.probability_or("resid_pdrop", 0.1);
  for (const char* unsupported : {"scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn", "add_cross_attention"})
    if (f.flag_or(unsupported, false)) f.fail(unsupported, "true is not supported by keel's gpt2");
}

void read_llama(const ConfigFile& f, HfShape& s) {
  s.vocab = f.integer("vocab_size", 2);
  s.positions = f.integer_or("max_position_embeddings", 1, 2048);
  s.width = f.integer("hidden_size", 1);
  s.layers = f.integer("num_hidden_layers", 1);
  s.heads = f.integer("num_attention_heads", 1);
  s.kv_heads = f.integer_or("num_key_value_heads", 1, s.heads);
  s.head_dim = f.integer_or("head_dim", 2, s.width / s.heads);
  // Without head_dim the head width is hidden_size / num_attention_heads, which must be >= 2.
  if (s.head_dim < 2)
    f.fail("num_attention_heads", "is " + std::to_string(s.heads) + ", more than hidden_size = " +
                                      std::to_string(s.width) + " / 2 allows without a head_dim field");
  s.ffn = f.integer("intermediate_size", 1);
  s.eps = f.number_or("rms_norm_eps", 1e-6);
  s.tied = f.flag_or("tie_word_embeddings", false);
  s.attention_bias = f.flag_or("attention_bias", false);
  s.mlp_bias = f.flag_or("mlp_bias", false);
  s.attn_pdrop = f.probability_or("attention_dropout", 0.0);
  // transformers' Llama embeds with torch.nn.Embedding(padding_idx = pad_token_id): that row gets
  // no gradient. As there, a negative id counts from the end (-1: row vocab_size - 1), and one
  // outside [-vocab_size, vocab_size) is refused (transformers' embedding asserts it).
  if (f.has("pad_token_id") && f.j["pad_token_id"].is_number_integer()) {
    const int64_t pad = f.j["pad_token_id"].get<int64_t>();
    if (pad < -s.vocab || pad >= s.vocab)
      f.fail("pad_token_id", "is " + std::to_string(pad) + ", outside [-vocab_size, vocab_size) = [" +
                                 std::to_string(-s.vocab) + ", " + std::to_string(s.vocab) +
                                 "): the embedding has no such row (transformers refuses it too)");
    s.padding_idx = pad < 0 ? pad + s.vocab : pad;
  }
  const std::string act = f.text_or("hidden_act", "silu");
  if (act != "silu") f.fail("hidden_act", "is \"" + act + "\"; keel's llama has silu (SwiGLU)");
  // transformers 5 writes rope_parameters {rope_type, rope_theta}; 4.x rope_theta and rope_scaling.
  s.rope_theta = f.number_or("rope_theta", 10000.0);
  for (const char* field : {"rope_parameters", "rope_scaling"}) {
    if (!f.has(field)) continue;
    const json& r = f.j[field];
    if (!r.is_object()) f.fail(field, "must be an object");
    const ConfigFile sub{r, f.path};
    const std::string type = sub.text_or("rope_type", sub.text_or("type", "default"));
    if (type != "default")
      f.fail(field, "has rope_type \"" + type + "\"; keel's llama has the default rotary embedding only");
    s.rope_theta = sub.number_or("rope_theta", s.rope_theta);
  }
}

// model.dropout (a probability) for the family's dropouts, in the shape and its config.json.
void set_dropout(double p, HfShape& s) {
  if (s.family == "gpt2") {
    s.embd_pdrop = s.attn_pdrop = s.resid_pdrop = p;
    for (const char* field : {"embd_pdrop", "attn_pdrop", "resid_pdrop"}) s.config[field] = p;
  } else {
    s.attn_pdrop = p;
    s.config["attention_dropout"] = p;
  }
}

// The shape from keel's [model] keys, and the config.json transformers reads it from.
void from_keys(const ModelConfig& cfg, HfShape& s) {
  s.vocab = cfg.vocab;
  s.positions = cfg.context;
  s.width = cfg.width > 0 ? cfg.width : 256;
  s.layers = cfg.depth > 0 ? cfg.depth : 4;
  s.heads = cfg.heads;
  s.tied = cfg.tie_embeddings;
  if (s.family == "gpt2") {
    s.ffn = cfg.ffn_width > 0 ? cfg.ffn_width : 4 * s.width;
    s.eps = cfg.norm_eps > 0 ? cfg.norm_eps : 1e-5;
    s.config = {{"architectures", {"GPT2LMHeadModel"}},
                {"model_type", "gpt2"},
                {"vocab_size", s.vocab},
                {"n_positions", s.positions},
                {"n_embd", s.width},
                {"n_layer", s.layers},
                {"n_head", s.heads},
                {"n_inner", s.ffn},
                {"activation_function", "gelu_new"},
                {"layer_norm_epsilon", s.eps},
                {"tie_word_embeddings", s.tied}};
  } else {
    s.kv_heads = cfg.kv_heads > 0 ? cfg.kv_heads : cfg.heads;
    s.head_dim = s.width / std::max<int64_t>(1, s.heads);
    s.ffn = cfg.ffn_width > 0 ? cfg.ffn_width : (8 * s.width / 3 + 63) / 64 * 64;
    s.eps = cfg.norm_eps > 0 ? cfg.norm_eps : 1e-6;
    s.rope_theta = cfg.rope_theta;
    s.config = {{"architectures", {"LlamaForCausalLM"}},
                {"model_type", "llama"},
                {"vocab_size", s.vocab},
                {"max_position_embeddings", s.positions},
                {"hidden_size", s.width},
                {"intermediate_size", s.ffn},
                {"num_hidden_layers", s.layers},
                {"num_attention_heads", s.heads},
                {"num_key_value_heads", s.kv_heads},
                {"head_dim", s.head_dim},
                {"hidden_act", "silu"},
                {"rms_norm_eps", s.eps},
                {"rope_parameters", {{"rope_type", "default"}, {"rope_theta", s.rope_theta}}},
                {"tie_word_embeddings", s.tied},
                {"attention_bias", false},
                {"mlp_bias", false}};
  }
  set_dropout(std::max(cfg.dropout, 0.0), s);
  s.config["dtype"] = "float32";
  s.config["bos_token_id"] = nullptr;  // transformers' defaults name tokens a small vocabulary lacks
  s.config["eos_token_id"] = nullptr;
}

void from_file(const ModelConfig& cfg, const std::string& path, HfShape& s) {
  json j;
  try {
    j = json::parse(read_regular_file(path, uint64_t{16} << 20));
  } catch (const std::exception& e) {
    throw InputError("model.init_from: " + path + ": not a JSON config (" + e.what() + ")");
  }
  if (!j.is_object()) throw InputError("model.init_from: " + path + ": not a JSON object");
  const ConfigFile f{j, path};
  const std::string type = f.text_or("model_type", "");
  if (type != s.family)
    throw InputError("model.init_from: " + path + ": model_type is \"" + type + "\", but model.name = \"" + s.family +
                     "\"" + (type == "gpt2" || type == "llama" ? ": set model.name = \"" + type + "\"" : ""));
  s.family == "gpt2" ? read_gpt2(f, s) : read_llama(f, s);
  const ModelConfig d;
  agree(cfg, d, "vocab", &ModelConfig::vocab, s.vocab, "vocab_size", path);
  agree(cfg, d, "width", &ModelConfig::width, s.width, s.family == "gpt2" ? "n_embd" : "hidden_size", path);
  agree(cfg, d, "depth", &ModelConfig::depth, s.layers, s.family == "gpt2" ? "n_layer" : "num_hidden_layers", path);
  agree(cfg, d, "heads", &ModelConfig::heads, s.heads, s.family == "gpt2" ? "n_head" : "num_attention_heads", path);
  agree(cfg, d, "ffn_width", &ModelConfig::ffn_width, s.ffn, s.family == "gpt2" ? "n_inner" : "intermediate_size",
        path);
  if (s.family == "llama") agree(cfg, d, "kv_heads", &ModelConfig::kv_heads, s.kv_heads, "num_key_value_heads", path);
  s.config = j;
  s.source = path;
  if (cfg.dropout >= 0) set_dropout(cfg.dropout, s);  // the run's choice over the file's
}

void check(const ModelConfig& cfg, const HfShape& s) {
  const std::string from = s.source.empty() ? "" : " (" + s.source + ")";
  if (s.family == "gpt2" && s.width % s.heads != 0)
    throw InputError("model: the width " + std::to_string(s.width) + " (" + s.origin("model.width") +
                     ") does not divide by the heads " + std::to_string(s.heads) + " (" + s.origin("model.heads") +
                     ")");
  if (s.family == "llama") {
    if (s.source.empty() && s.width % s.heads != 0)
      throw InputError("model: width " + std::to_string(s.width) +
                       " is not divisible by model.heads = " + std::to_string(s.heads));
    if (s.heads % s.kv_heads != 0)
      throw InputError(s.source.empty() ? "model.kv_heads = " + std::to_string(s.kv_heads) +
                                              " does not divide model.heads = " + std::to_string(s.heads)
                                        : "model: the key/value heads " + std::to_string(s.kv_heads) + " (" +
                                              s.origin("model.kv_heads") + ") do not divide the heads " +
                                              std::to_string(s.heads) + " (" + s.origin("model.heads") + ")");
    if (s.head_dim % 2 != 0)
      throw InputError("model: the head width " + std::to_string(s.head_dim) +
                       " is odd; the rotary embedding needs it even" + from);
  }
  if (s.family == "gpt2" && cfg.context > s.positions)
    throw InputError("model.context = " + std::to_string(cfg.context) + " is more than the " +
                     std::to_string(s.positions) + " positions of the model (n_positions" + from + ")");
}

}  // namespace

double hf_train_flops(const torch::nn::Module& model, const HfShape& s, int64_t context,
                      const std::vector<std::string>& lookups) {
  double matmul_params = 0;
  for (const auto& p : model.named_parameters())
    if (std::find(lookups.begin(), lookups.end(), p.key()) == lookups.end())
      matmul_params += static_cast<double>(p.value().numel());
  const double T = static_cast<double>(context);
  const double attention_width = static_cast<double>(s.heads * (s.head_dim > 0 ? s.head_dim : s.width / s.heads));
  return (6.0 * matmul_params + 12.0 * static_cast<double>(s.layers) * attention_width * T) * T;
}

bool is_hf_family(const std::string& name) { return name == "gpt2" || name == "llama"; }

HfShape hf_shape(const ModelConfig& cfg) {
  HfShape s;
  s.family = cfg.name;
  const std::string& from = cfg.init_from;
  std::error_code ec;
  if (!from.empty() && std::filesystem::is_directory(from, ec) && std::filesystem::exists(from + "/config.json", ec))
    from_file(cfg, from + "/config.json", s);
  else
    from_keys(cfg, s);
  check(cfg, s);
  return s;
}

std::string HfShape::origin(const std::string& key) const {
  if (source.empty()) return key;
  const bool gpt2 = family == "gpt2";
  const std::pair<const char*, const char*> fields[] = {
      {"model.vocab", "vocab_size"},
      {"model.width", gpt2 ? "n_embd" : "hidden_size"},
      {"model.depth", gpt2 ? "n_layer" : "num_hidden_layers"},
      {"model.heads", gpt2 ? "n_head" : "num_attention_heads"},
      {"model.kv_heads", gpt2 ? "n_head" : "num_key_value_heads"},
      {"model.ffn_width", gpt2 ? "n_inner" : "intermediate_size"},
      {"model.context", gpt2 ? "n_positions" : "max_position_embeddings"}};
  for (const auto& [k, field] : fields)
    if (key == k) {
      // A field the file leaves out (or null) took transformers' default: said so, not named as
      // if the file held it (n_inner absent: 4 x n_embd; num_key_value_heads: the heads).
      if (!config.is_object() || !config.contains(field) || config.at(field).is_null())
        return std::string(field) + " absent from " + source + ", transformers' default";
      return std::string(field) + " in " + source;
    }
  return key + " (" + source + ")";
}

std::string dropout_origin(const ModelConfig& cfg) {
  if (cfg.dropout >= 0 || !is_hf_family(cfg.name)) return "model.dropout";
  const HfShape s = hf_shape(cfg);
  if (s.source.empty()) return "model.dropout";
  std::string fields;
  const bool gpt2 = s.family == "gpt2";
  const std::vector<std::pair<const char*, double>> used =
      gpt2 ? std::vector<std::pair<const char*, double>>{{"embd_pdrop", s.embd_pdrop},
                                                         {"attn_pdrop", s.attn_pdrop},
                                                         {"resid_pdrop", s.resid_pdrop}}
           : std::vector<std::pair<const char*, double>>{{"attention_dropout", s.attn_pdrop}};
  for (const auto& [f, p] : used) {
    std::ostringstream os;
    os << f << " = " << p;
    if (!s.config.contains(f)) os << " (absent: transformers' default)";
    fields += (fields.empty() ? "" : ", ") + os.str();
  }
  return fields + " in " + s.source + " (model.dropout unset takes the file's)";
}

double model_dropout(const ModelConfig& cfg) {
  if (is_hf_family(cfg.name)) return hf_shape(cfg).max_dropout();
  return cfg.name == "gpt" ? std::max(cfg.dropout, 0.0) : 0.0;
}

TensorRename hf_tensor_rename(const HfShape& shape) {
  const bool gpt2 = shape.family == "gpt2", tied = shape.tied;
  return [gpt2, tied](const std::string& name) -> std::optional<std::string> {
    auto ends_with = [&](const std::string& tail) {
      return name.size() >= tail.size() && name.compare(name.size() - tail.size(), tail.size(), tail) == 0;
    };
    if (name == "lm_head.weight") return tied ? std::nullopt : std::optional<std::string>(name);
    if (gpt2) {
      // GPT-2 files from before transformers' base-model prefix, and their causal-mask buffers.
      if (ends_with(".attn.bias") || ends_with(".attn.masked_bias")) return std::nullopt;
      return name.rfind("transformer.", 0) == 0 ? name : "transformer." + name;
    }
    if (ends_with("rotary_emb.inv_freq")) return std::nullopt;
    return name.rfind("model.", 0) == 0 ? name : "model." + name;
  };
}

}  // namespace keel::models
