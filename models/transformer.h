// models/transformer.h: the one decoder block of keel's transformer families (gpt, gpt2,
// llama), and the parts they share around it (norms, GPT-2's Conv1D, rotary angles, dropout,
// the block loop that reports to dist.zero = 3, GPT-2's initialisation).
//
// Owns: TransformerBlock, configured by BlockOptions (norm, positional encoding, MLP kind, key/value
// heads, biases, the dense layer's layout, dropout) and BlockNames (each family's parameter names,
// so that its checkpoints and Hugging Face files keep their layout bit for bit); the family spec
// (TransformerFamily: factory, block prefix, tensor-parallel plan) that each family file defines
// in one place. Does not own: embeddings, the output head, a family's top-level names (the family
// files), the tensor-parallel layers themselves (dist/, issue 45).
//
// Construction order is part of the contract: a block builds its attention before its MLP and
// each projection in the order given by its family, so that the random initialisation draws the
// same numbers in the same order as the family always has.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "keel/models/model.h"

namespace keel::models {

class DeferredInit;  // models/deferred_init.h

/// Dropout while training; nothing at all (no op, no random numbers) when p = 0 or evaluating.
torch::Tensor drop(const torch::Tensor& x, double p, bool training);

/// Runs `f`, which draws from the default generator of `device` (dropout; attention with
/// dropout), with masks of tensor-parallel rank `rank`'s own, for a part of a tensor that only
/// this rank holds (its attention heads; with sequence parallelism its positions): Megatron's
/// model-parallel RNG, without a second state to keep. A seed is drawn from the CPU's default
/// generator (every rank of a tp group draws alike, so the stream they share for replicated
/// tensors stays in step, and a recomputation or a resume that restores the generators draws
/// the same) and mixed with `rank`; the device's default generator runs from it for `f` and is
/// restored after, also when `f` throws.
torch::Tensor with_own_masks(int64_t rank, const torch::Device& device, const std::function<torch::Tensor()>& f);
/// drop() of a part of a tensor that only tp rank `rank` holds: with_own_masks.
torch::Tensor drop_own(const torch::Tensor& x, double p, bool training, int64_t rank);

/// A dense layer's product: x W^T + b (torch::nn::Linear's forward, weight (out, in)) or, when
/// `conv1d`, x W + b (GPT-2's Conv1D, weight (in, out), addmm over the flattened leading
/// dimensions; without a bias, a matmul); `bias` may be undefined.
torch::Tensor dense_product(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias,
                            bool conv1d);

/// Selective activation checkpointing's seam (train.activation_checkpointing = "selective",
/// dist/recompute.cpp): while a tape is in use on this thread, a block's dense projections run
/// through it instead of dense_product(), so that it can keep their outputs in the forward and
/// hand them back, in the same order, when the block is recomputed in backward.
class DenseTape {
 public:
  virtual ~DenseTape() = default;
  /// dense_product(x, weight, bias, conv1d), or what stands for it.
  virtual torch::Tensor project(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias,
                                bool conv1d) = 0;
  /// The tape in use on this thread, or null.
  static DenseTape* current();

  /// Puts `tape` in use on this thread for its lifetime (the one before it after).
  class Use {
   public:
    explicit Use(DenseTape* tape);
    ~Use();
    Use(const Use&) = delete;
    Use& operator=(const Use&) = delete;

   private:
    DenseTape* before_;
  };
};

/// Root-mean-square norm in float32 (transformers' LlamaRMSNorm): weight * x / rms(x).
struct RmsNormImpl : torch::nn::Module {
  RmsNormImpl(int64_t d, double eps);
  torch::Tensor forward(const torch::Tensor& x);  // (..., d) -> (..., d), in x's dtype
  double eps;
  torch::Tensor weight;  // (d)
};
TORCH_MODULE(RmsNorm);

/// transformers' GPT-2 Conv1D: weight (in, out), y = x W + b; uninitialised weight, zero bias (the
/// family initialises it).
struct Conv1DImpl : torch::nn::Module {
  Conv1DImpl(int64_t in, int64_t out);
  torch::Tensor forward(const torch::Tensor& x);  // (..., in) -> (..., out)
  torch::Tensor weight, bias;                     // (in, out), (out)
};
TORCH_MODULE(Conv1D);

/// Each family's parameter names inside a block (its checkpoint keys).
struct BlockNames {
  std::string norm_1 = "ln_1", attn = "attn", norm_2 = "ln_2", mlp = "mlp";
  std::string qkv = "c_attn";                            // fused projection (fused_qkv)
  std::string q = "q_proj", k = "k_proj", v = "v_proj";  // separate projections
  std::string out = "c_proj";                            // attention's output projection
  std::string fc = "c_fc";                               // GELU MLP's input projection
  std::string gate = "gate_proj", up = "up_proj";        // SwiGLU's input projections
  std::string down = "c_proj";                           // the MLP's output projection
  bool norms_last = false;  // register the two norms after attention and MLP (llama's order)
};

struct BlockOptions {
  int64_t width = 0;     // C, the residual stream
  int64_t heads = 0;     // query heads
  int64_t kv_heads = 0;  // key/value heads; heads / kv_heads query heads share one (grouped-query attention)
  int64_t head_dim = 0;  // per head; heads x head_dim need not be C (llama)
  int64_t ffn = 0;       // the MLP's inner width
  enum class Norm { Layer, Rms } norm = Norm::Layer;
  double eps = 1e-5;
  enum class Dense { Linear, Conv1D } dense = Dense::Linear;  // torch::nn::Linear, or GPT-2's Conv1D layout
  enum class Mlp { Gelu, GeluTanh, SwiGlu } mlp = Mlp::Gelu;
  bool fused_qkv = true;  // one projection to q, k and v (kv_heads = heads), else three
  bool rotary = false;    // rotary position embeddings on q and k (forward's cos, sin)
  bool attention_bias = true, mlp_bias = true;
  double attn_pdrop = 0;   // on the attention weights, while training
  double resid_pdrop = 0;  // after each residual branch's projection, while training
  BlockNames names;
};

/// Tensor parallelism as a block sees it (dist::shard_tensor_parallel sets it): this rank's
/// place in the tp group, and the two regions around each branch (dist/tp_ops.h): `enter` before
/// the column-parallel projections (identity, or the sequence shards gathered), `leave` after the
/// row-parallel one (the partial sums reduced, or reduce-scattered to sequence shards). size 1:
/// none, and the block computes exactly as without it.
struct TpRegion {
  int64_t rank = 0, size = 1;
  std::function<torch::Tensor(const torch::Tensor&)> enter, leave;
  /// Sequence parallelism: the block's input and output are this rank's positions only (their
  /// dropout masks its own: drop_own), else every tp rank holds them whole (masks shared).
  bool own_positions = false;
};

/// Where a block's tensor-parallel regions may run compiled: the model's
/// BlockStructure::region_compiled and the block's index (no function: eager).
struct RegionCall {
  const BlockStructure::RegionCompiled* compiled = nullptr;
  size_t index = 0;
  const BlockStructure::RegionRun* runner = nullptr;  // the model's BlockStructure::region_runner
  /// The region's partial product: from the package where it runs there, else `f(x)` (the eager
  /// region), through the model's region_runner when it has one.
  torch::Tensor partial(BlockStructure::Region r, const BlockStructure::BlockFunction& f, const torch::Tensor& x,
                        const torch::Tensor& cos = {}, const torch::Tensor& sin = {}) const {
    if (compiled && *compiled)
      if (torch::Tensor y = (*compiled)(index, r, x, cos, sin); y.defined()) return y;
    return runner && *runner ? (*runner)(index, r, f, x) : f(x);
  }
};

/// Pre-norm decoder block: x + attn(norm_1(x)), then + mlp(norm_2(x)); causal
/// scaled_dot_product_attention scaled by 1/sqrt(head_dim). Under tensor parallelism (tp) the
/// block holds heads / tp query heads, kv_heads / tp key/value heads and ffn / tp of the MLP,
/// and adds the row-parallel projections' biases once, after the reduction.
struct TransformerBlockImpl : torch::nn::Module {
  explicit TransformerBlockImpl(const BlockOptions& o);
  // x (B, T, C); cos, sin (T, head_dim) when o.rotary, else undefined -> (B, T, C)
  // `regions`: under tp, the attention's and the MLP's regions compiled where they fit.
  torch::Tensor forward(torch::Tensor x, const torch::Tensor& cos = {}, const torch::Tensor& sin = {},
                        const RegionCall& regions = {});

  torch::Tensor attention(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                          const RegionCall& regions = {});
  torch::Tensor mlp_forward(const torch::Tensor& x, const RegionCall& regions = {});
  /// The attention's computation on its input (after tp's enter): through the output projection,
  /// with its bias (`with_bias`) or, under tp, without it (the row-parallel partial product).
  torch::Tensor attention_core(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                               bool with_bias);
  /// The MLP's computation on its input (after tp's enter), likewise.
  torch::Tensor mlp_core(const torch::Tensor& x, bool with_bias);
  /// A row-parallel projection under tp: the partial product, `leave`, then the bias once.
  torch::Tensor row_parallel(const torch::nn::AnyModule& dense, const torch::Tensor& x) const;
  /// row_parallel's second half, from the partial product `partial` (a compiled region's).
  torch::Tensor reduce_row_parallel(const torch::nn::AnyModule& dense, const torch::Tensor& partial) const;
  /// x through a dense layer (with its bias, or without it for row_parallel's partial product):
  /// dense_product() (the layer's forward), or the DenseTape in use.
  torch::Tensor project(const torch::nn::AnyModule& dense, const torch::Tensor& x, bool with_bias = true) const;
  /// The dropout after a residual branch's projection (masks of this rank's own when
  /// tp.own_positions).
  torch::Tensor residual_drop(const torch::Tensor& x) const;

  BlockOptions o;
  TpRegion tp;
  torch::nn::AnyModule norm_1, norm_2;
  torch::nn::AnyModule qkv, q, k, v, out;   // qkv when fused, else q, k, v
  torch::nn::AnyModule fc, gate, up, down;  // fc for GELU, gate and up for SwiGLU
};
TORCH_MODULE(TransformerBlock);

/// Runs blocks[0..n) in order, each between the model's BlockStructure hooks (dist.zero = 3
/// gathers a block's parameters there) and through its block_call (a compiled block, or
/// block_run: activation checkpointing);
/// `structure` may be null.
torch::Tensor run_blocks(torch::nn::ModuleList& blocks, BlockStructure* structure, torch::Tensor x,
                         const torch::Tensor& cos = {}, const torch::Tensor& sin = {});

/// The rotary angles of positions 0..T-1 in float32, as transformers' LlamaRotaryEmbedding:
/// position x theta^(-2i / head_dim), each frequency twice (the two halves). (T, head_dim)
torch::Tensor rotary_angles(int64_t T, int64_t head_dim, double theta, const torch::Device& device);

/// GPT-2's initialisation (nanoGPT and transformers alike): biases zero, LayerNorms ("ln_") one,
/// residual projections ("c_proj.weight") N(0, 0.02 / sqrt(2 x layers)), the rest N(0, 0.02), in
/// parameter order.
void init_gpt2_style(torch::nn::Module& model, int64_t layers);

/// How one parameter is split over the tensor-parallel axis (issue 45): by output features
/// (column-parallel), by input features (row-parallel), by vocabulary rows, or replicated.
enum class TpSplit { Column, Row, Vocab, Replicate };
struct TpRule {
  std::string suffix;  // the end of a parameter name ("attn.c_attn.weight" matches every block's)
  TpSplit split;
  int64_t dim = 0;     // the tensor dimension split (a Linear's weight is (out, in), GPT-2's Conv1D's (in, out))
  int64_t blocks = 1;  // equal blocks along `dim`, each split on its own (3: a fused q, k, v projection)
};
/// Whether `name` ends with `rule.suffix`.
bool tp_matches(const std::string& name, const TpRule& rule);
/// The rule of `plan` that `name` matches (a plan has at most one per name), or null: replicated.
const TpRule* tp_rule(const std::vector<TpRule>& plan, const std::string& name);
/// Rank `rank`'s part of `whole` under `rule` over `size` ranks (a copy; Replicate: the whole).
/// Throws std::invalid_argument when the split dimension does not divide.
torch::Tensor tp_slice(const torch::Tensor& whole, const TpRule& rule, int64_t rank, int64_t size);
/// Parameter `p` keeps only tp_slice() of itself: now (set_data), or, when `deferred` holds it
/// (sharded initialisation, models/deferred_init.h), once its value is made.
void keep_tp_slice(const torch::Tensor& p, const TpRule& rule, int64_t rank, int64_t size, DeferredInit* deferred);

/// The vocabulary split as a family's model sees it (dist::shard_model_tensor_parallel sets it):
/// this rank's rows of the vocabulary, the lookup of token ids in them (each rank's rows summed
/// over the tp group: dist/tp_ops.h's vocab_parallel_embedding; `padding_idx` an id whose row
/// gets no gradient, or -1), and the region before the output projection (its input's gradient
/// summed over the group). The model's logits are then this rank's vocabulary columns. With
/// sequence parallelism (sequence_parts = tp) the lookup returns this rank's T / tp positions
/// (dim 1), what follows runs on them until enter_head gathers the whole sequence again, and a
/// position embedding looks up positions() only. Empty: no split, and the model computes exactly
/// as without it.
struct TpVocab {
  int64_t first = 0, n = 0;
  int64_t sequence_parts = 1, sequence_index = 0;
  std::function<torch::Tensor(const torch::Tensor& ids, const torch::Tensor& rows, int64_t padding_idx)> embed;
  std::function<torch::Tensor(const torch::Tensor&)> enter_head;
  explicit operator bool() const { return static_cast<bool>(embed); }
  /// The positions of this rank's tokens after `embed` in a sequence of T: 0..T-1, or with
  /// sequence parallelism its T / sequence_parts of them (int64, on `device`).
  torch::Tensor positions(int64_t T, const torch::Device& device) const;
  /// The embeddings' dropout: with sequence parallelism on this rank's positions, with masks of
  /// its own (drop_own), else drop().
  torch::Tensor drop(const torch::Tensor& x, double p, bool training) const;
};

/// What a family's shard function is given: its place in the tp group, how to shard one block
/// (dist::shard_block with the family's plan), and the vocabulary split.
struct TensorParallelParts {
  int64_t rank = 0, size = 1;
  DeferredInit* deferred = nullptr;  // sharded initialisation: the parameters not made yet, or null
  std::function<void(TransformerBlockImpl&)> block;
  TpVocab vocab;
};

/// A transformer family in one place: its factory, where its blocks are named, the plan by which
/// tensor parallelism shards it (data), and the function that applies it to a model the factory
/// built (null: the family cannot be sharded yet).
struct TransformerFamily {
  std::string name;                                                 // model.name
  std::shared_ptr<Model> (*factory)(const ModelConfig&) = nullptr;  // builds it
  std::string block_prefix;                                         // "h." -> blocks "h.0.", "h.1.", ...
  std::vector<TpRule> tp_plan;                                      // Megatron-style column / row pairs
  void (*shard)(Model& model, const TensorParallelParts& parts) = nullptr;
};

/// The part of a family's shard function that every family shares: each of `blocks` by
/// parts.block, then each parameter of `root` that `plan` splits by vocabulary (the embedding, an
/// untied output projection) cut to this rank's rows. The family then sets its TpVocab.
void shard_blocks_and_vocabulary(torch::nn::Module& root, torch::nn::ModuleList& blocks,
                                 const std::vector<TpRule>& plan, const TensorParallelParts& parts);

/// The family named `model_name`, or null.
const TransformerFamily* transformer_family(const std::string& model_name);

/// The plan of a block built from `o`, Megatron's pairing: the projections into attention and the
/// MLP (qkv or q, k, v; fc or gate, up) split by output, weight and bias (column); the projections
/// out of them (out, down) split by input (row; their bias replicated), so that each branch
/// needs one reduction; and `vocab_parameters` (embeddings, an untied head) split by vocabulary.
std::vector<TpRule> tensor_parallel_plan(const BlockOptions& o, const std::vector<std::string>& vocab_parameters);

const TransformerFamily& gpt_family();
const TransformerFamily& gpt2_family();
const TransformerFamily& llama_family();

}  // namespace keel::models
