// gpt2: transformers' GPT2LMHeadModel in C++, same tensor names and layouts
// (transformer.wte, transformer.wpe, transformer.h.N.{ln_1, attn.c_attn, attn.c_proj, ln_2,
// mlp.c_fc, mlp.c_proj}, transformer.ln_f; lm_head only when untied). Its linear layers are
// GPT-2's Conv1D: weight (in, out), y = x W + b. Pre-LayerNorm blocks, causal attention scaled by
// 1/sqrt(head width), GELU with tanh (gelu_new) or erf, learned positions; dropout while training
// where transformers has it (embd_pdrop after the embeddings, attn_pdrop on the attention
// weights, resid_pdrop after each residual branch's projection).
#include <cmath>

#include "models/hf.h"

namespace keel::models {
namespace {

// Dropout while training; nothing at all (no op, no random numbers) when p = 0 or evaluating.
torch::Tensor drop(const torch::Tensor& x, double p, bool training) {
  return p > 0 && training ? torch::dropout(x, p, true) : x;
}

struct Conv1DImpl : torch::nn::Module {
  Conv1DImpl(int64_t in, int64_t out)
      : weight(register_parameter("weight", torch::empty({in, out}))),
        bias(register_parameter("bias", torch::zeros({out}))) {}
  // As transformers' Conv1D: addmm over the flattened leading dimensions.
  torch::Tensor forward(const torch::Tensor& x) {
    auto shape = x.sizes().vec();
    shape.back() = weight.size(1);
    return torch::addmm(bias, x.reshape({-1, x.size(-1)}), weight).view(shape);
  }
  torch::Tensor weight, bias;
};
TORCH_MODULE(Conv1D);

struct Gpt2AttentionImpl : torch::nn::Module {
  Gpt2AttentionImpl(int64_t d, int64_t heads, double attn_pdrop, double resid_pdrop)
      : heads(heads),
        attn_pdrop(attn_pdrop),
        resid_pdrop(resid_pdrop),
        c_attn(register_module("c_attn", Conv1D(d, 3 * d))),
        c_proj(register_module("c_proj", Conv1D(d, d))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    const int64_t B = x.size(0), T = x.size(1), C = x.size(2), hd = C / heads;
    auto qkv = c_attn->forward(x).split(C, /*dim=*/2);
    auto q = qkv[0].view({B, T, heads, hd}).transpose(1, 2);
    auto k = qkv[1].view({B, T, heads, hd}).transpose(1, 2);
    auto v = qkv[2].view({B, T, heads, hd}).transpose(1, 2);
    const double p = is_training() ? attn_pdrop : 0.0;
    auto y = at::scaled_dot_product_attention(q, k, v, /*attn_mask=*/{}, /*dropout_p=*/p, /*is_causal=*/true)
                 .transpose(1, 2)
                 .reshape({B, T, C});
    return drop(c_proj->forward(y), resid_pdrop, is_training());
  }
  int64_t heads;
  double attn_pdrop, resid_pdrop;
  Conv1D c_attn, c_proj;
};
TORCH_MODULE(Gpt2Attention);

struct Gpt2MlpImpl : torch::nn::Module {
  Gpt2MlpImpl(int64_t d, int64_t inner, bool tanh, double resid_pdrop)
      : tanh(tanh),
        resid_pdrop(resid_pdrop),
        c_fc(register_module("c_fc", Conv1D(d, inner))),
        c_proj(register_module("c_proj", Conv1D(inner, d))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    return drop(c_proj->forward(torch::gelu(c_fc->forward(x), tanh ? "tanh" : "none")), resid_pdrop, is_training());
  }
  bool tanh;
  double resid_pdrop;
  Conv1D c_fc, c_proj;
};
TORCH_MODULE(Gpt2Mlp);

torch::nn::LayerNorm layer_norm(int64_t d, double eps) {
  return torch::nn::LayerNorm(torch::nn::LayerNormOptions({d}).eps(eps));
}

struct Gpt2BlockImpl : torch::nn::Module {
  explicit Gpt2BlockImpl(const HfShape& s)
      : ln_1(register_module("ln_1", layer_norm(s.width, s.eps))),
        attn(register_module("attn", Gpt2Attention(s.width, s.heads, s.attn_pdrop, s.resid_pdrop))),
        ln_2(register_module("ln_2", layer_norm(s.width, s.eps))),
        mlp(register_module("mlp", Gpt2Mlp(s.width, s.ffn, s.tanh_gelu, s.resid_pdrop))) {}
  torch::Tensor forward(torch::Tensor x) {
    x = x + attn->forward(ln_1->forward(x));
    return x + mlp->forward(ln_2->forward(x));
  }
  torch::nn::LayerNorm ln_1;
  Gpt2Attention attn;
  torch::nn::LayerNorm ln_2;
  Gpt2Mlp mlp;
};
TORCH_MODULE(Gpt2Block);

struct Gpt2BodyImpl : torch::nn::Module {
  explicit Gpt2BodyImpl(const HfShape& s)
      : embd_pdrop(s.embd_pdrop),
        wte(register_module("wte", torch::nn::Embedding(s.vocab, s.width))),
        wpe(register_module("wpe", torch::nn::Embedding(s.positions, s.width))),
        h(register_module("h", torch::nn::ModuleList())),
        ln_f(register_module("ln_f", layer_norm(s.width, s.eps))) {
    for (int64_t i = 0; i < s.layers; ++i) h->push_back(Gpt2Block(s));
  }
  torch::Tensor forward(const torch::Tensor& idx) {
    auto pos = torch::arange(idx.size(1), torch::TensorOptions().dtype(torch::kLong).device(idx.device()));
    auto x = drop(wte->forward(idx) + wpe->forward(pos), embd_pdrop, is_training());
    for (size_t i = 0; i < h->size(); ++i) {
      const auto in = blocks ? blocks->block_enter(i, x) : x;
      const auto out = h[i]->as<Gpt2Block>()->forward(in);
      x = blocks ? blocks->block_leave(i, out) : out;
    }
    return ln_f->forward(x);
  }
  double embd_pdrop;
  torch::nn::Embedding wte, wpe;
  torch::nn::ModuleList h;
  torch::nn::LayerNorm ln_f;
  BlockStructure* blocks = nullptr;  // the model's, for dist.zero = 3
};
TORCH_MODULE(Gpt2Body);

struct Gpt2Impl : torch::nn::Module, BlockStructure {
  explicit Gpt2Impl(const HfShape& s)
      : positions(s.positions), transformer(register_module("transformer", Gpt2Body(s))) {
    transformer->blocks = this;
    for (int64_t i = 0; i < s.layers; ++i) block_prefixes.push_back("transformer.h." + std::to_string(i) + ".");
    if (!s.tied)
      lm_head = register_module("lm_head", torch::nn::Linear(torch::nn::LinearOptions(s.width, s.vocab).bias(false)));
    // transformers' GPT-2 initialisation: N(0, 0.02), zero biases, unit LayerNorms, the residual
    // projections (c_proj) scaled by 1/sqrt(2 x layers).
    torch::NoGradGuard ng;
    for (auto& p : named_parameters()) {
      const auto& name = p.key();
      auto& t = p.value();
      const bool norm = name.find("ln_") != std::string::npos;
      if (name.size() >= 4 && name.compare(name.size() - 4, 4, "bias") == 0)
        t.zero_();
      else if (norm)
        t.fill_(1.0);
      else if (name.find("c_proj.weight") != std::string::npos)
        t.normal_(0.0, 0.02 / std::sqrt(2.0 * static_cast<double>(s.layers)));
      else
        t.normal_(0.0, 0.02);
    }
  }
  // idx: (B, T) int64 -> logits (B, T, vocab)
  torch::Tensor forward(const torch::Tensor& idx) {
    TORCH_CHECK(idx.dim() == 2 && idx.size(1) <= positions, "gpt2 expects tokens (B, T<=", positions, "), got ",
                idx.sizes());
    auto x = transformer->forward(idx);
    return lm_head ? lm_head->forward(x) : torch::matmul(x, transformer->wte->weight.t());
  }
  int64_t positions;
  Gpt2Body transformer;
  torch::nn::Linear lm_head{nullptr};
};
TORCH_MODULE(Gpt2);

}  // namespace

std::shared_ptr<Model> make_gpt2(const ModelConfig& cfg) {
  const HfShape s = hf_shape(cfg);
  Gpt2 model(s);
  std::vector<std::string> lookups = {"transformer.wpe.weight"};
  if (!s.tied) lookups.push_back("transformer.wte.weight");
  return std::make_shared<ModuleModel<Gpt2>>("gpt2", model, InputSpec{InputKind::Tokens, {cfg.context}, s.vocab},
                                             hf_train_flops(*model, s, cfg.context, lookups));
}

}  // namespace keel::models
