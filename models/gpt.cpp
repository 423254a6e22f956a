// gpt: a byte-level GPT (nanoGPT layout and parameter names). Defaults: vocab 256, context 128,
// 4 blocks, 4 heads, width 256. Pre-LayerNorm blocks (models/transformer.h) with one fused qkv
// Linear (c_attn), causal attention, a GELU MLP of 4x width, a final LayerNorm, a learned position
// embedding, and the output projection tied to the token embedding (wte). model.dropout while
// training, where nanoGPT has it: after the embeddings, on the attention weights, after each
// residual branch.
#include <algorithm>

#include "models/deferred_init.h"
#include "models/transformer.h"

namespace keel::models {
namespace {

BlockOptions gpt_block(int64_t d, int64_t heads, double dropout) {
  BlockOptions o;
  o.width = d;
  o.heads = o.kv_heads = heads;
  o.head_dim = d / heads;
  o.ffn = 4 * d;
  o.attn_pdrop = o.resid_pdrop = dropout;
  return o;  // LayerNorm, Linear, GELU (erf), fused c_attn, biases: the defaults are nanoGPT's
}

struct GptImpl : torch::nn::Module, BlockStructure {
  GptImpl(int64_t vocab, int64_t context, int64_t layers, int64_t heads, int64_t d, double dropout)
      : context(context),
        dropout(dropout),
        wte(register_module("wte", torch::nn::Embedding(vocab, d))),
        wpe(register_module("wpe", torch::nn::Embedding(context, d))),
        h(register_module("h", torch::nn::ModuleList())),
        ln_f(register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})))) {
    defer_parameters(*this);  // sharded initialisation (models/deferred_init.h); else nothing
    for (int64_t i = 0; i < layers; ++i) {
      TransformerBlock block(gpt_block(d, heads, dropout));
      defer_parameters(*block);
      h->push_back(block);
      block_prefixes.push_back(gpt_family().block_prefix + std::to_string(i) + ".");
    }
    init_gpt2_style(*this, layers);
  }
  // idx: (B, T) int64 -> logits (B, T, vocab)
  torch::Tensor forward(const torch::Tensor& idx) {
    TORCH_CHECK((idx.dim() == 2 || !takes_tokens()) && idx.size(1) <= context, "gpt expects tokens (B, T<=", context,
                "), got ", idx.sizes());
    const int64_t T = idx.size(1);
    auto x = root_call(RootPart::Embed, idx, [&](const torch::Tensor& ids) {
      const auto tokens = tp_vocab ? tp_vocab.embed(ids, wte->weight, -1) : wte->forward(ids);
      return tp_vocab.drop(tokens + wpe->forward(tp_vocab.positions(T, ids.device())), dropout,
                           is_training());  // (B, T, C)
    });
    x = run_blocks(h, this, x);
    return root_call(RootPart::Head, x, [&](const torch::Tensor& last) {
      auto y = ln_f->forward(last);
      if (tp_vocab) y = tp_vocab.enter_head(y);
      return torch::matmul(y, wte->weight.t());  // tied output projection (tp: this rank's vocabulary)
    });
  }
  int64_t context;
  double dropout;
  TpVocab tp_vocab;  // tensor parallel: wte holds this rank's vocabulary rows
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

namespace {

// Tensor parallelism: each block by the plan, the token embedding (tied to the output
// projection) by vocabulary rows; the position embedding and the final norm replicated.
void shard_gpt(Model& model, const TensorParallelParts& parts) {
  auto& m = dynamic_cast<ModuleModel<Gpt>&>(model).module();
  shard_blocks_and_vocabulary(*m, m->h, gpt_family().tp_plan, parts);
  m->tp_vocab = parts.vocab;
}

}  // namespace

const TransformerFamily& gpt_family() {
  static const TransformerFamily f{"gpt", make_gpt, "h.", tensor_parallel_plan(gpt_block(256, 4, 0), {"wte.weight"}),
                                   shard_gpt};
  return f;
}

}  // namespace keel::models
