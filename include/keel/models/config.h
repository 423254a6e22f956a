// keel/models/config.h: the [model] section. Defaults here; each key's meaning, units and range are
// written once, in the config schema (trainer/config/schema.cpp, docs/config.md).
#pragma once

#include <cstdint>
#include <string>

#include "keel/common/choices.h"

namespace keel {

/// model.input: what a TorchScript model eats.
enum class ModelInput { Auto, Image, Tokens };
inline constexpr Choices<ModelInput, 3> kModelInputs{
    {{"auto", ModelInput::Auto}, {"image", ModelInput::Image}, {"tokens", ModelInput::Tokens}}};

struct ModelConfig {
  std::string name = "cnn";
  std::string path = "";
  std::string factory = "build_model";  // model.name = "python": the function in model.path
  int64_t width = 0;
  int64_t depth = 0;
  int64_t heads = 4;
  int64_t context = 128;
  int64_t vocab = 256;
  ModelInput input = ModelInput::Auto;
  int64_t num_classes = 10;
  // The Hugging Face families (gpt2, llama; models/hf.h). Sizes from a config.json in
  // init_from's directory win; a key given here that disagrees with it is an error.
  int64_t kv_heads = 0;         // llama: key/value heads (grouped-query attention); 0 = model.heads
  int64_t ffn_width = 0;        // the MLP's inner width; 0 = the family's default
  double rope_theta = 10000.0;  // llama: the rotary embedding's base
  double norm_eps = 0.0;        // LayerNorm / RMSNorm epsilon; 0 = the family's default
  bool tie_embeddings = true;   // the output projection is the token embedding
  // gpt, gpt2, llama: the dropout probability while training; -1 = init_from's config.json's
  // (gpt2: embd_pdrop, resid_pdrop, attn_pdrop; llama: attention_dropout), else 0.
  double dropout = -1.0;
  std::string init_from = "";  // safetensors weights to start from (keel/checkpoint/checkpoint.h load_weights)
  // gpt, gpt2, llama at dist.zero = 3 or parallel.tp > 1: each rank makes only its shards of the
  // parameters (the same values, bit for bit); false = every rank builds the whole model first.
  bool sharded_init = true;
};

}  // namespace keel
