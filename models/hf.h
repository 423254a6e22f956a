// models/hf.h: the Hugging Face families, gpt2 and llama: models built in C++ whose parameters
// have transformers' names, shapes and layouts (GPT2LMHeadModel, LlamaForCausalLM), so that a
// directory written by `save_pretrained` loads into them and a keel checkpoint exports to one.
//
// Owns: a family's shape (HfShape), read from a config.json in model.init_from's directory or
// made from keel's [model] keys, with the config.json that describes it to transformers; the
// map from a Hugging Face file's tensor names to the model's (the base-model prefix of older
// GPT-2 files, the causal-mask buffers they carry, a tied lm_head written anyway); the
// factories. Does not own: reading safetensors (checkpoint/weights.cpp), the export command
// (trainer/app/export.cpp).
#pragma once

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "keel/models/model.h"

namespace keel::models {

struct HfShape {
  std::string family;  // "gpt2" | "llama"
  int64_t vocab = 0, positions = 0, width = 0, layers = 0, heads = 0, kv_heads = 0, head_dim = 0, ffn = 0;
  double eps = 0, rope_theta = 10000.0;
  bool tied = true;
  bool tanh_gelu = true;                          // gpt2: gelu_new / gelu_pytorch_tanh; false: gelu (erf)
  bool attention_bias = false, mlp_bias = false;  // llama
  int64_t padding_idx = -1;  // llama: pad_token_id (a negative one from the end), whose row gets no gradient; -1 none
  // Dropout while training (model.dropout, or the file's): gpt2 after the embeddings, on the
  // attention weights, after each residual branch; llama on the attention weights only.
  double embd_pdrop = 0, attn_pdrop = 0, resid_pdrop = 0;
  double max_dropout() const { return std::max({embd_pdrop, attn_pdrop, resid_pdrop}); }
  nlohmann::json config;  // config.json as transformers reads it
  std::string source;     // the config.json the shape came from, or ""
  /// Where the value keel's `key` stands for came from, for messages: the key itself
  /// ("model.heads"), or the field of the config.json it was read from ("n_head in
  /// DIR/config.json"). Keys: model.vocab, model.width, model.depth, model.heads,
  /// model.kv_heads, model.ffn_width, model.context.
  std::string origin(const std::string& key) const;
};

/// Whether model.name is a Hugging Face family (gpt2, llama).
bool is_hf_family(const std::string& name);

/// The shape of model.name's family: from `<model.init_from>/config.json` when init_from is a
/// directory holding one (its model_type must be the family's; a [model] key set to another
/// value than the file's is an error naming both), else from the [model] keys. Throws
/// InputError naming the key or the file's field for a shape the family cannot build.
HfShape hf_shape(const ModelConfig& cfg);

/// The largest dropout probability the model model.name builds applies while training: gpt's
/// model.dropout, a Hugging Face family's (model.dropout or its config.json's), else 0.
double model_dropout(const ModelConfig& cfg);

/// Where model_dropout's probability came from, for messages: "model.dropout", or the
/// config.json's fields when model.dropout is left to the file ("attn_pdrop = 0.1, ... in
/// DIR/config.json").
std::string dropout_origin(const ModelConfig& cfg);

/// Maps a tensor name of a Hugging Face file to the model's: nullopt = not a tensor of the
/// model that is wanted (a tied lm_head, an old causal-mask or rotary buffer), skipped.
using TensorRename = std::function<std::optional<std::string>(const std::string&)>;
TensorRename hf_tensor_rename(const HfShape& shape);

/// Training FLOPs of one sample of `context` tokens: per token, 6 x the parameters it multiplies
/// with (all but the embedding lookups `lookups`; a tied token embedding counts once, as the
/// output projection), plus the attention scores and their weighted sum, 12 x layers x
/// attention width x context.
double hf_train_flops(const torch::nn::Module& model, const HfShape& s, int64_t context,
                      const std::vector<std::string>& lookups);

std::shared_ptr<Model> make_gpt2(const ModelConfig& cfg);
std::shared_ptr<Model> make_llama(const ModelConfig& cfg);

}  // namespace keel::models
