#include "models/transformer.h"

#include <cmath>
#include <limits>
#include <mutex>
#include <utility>

#include "models/deferred_init.h"

namespace keel::models {

torch::Tensor drop(const torch::Tensor& x, double p, bool training) {
  return p > 0 && training ? torch::dropout(x, p, true) : x;
}

namespace {
uint64_t splitmix64(uint64_t z) {
  z += 0x9E3779B97F4A7C15ULL;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}
}  // namespace

torch::Tensor with_own_masks(int64_t rank, const torch::Device& device, const std::function<torch::Tensor()>& f) {
  const auto drawn = static_cast<uint64_t>(
      torch::randint(std::numeric_limits<int64_t>::max(), {1}, torch::TensorOptions().dtype(torch::kLong))
          .item<int64_t>());
  at::Generator gen = at::globalContext().defaultGenerator(device);
  torch::Tensor saved;
  {
    std::lock_guard<std::mutex> lock(gen.mutex());
    saved = gen.get_state();
    gen.set_current_seed(splitmix64(drawn ^ splitmix64(static_cast<uint64_t>(rank) + 1)));
  }
  struct Restore {
    at::Generator& gen;
    const torch::Tensor& state;
    ~Restore() {
      std::lock_guard<std::mutex> lock(gen.mutex());
      gen.set_state(state);
    }
  } restore{gen, saved};
  return f();
}

torch::Tensor drop_own(const torch::Tensor& x, double p, bool training, int64_t rank) {
  if (p <= 0 || !training) return x;
  return with_own_masks(rank, x.device(), [&] { return torch::dropout(x, p, true); });
}

torch::Tensor dense_product(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias,
                            bool conv1d) {
  // torch::nn::Linear's forward: LibTorch's functional linear (a matmul by the transposed weight,
  // then the bias added in place; addmm for a 2-D input). Autocast casts the transposed view, which
  // it does not cache (ATen's linear would keep a bf16 copy of every weight until autocast ends).
  if (!conv1d) return torch::nn::functional::linear(x, weight, bias);
  if (!bias.defined()) return x.matmul(weight);
  auto shape = x.sizes().vec();
  shape.back() = weight.size(1);
  return torch::addmm(bias, x.reshape({-1, x.size(-1)}), weight).view(shape);
}

namespace {
thread_local DenseTape* current_tape = nullptr;
}  // namespace

DenseTape* DenseTape::current() { return current_tape; }
DenseTape::Use::Use(DenseTape* tape) : before_(current_tape) { current_tape = tape; }
DenseTape::Use::~Use() { current_tape = before_; }

RmsNormImpl::RmsNormImpl(int64_t d, double eps) : eps(eps), weight(register_parameter("weight", torch::ones({d}))) {}

torch::Tensor RmsNormImpl::forward(const torch::Tensor& x) {
  auto h = x.to(torch::kFloat);
  h = h * torch::rsqrt(h.pow(2).mean(-1, /*keepdim=*/true) + eps);
  return weight * h.to(x.scalar_type());
}

Conv1DImpl::Conv1DImpl(int64_t in, int64_t out)
    : weight(register_parameter("weight", torch::empty({in, out}))),
      bias(register_parameter("bias", torch::zeros({out}))) {}

// As transformers' Conv1D: addmm over the flattened leading dimensions.
torch::Tensor Conv1DImpl::forward(const torch::Tensor& x) { return dense_product(x, weight, bias, /*conv1d=*/true); }

namespace {

// (x1, x2) -> (-x2, x1) over the two halves of the last dimension.
torch::Tensor rotate_half(const torch::Tensor& x) {
  auto halves = x.chunk(2, -1);
  return torch::cat({-halves[1], halves[0]}, -1);
}

// A dense layer of the family's layout. torch::nn::Linear draws its default initialisation from
// the generator as it is built (the family overwrites it, but the draws happen): the order in
// which a block builds its layers is what keeps a family's initialisation bit for bit.
torch::nn::AnyModule dense(const BlockOptions& o, int64_t in, int64_t out, bool bias) {
  if (o.dense == BlockOptions::Dense::Conv1D) return torch::nn::AnyModule(Conv1D(in, out));
  return torch::nn::AnyModule(torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(bias)));
}

torch::nn::AnyModule norm(const BlockOptions& o) {
  if (o.norm == BlockOptions::Norm::Rms) return torch::nn::AnyModule(RmsNorm(o.width, o.eps));
  return torch::nn::AnyModule(torch::nn::LayerNorm(torch::nn::LayerNormOptions({o.width}).eps(o.eps)));
}

// A child module that registers under `name` in `parent` and keeps its holder for forward.
torch::nn::AnyModule child(torch::nn::Module& parent, const std::string& name, torch::nn::AnyModule m) {
  parent.register_module(name, m.ptr());
  return m;
}

// The attention and MLP parts live in sub-modules named by the family ("attn" / "self_attn", "mlp")
// so that parameter names read <attn>.<proj>.weight; the block calls them directly.
struct Part : torch::nn::Module {};

}  // namespace

TransformerBlockImpl::TransformerBlockImpl(const BlockOptions& options) : o(options) {
  const auto& n = o.names;
  auto attn = std::make_shared<Part>();
  auto mlp = std::make_shared<Part>();
  if (!n.norms_last) norm_1 = child(*this, n.norm_1, norm(o));
  register_module(n.attn, attn);
  if (o.fused_qkv) {
    qkv = child(*attn, n.qkv, dense(o, o.width, 3 * o.heads * o.head_dim, o.attention_bias));
  } else {
    q = child(*attn, n.q, dense(o, o.width, o.heads * o.head_dim, o.attention_bias));
    k = child(*attn, n.k, dense(o, o.width, o.kv_heads * o.head_dim, o.attention_bias));
    v = child(*attn, n.v, dense(o, o.width, o.kv_heads * o.head_dim, o.attention_bias));
  }
  out = child(*attn, n.out, dense(o, o.heads * o.head_dim, o.width, o.attention_bias));
  if (!n.norms_last) norm_2 = child(*this, n.norm_2, norm(o));
  register_module(n.mlp, mlp);
  if (o.mlp == BlockOptions::Mlp::SwiGlu) {
    gate = child(*mlp, n.gate, dense(o, o.width, o.ffn, o.mlp_bias));
    up = child(*mlp, n.up, dense(o, o.width, o.ffn, o.mlp_bias));
  } else {
    fc = child(*mlp, n.fc, dense(o, o.width, o.ffn, o.mlp_bias));
  }
  down = child(*mlp, n.down, dense(o, o.ffn, o.width, o.mlp_bias));
  if (n.norms_last) {
    norm_1 = child(*this, n.norm_1, norm(o));
    norm_2 = child(*this, n.norm_2, norm(o));
  }
}

torch::Tensor TransformerBlockImpl::forward(torch::Tensor x, const torch::Tensor& cos, const torch::Tensor& sin,
                                            const RegionCall& regions) {
  x = x + attention(norm_1.forward(x), cos, sin, regions);
  return x + mlp_forward(norm_2.forward(x), regions);
}

torch::Tensor TransformerBlockImpl::attention(const torch::Tensor& x_in, const torch::Tensor& cos,
                                              const torch::Tensor& sin, const RegionCall& regions) {
  if (tp.size == 1) return residual_drop(attention_core(x_in, cos, sin, /*with_bias=*/true));
  const torch::Tensor x = tp.enter(x_in);
  const torch::Tensor partial = regions.partial(
      BlockStructure::Region::Attention,
      [this, cos, sin](const torch::Tensor& t) { return attention_core(t, cos, sin, /*with_bias=*/false); }, x, cos,
      sin);
  return residual_drop(reduce_row_parallel(out, partial));
}

torch::Tensor TransformerBlockImpl::attention_core(const torch::Tensor& x, const torch::Tensor& cos,
                                                   const torch::Tensor& sin, bool with_bias) {
  // This rank's heads: all of them, or 1/tp under tensor parallelism.
  const int64_t B = x.size(0), T = x.size(1), H = o.heads / tp.size, KV = o.kv_heads / tp.size, hd = o.head_dim;
  torch::Tensor qt, kt, vt;  // (B, T, H x hd), (B, T, KV x hd) twice
  if (o.fused_qkv) {
    auto parts = project(qkv, x).split(H * hd, /*dim=*/2);
    qt = parts[0], kt = parts[1], vt = parts[2];
  } else {
    qt = project(q, x), kt = project(k, x), vt = project(v, x);
  }
  auto qh = qt.view({B, T, H, hd}).transpose(1, 2);   // (B, H, T, hd)
  auto kh = kt.view({B, T, KV, hd}).transpose(1, 2);  // (B, KV, T, hd)
  auto vh = vt.view({B, T, KV, hd}).transpose(1, 2);
  if (o.rotary) {
    qh = qh * cos + rotate_half(qh) * sin;
    kh = kh * cos + rotate_half(kh) * sin;
  }
  if (KV != H) {
    kh = kh.repeat_interleave(H / KV, 1);
    vh = vh.repeat_interleave(H / KV, 1);
  }
  // Fused causal attention (flash or cuDNN kernels on the GPU, a flash kernel on the CPU), scale
  // 1/sqrt(hd): equal to the explicit masked softmax within float32 rounding (tests/test_models.cpp
  // checks it against PyTorch's masked softmax).
  const double p = is_training() ? o.attn_pdrop : 0.0;
  auto attend = [&] {
    return at::scaled_dot_product_attention(qh, kh, vh, /*attn_mask=*/{}, /*dropout_p=*/p, /*is_causal=*/true);
  };
  // Under tp the heads are this rank's: masks of its own.
  auto y = (p > 0 && tp.size > 1 ? with_own_masks(tp.rank, qh.device(), attend) : attend())
               .transpose(1, 2)
               .reshape({B, T, H * hd});
  return project(out, y, with_bias);
}

torch::Tensor TransformerBlockImpl::residual_drop(const torch::Tensor& x) const {
  return tp.own_positions ? drop_own(x, o.resid_pdrop, is_training(), tp.rank) : drop(x, o.resid_pdrop, is_training());
}

namespace {
// A dense layer's weight and bias (undefined without one): the module's own members, which every
// placement updates in place (set_data), read without building its parameter dictionary.
std::pair<torch::Tensor, torch::Tensor> dense_parameters(const torch::nn::AnyModule& dense, bool conv1d) {
  if (conv1d) {
    const auto* c = dense.ptr()->as<Conv1D>();
    return {c->weight, c->bias};
  }
  const auto* l = dense.ptr()->as<torch::nn::Linear>();
  return {l->weight, l->bias};
}
}  // namespace

torch::Tensor TransformerBlockImpl::row_parallel(const torch::nn::AnyModule& dense, const torch::Tensor& x) const {
  return reduce_row_parallel(dense, project(dense, x, /*with_bias=*/false));
}

torch::Tensor TransformerBlockImpl::reduce_row_parallel(const torch::nn::AnyModule& dense,
                                                        const torch::Tensor& partial) const {
  torch::Tensor y = tp.leave(partial);
  if (const torch::Tensor b = dense_parameters(dense, o.dense == BlockOptions::Dense::Conv1D).second; b.defined())
    y = y + b;
  return y;
}

torch::Tensor TransformerBlockImpl::project(const torch::nn::AnyModule& dense, const torch::Tensor& x,
                                            bool with_bias) const {
  const bool conv1d = o.dense == BlockOptions::Dense::Conv1D;
  const auto [weight, b] = dense_parameters(dense, conv1d);
  const torch::Tensor bias = with_bias ? b : torch::Tensor();
  DenseTape* tape = DenseTape::current();
  return tape ? tape->project(x, weight, bias, conv1d) : dense_product(x, weight, bias, conv1d);
}

torch::Tensor TransformerBlockImpl::mlp_forward(const torch::Tensor& x_in, const RegionCall& regions) {
  if (tp.size == 1) return residual_drop(mlp_core(x_in, /*with_bias=*/true));
  const torch::Tensor x = tp.enter(x_in);
  const torch::Tensor partial = regions.partial(
      BlockStructure::Region::Mlp, [this](const torch::Tensor& t) { return mlp_core(t, /*with_bias=*/false); }, x);
  return residual_drop(reduce_row_parallel(down, partial));
}

torch::Tensor TransformerBlockImpl::mlp_core(const torch::Tensor& x, bool with_bias) {
  torch::Tensor h;
  switch (o.mlp) {
    case BlockOptions::Mlp::SwiGlu:
      h = torch::silu(project(gate, x)) * project(up, x);
      break;
    case BlockOptions::Mlp::GeluTanh:
      h = torch::gelu(project(fc, x), "tanh");
      break;
    case BlockOptions::Mlp::Gelu:
      h = torch::gelu(project(fc, x), "none");
      break;
  }
  return project(down, h, with_bias);
}

torch::Tensor run_blocks(torch::nn::ModuleList& blocks, BlockStructure* structure, torch::Tensor x,
                         const torch::Tensor& cos, const torch::Tensor& sin) {
  for (size_t i = 0; i < blocks->size(); ++i) {
    if (structure && !structure->on_stage(i)) continue;  // another pipeline stage's block
    const auto in = structure ? structure->block_enter(i, x) : x;
    TransformerBlockImpl* block = blocks[i]->as<TransformerBlock>();
    const RegionCall regions{structure ? &structure->region_compiled : nullptr, i,
                             structure ? &structure->region_runner : nullptr};
    const auto out =
        structure
            ? structure->block_call(
                  i,
                  [block, cos, sin, regions](const torch::Tensor& t) { return block->forward(t, cos, sin, regions); },
                  in, cos, sin)
            : block->forward(in, cos, sin);
    x = structure ? structure->block_leave(i, out) : out;
  }
  return x;
}

torch::Tensor rotary_angles(int64_t T, int64_t head_dim, double theta, const torch::Device& device) {
  const auto f32 = torch::TensorOptions().dtype(torch::kFloat).device(device);
  auto inv_freq = 1.0 / torch::pow(theta, torch::arange(0, head_dim, 2, torch::TensorOptions().dtype(torch::kLong))
                                              .to(torch::kFloat)
                                              .div(static_cast<double>(head_dim)));
  auto freqs = torch::outer(torch::arange(T, f32), inv_freq.to(device));
  return torch::cat({freqs, freqs}, -1);
}

std::vector<TpRule> tensor_parallel_plan(const BlockOptions& o, const std::vector<std::string>& vocab_parameters) {
  const auto& n = o.names;
  const bool conv1d = o.dense == BlockOptions::Dense::Conv1D;  // weight (in, out), else (out, in)
  const int64_t out_dim = conv1d ? 1 : 0, in_dim = conv1d ? 0 : 1;
  std::vector<TpRule> plan;
  auto column = [&](const std::string& part, const std::string& proj, int64_t blocks) {
    plan.push_back({part + "." + proj + ".weight", TpSplit::Column, out_dim, blocks});
    plan.push_back({part + "." + proj + ".bias", TpSplit::Column, 0, blocks});
  };
  if (o.fused_qkv) {
    column(n.attn, n.qkv, 3);  // q, k and v each split by heads
  } else {
    for (const auto* p : {&n.q, &n.k, &n.v}) column(n.attn, *p, 1);
  }
  plan.push_back({n.attn + "." + n.out + ".weight", TpSplit::Row, in_dim});
  if (o.mlp == BlockOptions::Mlp::SwiGlu) {
    column(n.mlp, n.gate, 1);
    column(n.mlp, n.up, 1);
  } else {
    column(n.mlp, n.fc, 1);
  }
  plan.push_back({n.mlp + "." + n.down + ".weight", TpSplit::Row, in_dim});
  for (const auto& v : vocab_parameters) plan.push_back({v, TpSplit::Vocab, 0});
  return plan;
}

const TransformerFamily* transformer_family(const std::string& model_name) {
  for (const TransformerFamily* f : {&gpt_family(), &gpt2_family(), &llama_family()})
    if (f->name == model_name) return f;
  return nullptr;
}

bool tp_matches(const std::string& name, const TpRule& rule) {
  return name.size() >= rule.suffix.size() &&
         name.compare(name.size() - rule.suffix.size(), rule.suffix.size(), rule.suffix) == 0;
}

const TpRule* tp_rule(const std::vector<TpRule>& plan, const std::string& name) {
  for (const auto& rule : plan)
    if (tp_matches(name, rule)) return &rule;
  return nullptr;
}

torch::Tensor tp_slice(const torch::Tensor& whole, const TpRule& rule, int64_t rank, int64_t size) {
  if (rule.split == TpSplit::Replicate || size == 1) return whole.clone();
  const int64_t extent = whole.size(rule.dim);
  if (extent % (rule.blocks * size) != 0)
    throw std::invalid_argument("tensor parallel: " + rule.suffix + "'s dimension " + std::to_string(rule.dim) +
                                " of " + std::to_string(extent) + " does not split into " +
                                std::to_string(rule.blocks) + " x " + std::to_string(size) + " equal parts");
  const int64_t block = extent / rule.blocks, part = block / size;
  std::vector<torch::Tensor> parts;
  for (int64_t b = 0; b < rule.blocks; ++b) parts.push_back(whole.narrow(rule.dim, b * block + rank * part, part));
  return torch::cat(parts, rule.dim).contiguous();
}

torch::Tensor TpVocab::drop(const torch::Tensor& x, double p, bool training) const {
  return sequence_parts > 1 ? drop_own(x, p, training, sequence_index) : models::drop(x, p, training);
}

torch::Tensor TpVocab::positions(int64_t T, const torch::Device& device) const {
  const auto opts = torch::TensorOptions().dtype(torch::kLong).device(device);
  if (sequence_parts == 1) return torch::arange(T, opts);
  const int64_t part = T / sequence_parts;
  return torch::arange(sequence_index * part, (sequence_index + 1) * part, opts);
}

void shard_blocks_and_vocabulary(torch::nn::Module& root, torch::nn::ModuleList& blocks,
                                 const std::vector<TpRule>& plan, const TensorParallelParts& parts) {
  for (auto& block : *blocks) parts.block(*block->as<TransformerBlockImpl>());
  for (auto& p : root.named_parameters())
    if (const TpRule* rule = tp_rule(plan, p.key()); rule && rule->split == TpSplit::Vocab)
      keep_tp_slice(p.value(), *rule, parts.rank, parts.size, parts.deferred);
}

void keep_tp_slice(const torch::Tensor& p, const TpRule& rule, int64_t rank, int64_t size, DeferredInit* deferred) {
  if (deferred && deferred->deferred(p))
    return deferred->keep_part(p, [rule, rank, size](const torch::Tensor& t) { return tp_slice(t, rule, rank, size); });
  torch::NoGradGuard no_grad;
  p.set_data(tp_slice(p.detach(), rule, rank, size));
}

void init_gpt2_style(torch::nn::Module& model, int64_t layers) {
  for (auto& p : model.named_parameters()) {
    const auto& name = p.key();
    const auto& t = p.value();
    if (name.size() >= 4 && name.compare(name.size() - 4, 4, "bias") == 0)
      init_fill_(t, 0.0);
    else if (name.find("ln_") != std::string::npos)
      init_fill_(t, 1.0);
    else if (name.find("c_proj.weight") != std::string::npos)
      init_normal_(t, 0.0, 0.02 / std::sqrt(2.0 * static_cast<double>(layers)));
    else
      init_normal_(t, 0.0, 0.02);
  }
}

}  // namespace keel::models
