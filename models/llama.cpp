// llama: transformers' LlamaForCausalLM in C++, same tensor names and layouts
// (model.embed_tokens, model.layers.N.{input_layernorm, self_attn.{q,k,v,o}_proj,
// post_attention_layernorm, mlp.{gate,up,down}_proj}, model.norm; lm_head unless tied).
// RMSNorm in float32, rotary position embeddings (rope_theta; the two halves of each head
// rotated, as transformers' rotate_half), grouped-query attention (num_key_value_heads, each
// key/value head serving heads / kv_heads consecutive query heads), a SwiGLU MLP.
#include "models/hf.h"

namespace keel::models {
namespace {

struct RmsNormImpl : torch::nn::Module {
  RmsNormImpl(int64_t d, double eps) : eps(eps), weight(register_parameter("weight", torch::ones({d}))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = x.to(torch::kFloat);
    h = h * torch::rsqrt(h.pow(2).mean(-1, /*keepdim=*/true) + eps);
    return weight * h.to(x.scalar_type());
  }
  double eps;
  torch::Tensor weight;
};
TORCH_MODULE(RmsNorm);

torch::nn::Linear linear(int64_t in, int64_t out, bool bias) {
  return torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(bias));
}

// (x1, x2) -> (-x2, x1) over the two halves of the last dimension.
torch::Tensor rotate_half(const torch::Tensor& x) {
  auto halves = x.chunk(2, -1);
  return torch::cat({-halves[1], halves[0]}, -1);
}

struct LlamaAttentionImpl : torch::nn::Module {
  explicit LlamaAttentionImpl(const HfShape& s)
      : heads(s.heads),
        kv_heads(s.kv_heads),
        hd(s.head_dim),
        attn_pdrop(s.attn_pdrop),
        q_proj(register_module("q_proj", linear(s.width, s.heads * s.head_dim, s.attention_bias))),
        k_proj(register_module("k_proj", linear(s.width, s.kv_heads * s.head_dim, s.attention_bias))),
        v_proj(register_module("v_proj", linear(s.width, s.kv_heads * s.head_dim, s.attention_bias))),
        o_proj(register_module("o_proj", linear(s.heads * s.head_dim, s.width, s.attention_bias))) {}
  // x (B, T, C); cos, sin (T, hd)
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
    const int64_t B = x.size(0), T = x.size(1);
    auto q = q_proj->forward(x).view({B, T, heads, hd}).transpose(1, 2);
    auto k = k_proj->forward(x).view({B, T, kv_heads, hd}).transpose(1, 2);
    auto v = v_proj->forward(x).view({B, T, kv_heads, hd}).transpose(1, 2);
    q = q * cos + rotate_half(q) * sin;
    k = k * cos + rotate_half(k) * sin;
    if (kv_heads != heads) {
      k = k.repeat_interleave(heads / kv_heads, 1);
      v = v.repeat_interleave(heads / kv_heads, 1);
    }
    const double p = is_training() ? attn_pdrop : 0.0;  // attention_dropout, as transformers
    auto y = at::scaled_dot_product_attention(q, k, v, /*attn_mask=*/{}, /*dropout_p=*/p, /*is_causal=*/true)
                 .transpose(1, 2)
                 .reshape({B, T, heads * hd});
    return o_proj->forward(y);
  }
  int64_t heads, kv_heads, hd;
  double attn_pdrop;
  torch::nn::Linear q_proj, k_proj, v_proj, o_proj;
};
TORCH_MODULE(LlamaAttention);

struct LlamaMlpImpl : torch::nn::Module {
  explicit LlamaMlpImpl(const HfShape& s)
      : gate_proj(register_module("gate_proj", linear(s.width, s.ffn, s.mlp_bias))),
        up_proj(register_module("up_proj", linear(s.width, s.ffn, s.mlp_bias))),
        down_proj(register_module("down_proj", linear(s.ffn, s.width, s.mlp_bias))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    return down_proj->forward(torch::silu(gate_proj->forward(x)) * up_proj->forward(x));
  }
  torch::nn::Linear gate_proj, up_proj, down_proj;
};
TORCH_MODULE(LlamaMlp);

struct LlamaLayerImpl : torch::nn::Module {
  explicit LlamaLayerImpl(const HfShape& s)
      : self_attn(register_module("self_attn", LlamaAttention(s))),
        mlp(register_module("mlp", LlamaMlp(s))),
        input_layernorm(register_module("input_layernorm", RmsNorm(s.width, s.eps))),
        post_attention_layernorm(register_module("post_attention_layernorm", RmsNorm(s.width, s.eps))) {}
  torch::Tensor forward(torch::Tensor x, const torch::Tensor& cos, const torch::Tensor& sin) {
    x = x + self_attn->forward(input_layernorm->forward(x), cos, sin);
    return x + mlp->forward(post_attention_layernorm->forward(x));
  }
  LlamaAttention self_attn;
  LlamaMlp mlp;
  RmsNorm input_layernorm, post_attention_layernorm;
};
TORCH_MODULE(LlamaLayer);

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
    for (int64_t i = 0; i < s.layers; ++i) layers->push_back(LlamaLayer(s));
  }
  torch::Tensor forward(const torch::Tensor& idx) {
    // The rotary angles in float32, as transformers' LlamaRotaryEmbedding: position x
    // theta^(-2i / hd), each frequency twice (the two halves).
    const auto f32 = torch::TensorOptions().dtype(torch::kFloat).device(idx.device());
    auto inv_freq = 1.0 / torch::pow(theta, torch::arange(0, hd, 2, torch::TensorOptions().dtype(torch::kLong))
                                                .to(torch::kFloat)
                                                .div(static_cast<double>(hd)));
    auto freqs = torch::outer(torch::arange(idx.size(1), f32), inv_freq.to(idx.device()));
    auto emb = torch::cat({freqs, freqs}, -1);
    auto x = embed_tokens->forward(idx);
    // In the embedding's dtype, as transformers does (float32 under autocast too).
    const auto cos = emb.cos().to(x.scalar_type()), sin = emb.sin().to(x.scalar_type());
    for (size_t i = 0; i < layers->size(); ++i) {
      const auto in = blocks ? blocks->block_enter(i, x) : x;
      const auto out = layers[i]->as<LlamaLayer>()->forward(in, cos, sin);
      x = blocks ? blocks->block_leave(i, out) : out;
    }
    return norm->forward(x);
  }
  int64_t hd;
  double theta;
  torch::nn::Embedding embed_tokens;
  torch::nn::ModuleList layers;
  RmsNorm norm;
  BlockStructure* blocks = nullptr;  // the model's, for dist.zero = 3
};
TORCH_MODULE(LlamaBody);

struct LlamaImpl : torch::nn::Module, BlockStructure {
  explicit LlamaImpl(const HfShape& s) : model(register_module("model", LlamaBody(s))) {
    model->blocks = this;
    for (int64_t i = 0; i < s.layers; ++i) block_prefixes.push_back("model.layers." + std::to_string(i) + ".");
    if (!s.tied) lm_head = register_module("lm_head", linear(s.width, s.vocab, false));
    // transformers' initialisation: N(0, initializer_range = 0.02), zero biases, unit norms.
    torch::NoGradGuard ng;
    for (auto& p : named_parameters()) {
      const auto& name = p.key();
      if (name.find("norm") != std::string::npos)
        p.value().fill_(1.0);
      else if (name.size() >= 4 && name.compare(name.size() - 4, 4, "bias") == 0)
        p.value().zero_();
      else
        p.value().normal_(0.0, 0.02);
    }
    if (s.padding_idx >= 0) model->embed_tokens->weight[s.padding_idx].zero_();
  }
  torch::Tensor forward(const torch::Tensor& idx) {
    TORCH_CHECK(idx.dim() == 2, "llama expects tokens (B, T), got ", idx.sizes());
    auto x = model->forward(idx);
    return lm_head ? lm_head->forward(x) : torch::matmul(x, model->embed_tokens->weight.t());
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

}  // namespace keel::models
