// gpt2: transformers' GPT2LMHeadModel in C++, same tensor names and layouts
// (transformer.wte, transformer.wpe, transformer.h.N.{ln_1, attn.c_attn, attn.c_proj, ln_2,
// mlp.c_fc, mlp.c_proj}, transformer.ln_f; lm_head only when untied). Its linear layers are
// GPT-2's Conv1D: weight (in, out), y = x W + b. Pre-LayerNorm blocks (models/transformer.h),
// causal attention scaled by 1/sqrt(head width), GELU with tanh (gelu_new) or erf, learned
// positions; dropout while training where transformers has it (embd_pdrop after the embeddings,
// attn_pdrop on the attention weights, resid_pdrop after each residual branch's projection).
#include "models/deferred_init.h"
#include "models/hf.h"
#include "models/transformer.h"

namespace keel::models {
namespace {

BlockOptions gpt2_block(const HfShape& s) {
  BlockOptions o;
  o.width = s.width;
  o.heads = o.kv_heads = s.heads;
  o.head_dim = s.width / s.heads;
  o.ffn = s.ffn;
  o.eps = s.eps;
  o.dense = BlockOptions::Dense::Conv1D;
  o.mlp = s.tanh_gelu ? BlockOptions::Mlp::GeluTanh : BlockOptions::Mlp::Gelu;
  o.attn_pdrop = s.attn_pdrop;
  o.resid_pdrop = s.resid_pdrop;
  return o;  // names: ln_1, attn.c_attn, attn.c_proj, ln_2, mlp.c_fc, mlp.c_proj (the defaults)
}

torch::nn::LayerNorm layer_norm(int64_t d, double eps) {
  return torch::nn::LayerNorm(torch::nn::LayerNormOptions({d}).eps(eps));
}

struct Gpt2BodyImpl : torch::nn::Module {
  explicit Gpt2BodyImpl(const HfShape& s)
      : embd_pdrop(s.embd_pdrop),
        wte(register_module("wte", torch::nn::Embedding(s.vocab, s.width))),
        wpe(register_module("wpe", torch::nn::Embedding(s.positions, s.width))),
        h(register_module("h", torch::nn::ModuleList())),
        ln_f(register_module("ln_f", layer_norm(s.width, s.eps))) {
    defer_parameters(*this);  // sharded initialisation (models/deferred_init.h); else nothing
    for (int64_t i = 0; i < s.layers; ++i) {
      TransformerBlock block(gpt2_block(s));
      defer_parameters(*block);
      h->push_back(block);
    }
  }
  // The root's two parts around the blocks (Gpt2Impl::forward runs the blocks between them):
  // token ids -> the first block's input; the last block's output -> the head's input.
  torch::Tensor embed(const torch::Tensor& idx) {
    const auto tokens = tp_vocab ? tp_vocab.embed(idx, wte->weight, -1) : wte->forward(idx);
    const auto pos = tp_vocab.positions(idx.size(1), idx.device());
    return tp_vocab.drop(tokens + wpe->forward(pos), embd_pdrop, is_training());
  }
  torch::Tensor final_norm(const torch::Tensor& x) {
    const auto y = ln_f->forward(x);
    return tp_vocab ? tp_vocab.enter_head(y) : y;
  }
  double embd_pdrop;
  TpVocab tp_vocab;  // tensor parallel: wte (and lm_head) hold this rank's vocabulary rows
  torch::nn::Embedding wte, wpe;
  torch::nn::ModuleList h;
  torch::nn::LayerNorm ln_f;
};
TORCH_MODULE(Gpt2Body);

struct Gpt2Impl : torch::nn::Module, BlockStructure {
  explicit Gpt2Impl(const HfShape& s)
      : positions(s.positions), transformer(register_module("transformer", Gpt2Body(s))) {
    for (int64_t i = 0; i < s.layers; ++i)
      block_prefixes.push_back(gpt2_family().block_prefix + std::to_string(i) + ".");
    if (!s.tied)
      lm_head = register_module("lm_head", torch::nn::Linear(torch::nn::LinearOptions(s.width, s.vocab).bias(false)));
    defer_parameters(*this);
    init_gpt2_style(*this, s.layers);  // transformers' GPT-2 initialisation
  }
  // idx: (B, T) int64 -> logits (B, T, vocab)
  torch::Tensor forward(const torch::Tensor& idx) {
    TORCH_CHECK((idx.dim() == 2 || !takes_tokens()) && idx.size(1) <= positions,
                "gpt2 expects tokens (B, T<=", positions, "), got ", idx.sizes());
    auto x = root_call(RootPart::Embed, idx, [&](const torch::Tensor& ids) { return transformer->embed(ids); });
    x = run_blocks(transformer->h, this, x);
    return root_call(RootPart::Head, x, [&](const torch::Tensor& last) {
      const auto y = transformer->final_norm(last);
      return lm_head ? lm_head->forward(y) : torch::matmul(y, transformer->wte->weight.t());
    });
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

namespace {

// Tensor parallelism: each block by the plan, the token embedding and an untied lm_head by
// vocabulary rows; the position embedding and the final norm replicated.
void shard_gpt2(Model& model, const TensorParallelParts& parts) {
  auto& m = dynamic_cast<ModuleModel<Gpt2>&>(model).module();
  shard_blocks_and_vocabulary(*m, m->transformer->h, gpt2_family().tp_plan, parts);
  m->transformer->tp_vocab = parts.vocab;
}

}  // namespace

const TransformerFamily& gpt2_family() {
  HfShape s;  // the names only: any shape
  s.width = s.heads = 1;
  static const TransformerFamily f{"gpt2", make_gpt2, "transformer.h.",
                                   tensor_parallel_plan(gpt2_block(s), {"transformer.wte.weight", "lm_head.weight"}),
                                   shard_gpt2};
  return f;
}

}  // namespace keel::models
