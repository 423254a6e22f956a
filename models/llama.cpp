// llama: transformers' LlamaForCausalLM in C++, same tensor names and layouts
// (model.embed_tokens, model.layers.N.{input_layernorm, self_attn.{q,k,v,o}_proj,
// post_attention_layernorm, mlp.{gate,up,down}_proj}, model.norm; lm_head unless tied).
// RMSNorm in float32, rotary position embeddings (rope_theta; the two halves of each head
// rotated, as transformers' rotate_half), grouped-query attention (num_key_value_heads, each
// key/value head serving heads / kv_heads consecutive query heads), a SwiGLU MLP; the block is
// models/transformer.h's.
#include "models/deferred_init.h"
#include "models/hf.h"
#include "models/transformer.h"

namespace keel::models {
namespace {

BlockOptions llama_block(const HfShape& s) {
  BlockOptions o;
  o.width = s.width;
  o.heads = s.heads;
  o.kv_heads = s.kv_heads;
  o.head_dim = s.head_dim;
  o.ffn = s.ffn;
  o.norm = BlockOptions::Norm::Rms;
  o.eps = s.eps;
  o.mlp = BlockOptions::Mlp::SwiGlu;
  o.fused_qkv = false;
  o.rotary = true;
  o.attention_bias = s.attention_bias;
  o.mlp_bias = s.mlp_bias;
  o.attn_pdrop = s.attn_pdrop;  // attention_dropout, as transformers; no residual dropout
  auto& n = o.names;
  n.norm_1 = "input_layernorm", n.attn = "self_attn", n.norm_2 = "post_attention_layernorm";
  n.out = "o_proj", n.down = "down_proj";
  n.norms_last = true;  // transformers' LlamaDecoderLayer registers its norms last
  return o;
}

torch::nn::Embedding embedding(const HfShape& s) {
  auto o = torch::nn::EmbeddingOptions(s.vocab, s.width);
  if (s.padding_idx >= 0) o.padding_idx(s.padding_idx);
  return torch::nn::Embedding(o);
}

struct LlamaBodyImpl : torch::nn::Module {
  explicit LlamaBodyImpl(const HfShape& s)
      : hd(s.head_dim),
        theta(s.rope_theta),
        embed_tokens(register_module("embed_tokens", embedding(s))),
        layers(register_module("layers", torch::nn::ModuleList())),
        norm(register_module("norm", RmsNorm(s.width, s.eps))) {
    defer_parameters(*this);  // sharded initialisation (models/deferred_init.h); else nothing
    for (int64_t i = 0; i < s.layers; ++i) {
      TransformerBlock block(llama_block(s));
      defer_parameters(*block);
      layers->push_back(block);
    }
  }
  // The root's two parts and the blocks between them (LlamaImpl::forward runs them).
  torch::Tensor embed(const torch::Tensor& idx) {
    return tp_vocab ? tp_vocab.embed(idx, embed_tokens->weight, embed_tokens->options.padding_idx().value_or(-1))
                    : embed_tokens->forward(idx);
  }
  torch::Tensor run_layers(const torch::Tensor& x, int64_t T) {
    auto emb = rotary_angles(T, hd, theta, x.device());  // (T, hd) float32
    // In the embedding's dtype, as transformers does (float32 under autocast too).
    const auto cos = emb.cos().to(x.scalar_type()), sin = emb.sin().to(x.scalar_type());
    return run_blocks(layers, blocks, x, cos, sin);
  }
  torch::Tensor final_norm(const torch::Tensor& x) {
    const auto y = norm->forward(x);
    return tp_vocab ? tp_vocab.enter_head(y) : y;
  }
  int64_t hd;
  double theta;
  TpVocab tp_vocab;  // tensor parallel: embed_tokens (and lm_head) hold this rank's vocabulary rows
  torch::nn::Embedding embed_tokens;
  torch::nn::ModuleList layers;
  RmsNorm norm;
  BlockStructure* blocks = nullptr;  // the model's, for dist.zero = 3
};
TORCH_MODULE(LlamaBody);

struct LlamaImpl : torch::nn::Module, BlockStructure {
  explicit LlamaImpl(const HfShape& s) : model(register_module("model", LlamaBody(s))) {
    model->blocks = this;
    for (int64_t i = 0; i < s.layers; ++i)
      block_prefixes.push_back(llama_family().block_prefix + std::to_string(i) + ".");
    if (!s.tied)
      lm_head = register_module("lm_head", torch::nn::Linear(torch::nn::LinearOptions(s.width, s.vocab).bias(false)));
    defer_parameters(*this);
    // transformers' initialisation: N(0, initializer_range = 0.02), zero biases, unit norms.
    for (auto& p : named_parameters()) {
      const auto& name = p.key();
      if (name.find("norm") != std::string::npos)
        init_fill_(p.value(), 1.0);
      else if (name.size() >= 4 && name.compare(name.size() - 4, 4, "bias") == 0)
        init_fill_(p.value(), 0.0);
      else
        init_normal_(p.value(), 0.0, 0.02);
    }
    if (const int64_t pad = s.padding_idx; pad >= 0)
      init_edit_(model->embed_tokens->weight, [pad](torch::Tensor& w) { w[pad].zero_(); });
  }
  torch::Tensor forward(const torch::Tensor& idx) {
    TORCH_CHECK(idx.dim() == 2 || !takes_tokens(), "llama expects tokens (B, T), got ", idx.sizes());
    auto x = root_call(RootPart::Embed, idx, [&](const torch::Tensor& ids) { return model->embed(ids); });
    x = model->run_layers(x, idx.size(1));
    return root_call(RootPart::Head, x, [&](const torch::Tensor& last) {
      const auto y = model->final_norm(last);
      return lm_head ? lm_head->forward(y) : torch::matmul(y, model->embed_tokens->weight.t());
    });
  }
  LlamaBody model;
  torch::nn::Linear lm_head{nullptr};
};
TORCH_MODULE(Llama);

}  // namespace

std::shared_ptr<Model> make_llama(const ModelConfig& cfg) {
  const HfShape s = hf_shape(cfg);
  Llama model(s);
  std::vector<std::string> lookups;
  if (!s.tied) lookups.push_back("model.embed_tokens.weight");
  return std::make_shared<ModuleModel<Llama>>("llama", model, InputSpec{InputKind::Tokens, {cfg.context}, s.vocab},
                                              hf_train_flops(*model, s, cfg.context, lookups));
}

namespace {

// Tensor parallelism: each block by the plan (q, k, v by heads: kv_heads / tp key/value heads
// per rank), the token embedding and an untied lm_head by vocabulary rows; the norms replicated.
void shard_llama(Model& model, const TensorParallelParts& parts) {
  auto& m = dynamic_cast<ModuleModel<Llama>&>(model).module();
  shard_blocks_and_vocabulary(*m, m->model->layers, llama_family().tp_plan, parts);
  m->model->tp_vocab = parts.vocab;
}

}  // namespace

const TransformerFamily& llama_family() {
  static const TransformerFamily f{
      "llama", make_llama, "model.layers.",
      tensor_parallel_plan(llama_block(HfShape{}), {"model.embed_tokens.weight", "lm_head.weight"}), shard_llama};
  return f;
}

}  // namespace keel::models
