// gpt: a byte-level GPT (nanoGPT layout and parameter names). Defaults: vocab 256, context 128,
// 4 blocks, 4 heads, width 256. Pre-LayerNorm blocks with one fused qkv Linear (c_attn), causal
// attention (scaled_dot_product_attention), a GELU MLP of 4x width, a final LayerNorm, a learned position embedding,
// and the output projection tied to the token embedding (wte). model.dropout while training, where
// nanoGPT has it: after the embeddings, on the attention weights, after each residual branch.
#include <algorithm>
#include <cmath>

#include "keel/models/model.h"

namespace keel::models {
namespace {

// Dropout while training; nothing at all (no op, no random numbers) when p = 0 or evaluating.
torch::Tensor drop(const torch::Tensor& x, double p, bool training) {
  return p > 0 && training ? torch::dropout(x, p, true) : x;
}

struct AttentionImpl : torch::nn::Module {
  AttentionImpl(int64_t d, int64_t heads, double dropout)
      : heads(heads),
        dropout(dropout),
        c_attn(register_module("c_attn", torch::nn::Linear(d, 3 * d))),
        c_proj(register_module("c_proj", torch::nn::Linear(d, d))) {}
  // x: (B, T, C) -> (B, T, C)
  torch::Tensor forward(const torch::Tensor& x) {
    const int64_t B = x.size(0), T = x.size(1), C = x.size(2), hd = C / heads;
    auto qkv = c_attn->forward(x).split(C, /*dim=*/2);        // 3 x (B, T, C)
    auto q = qkv[0].view({B, T, heads, hd}).transpose(1, 2);  // (B, H, T, hd)
    auto k = qkv[1].view({B, T, heads, hd}).transpose(1, 2);
    auto v = qkv[2].view({B, T, heads, hd}).transpose(1, 2);
    // Fused causal attention (flash or cuDNN kernels on the GPU, a flash kernel on the CPU),
    // scale 1/sqrt(hd): equal to the explicit masked softmax within float32 rounding
    // (tests/test_models.cpp checks it against PyTorch's masked softmax).
    const double p = is_training() ? dropout : 0.0;
    auto y = at::scaled_dot_product_attention(q, k, v, /*attn_mask=*/{}, /*dropout_p=*/p, /*is_causal=*/true)
                 .transpose(1, 2)
                 .contiguous()
                 .view({B, T, C});
    return drop(c_proj->forward(y), dropout, is_training());
  }
  int64_t heads;
  double dropout;
  torch::nn::Linear c_attn, c_proj;
};
TORCH_MODULE(Attention);

struct MlpBlockImpl : torch::nn::Module {
  MlpBlockImpl(int64_t d, double dropout)
      : dropout(dropout),
        c_fc(register_module("c_fc", torch::nn::Linear(d, 4 * d))),
        c_proj(register_module("c_proj", torch::nn::Linear(4 * d, d))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    return drop(c_proj->forward(torch::gelu(c_fc->forward(x))), dropout, is_training());
  }
  double dropout;
  torch::nn::Linear c_fc, c_proj;
};
TORCH_MODULE(MlpBlock);

struct BlockImpl : torch::nn::Module {
  BlockImpl(int64_t d, int64_t heads, double dropout)
      : ln_1(register_module("ln_1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})))),
        attn(register_module("attn", Attention(d, heads, dropout))),
        ln_2(register_module("ln_2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})))),
        mlp(register_module("mlp", MlpBlock(d, dropout))) {}
  torch::Tensor forward(torch::Tensor x) {
    x = x + attn->forward(ln_1->forward(x));
    return x + mlp->forward(ln_2->forward(x));
  }
  torch::nn::LayerNorm ln_1;
  Attention attn;
  torch::nn::LayerNorm ln_2;
  MlpBlock mlp;
};
TORCH_MODULE(Block);

struct GptImpl : torch::nn::Module, BlockStructure {
  GptImpl(int64_t vocab, int64_t context, int64_t layers, int64_t heads, int64_t d, double dropout)
      : context(context),
        dropout(dropout),
        wte(register_module("wte", torch::nn::Embedding(vocab, d))),
        wpe(register_module("wpe", torch::nn::Embedding(context, d))),
        h(register_module("h", torch::nn::ModuleList())),
        ln_f(register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})))) {
    for (int64_t i = 0; i < layers; ++i) {
      h->push_back(Block(d, heads, dropout));
      block_prefixes.push_back("h." + std::to_string(i) + ".");
    }
    // GPT-2 initialisation: N(0, 0.02), zero biases, residual projections scaled by depth.
    torch::NoGradGuard ng;
    for (auto& p : named_parameters()) {
      const auto& name = p.key();
      auto& t = p.value();
      if (name.size() >= 4 && name.compare(name.size() - 4, 4, "bias") == 0)
        t.zero_();
      else if (name.find("ln_") != std::string::npos)
        t.fill_(1.0);
      else if (name.find("c_proj.weight") != std::string::npos)
        t.normal_(0.0, 0.02 / std::sqrt(2.0 * layers));
      else
        t.normal_(0.0, 0.02);
    }
  }
  // idx: (B, T) int64 -> logits (B, T, vocab)
  torch::Tensor forward(const torch::Tensor& idx) {
    TORCH_CHECK(idx.dim() == 2 && idx.size(1) <= context, "gpt expects tokens (B, T<=", context, "), got ",
                idx.sizes());
    const int64_t T = idx.size(1);
    auto pos = torch::arange(T, torch::TensorOptions().dtype(torch::kLong).device(idx.device()));
    auto x = drop(wte->forward(idx) + wpe->forward(pos), dropout, is_training());  // (B, T, C)
    for (size_t i = 0; i < h->size(); ++i) x = block_leave(i, h[i]->as<Block>()->forward(block_enter(i, x)));
    x = ln_f->forward(x);
    return torch::matmul(x, wte->weight.t());  // tied output projection
  }
  int64_t context;
  double dropout;
  torch::nn::Embedding wte, wpe;
  torch::nn::ModuleList h;
  torch::nn::LayerNorm ln_f;
};
TORCH_MODULE(Gpt);

}  // namespace

std::shared_ptr<Model> make_gpt(const ModelConfig& cfg) {
  const int64_t d = cfg.width > 0 ? cfg.width : 256;
  const int64_t layers = cfg.depth > 0 ? cfg.depth : 4;
  if (d % cfg.heads != 0)
    throw InputError("model: width " + std::to_string(d) +
                     " is not divisible by model.heads = " + std::to_string(cfg.heads));
  InputSpec spec{InputKind::Tokens, {cfg.context}, cfg.vocab};
  Gpt gpt(cfg.vocab, cfg.context, layers, cfg.heads, d, std::max(cfg.dropout, 0.0));
  // Per token: 6 x the parameters it multiplies with (all but the position embedding, a lookup;
  // the tied token embedding counts once, as the output projection), plus the attention scores
  // and their weighted sum, 12 x layers x context x width (forward 4, backward 8).
  int64_t params = 0;
  for (const auto& p : gpt->parameters()) params += p.numel();
  const double per_token =
      6.0 * static_cast<double>(params - cfg.context * d) + 12.0 * static_cast<double>(layers * cfg.context * d);
  return std::make_shared<ModuleModel<Gpt>>("gpt", gpt, spec, per_token * static_cast<double>(cfg.context));
}

}  // namespace keel::models
