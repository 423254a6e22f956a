// trainer/compile/inductor_block.h: compile.granularity = "blocks": a transformer block's forward
// and backward compiled ahead of time by AOTInductor (one package, reused for every block of the
// same shape, so compile time does not grow with depth) and run from C++ inside a C++ autograd
// function, between the collectives that keel runs around each block.
//
// Owns: loading the block package (trainer/compile/aot_package.py --granularity blocks: the
// block traced by AOTAutograd, min-cut partitioned into a forward that returns the output and
// the tensors its backward reads, and a backward that returns every parameter's gradient and
// the input's), checking it takes the model's block parameters (names, shapes, dtypes), and
// running it: the forward keeps the saved tensors; the backward reads the block's parameters
// as they are then (with dist.zero = 3, gathered again for the backward), never a copy held
// from the forward. Everything around the block stays eager autograd: c10d's Reducer sees each
// block's gradients as its backward finishes (DDP's buckets all-reduced while earlier blocks
// run theirs), ZeRO-3 gathers and reduce-scatters around each block (dist/fsdp.h). The root runs
// from the same package, in three units around the blocks (BlockStructure::root_compiled): embed
// (token ids -> the first block's input), head (final norm and output projection -> logits) and
// loss (keel's cross-entropy); under tensor parallelism (vocabulary-parallel) it runs eager.
// Does not own: the package cache and the packaging step (trainer/compile/inductor.h), which
// blocks run compiled (models::BlockStructure::block_compiled, set by the compile stage).
#pragma once

#include <torch/torch.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "keel/models/model.h"
#include "trainer/compile/inductor.h"

namespace keel {

class InductorBlock : public std::enable_shared_from_this<InductorBlock> {
 public:
  /// The block package of `req` (granularity "blocks") from the cache, or compiled into it.
  /// `block_params`: the names, in order, of the parameters of the model's first block, relative
  /// to the block ("ln_1.weight"), and their specs ("[2, 3] float32"): a package that takes
  /// others is refused before it runs, naming the first difference.
  static std::shared_ptr<InductorBlock> load_or_compile(const InductorRequest& req,
                                                        const std::vector<std::string>& block_params,
                                                        const std::vector<std::string>& block_specs,
                                                        CompileReport& report);
  /// One unit of a package and the parameters it may take (names and specs, as the model's
  /// block or root names them): "block" takes exactly these; any other unit some of them.
  struct Unit {
    std::string name;
    std::vector<std::string> params, specs;
  };
  /// The same for each of `units` of one package ("attention" and "mlp", the block's
  /// tensor-parallel regions at req.tp > 1; "embed", "head" and "loss", the root's): models
  /// <unit>_forward and <unit>_backward, whose parameters are named as the unit's params, of the
  /// same spec, in param_names() order. A root unit the package lacks is a null entry (a package
  /// made by another packaging script than keel's); any other missing unit throws.
  static std::vector<std::shared_ptr<InductorBlock>> load_units(const InductorRequest& req,
                                                                const std::vector<Unit>& units, CompileReport& report);
  /// The parameters the unit takes, in its order, named relative to the block (a root unit: as
  /// the model names them).
  const std::vector<std::string>& param_names() const { return param_names_; }
  ~InductorBlock();

  /// Whether an input of this shape and dtype, under the autocast now in effect, runs in the
  /// package (else the block runs eager); and `extra` (the loss's target) of the traced shapes.
  bool fits(const torch::Tensor& x, const std::vector<torch::Tensor>& extra = {}) const;
  /// The input the package takes: "[8, 32, 64] float32" (with " under autocast" when traced so).
  std::string input_spec() const;
  /// The block on `x` with `params` (the block's, in the package's order) and `extra` (what
  /// else it takes: llama's rotary cos and sin, as the package names them): its output, whose
  /// backward gives every parameter and `x` their gradients.
  torch::Tensor forward(const std::vector<torch::Tensor>& params, const torch::Tensor& x,
                        const std::vector<torch::Tensor>& extra = {});
  /// How many extra inputs the package takes (0; 2: cos and sin; 1: the loss's target).
  size_t num_extra() const { return num_extra_; }
  /// Whether the input gets a gradient (not for token ids: the root's embed).
  bool input_grad() const { return input_dtype_ != c10::ScalarType::Long; }
  const std::string& sha256() const { return sha256_; }
  const std::string& path() const { return path_; }
  /// Its manifest with "cache_key" (checkpoint.save_graph stores it as graph.json).
  std::string manifest_for_checkpoint() const { return manifest_.dump(2) + "\n"; }
  /// The root's loss from the package (set on what compile_blocks returns where the root is
  /// compiled): keel's cross-entropy of (logits, target) in float32, or an undefined tensor where
  /// it does not run (another shape, no gradient wanted), for the eager loss to compute.
  using Loss = std::function<torch::Tensor(const torch::Tensor& logits, const torch::Tensor& target)>;
  const Loss& root_loss() const { return root_loss_; }
  void set_root_loss(Loss loss) { root_loss_ = std::move(loss); }

  /// For the autograd function (internal): the forward's outputs (output, then the saved
  /// tensors), and the backward's (each parameter's gradient, then the input's).
  std::vector<torch::Tensor> run_forward(std::vector<torch::Tensor> inputs);
  std::vector<torch::Tensor> run_backward(const std::vector<torch::Tensor>& params, const torch::Tensor& x,
                                          const std::vector<torch::Tensor>& extra,
                                          const std::vector<torch::Tensor>& saved, const torch::Tensor& grad_output);

 private:
  InductorBlock() = default;
  void read_signature(const Unit& unit, const torch::Device& device);
  /// Where each input of the backward comes from.
  struct Source {
    enum class Kind { Parameter, Input, Extra, Saved, GradOutput } kind;
    size_t index = 0;  // the parameter's, the extra input's or the saved tensor's
  };
  std::unique_ptr<torch::inductor::AOTIModelPackageLoader> forward_, backward_;
  std::string path_, sha256_;
  nlohmann::json manifest_;
  std::vector<int64_t> input_shape_;
  c10::ScalarType input_dtype_ = c10::ScalarType::Float;
  size_t num_params_ = 0, num_extra_ = 0;
  std::string amp_ = "off";
  std::vector<std::string> extra_names_, param_names_;
  std::vector<std::vector<int64_t>> extra_shapes_;
  std::vector<std::string> extra_dtypes_;  // as the manifest names them ("int64")
  std::string unit_ = "block";
  std::vector<Source> backward_inputs_;
  Loss root_loss_;
};

/// compile.granularity = "blocks": loads (or packages) the block package for `model` and sets
/// every block to run it (models::BlockStructure::block_compiled) where the block's input fits
/// the package and a gradient is wanted; elsewhere the block runs eager. At tp = 1 the root's
/// embed and head run from it too (BlockStructure::root_compiled), and the returned unit's
/// root_loss() gives keel's cross-entropy from it. Under tensor parallelism
/// (req.tp > 1) the package holds the block's two regions between its collectives instead, set
/// as BlockStructure::region_compiled: the block runs eager around them (norms, tp's
/// collectives, the row-parallel biases, the residuals). A training input of
/// another shape is warned once per shape and counted in report->recompiles; more than
/// `max_recompiles` is an InputError naming compile.max_recompiles. Throws as fetch_package;
/// InputError for a model without blocks or whose blocks' parameters differ from block 0's.
std::shared_ptr<InductorBlock> compile_blocks(models::Model& model, const InductorRequest& req,
                                              std::shared_ptr<CompileReport> report, int64_t max_recompiles);

}  // namespace keel
