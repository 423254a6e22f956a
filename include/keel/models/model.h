// keel/models/model.h: what a "model" is to the rest of keel, and the registry that builds one by
// name.
//
// Owns: the Model interface (forward, named parameters and buffers, device placement,
// train/eval), the description of the input a model eats (InputSpec), and the name -> factory
// registry. The trainer only ever sees this header; concrete networks register themselves
// here (mlp, cnn, gpt, torchscript) and users add their own with register_model().
// Does not own: losses, optimizers, data (trainer/), distribution (dist/).
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "keel/common/error.h"
#include "keel/models/config.h"

namespace keel::models {

/// Image and Tokens are what keel's datasets produce and its built-in models eat; Features is
/// anything else a user's own model and dataset agree on (train it with Callbacks::loss).
enum class InputKind { Image, Tokens, Features };
const char* input_kind_name(InputKind k);

/// What one sample fed to a model looks like.
///   Image:  input (B, C, H, W) float32, target (B) int64 in [0, num_classes)
///   Tokens: input (B, T) int64 in [0, num_classes), target (B, T) int64 (next tokens)
///   Features: input (B, *sample_shape) float32, target as the user's loss expects
/// The model returns logits (B, num_classes) for images and (B, T, num_classes) for tokens;
/// the loss is cross-entropy over the last dimension in both cases.
struct InputSpec {
  InputKind kind = InputKind::Image;
  std::vector<int64_t> sample_shape = {1, 28, 28};  // per-sample input shape (no batch dim)
  int64_t num_classes = 10;                         // classes, or vocabulary size for tokens
};

using NamedTensors = std::vector<std::pair<std::string, torch::Tensor>>;

/// Called by a model's forward around each of its blocks (BlockStructure), so that dist.zero = 3
/// can gather a block's sharded parameters just before the block runs and free them after (and
/// again around the block's backward). Each returns the tensor the model goes on with (the same
/// values; what autograd sees may differ).
class BlockHooks {
 public:
  virtual ~BlockHooks() = default;
  virtual torch::Tensor enter(size_t block, const torch::Tensor& input) = 0;
  virtual torch::Tensor leave(size_t block, const torch::Tensor& output) = 0;
};

/// A torch::nn::Module with blocks (gpt's transformer blocks, mlp's layers): a module that
/// derives from it lists each block's parameter name prefix in forward order ("h.0.", "h.1.",
/// ...) and wraps each block's call as `x = block_leave(i, block(block_enter(i, x)))`. A block
/// must use only its own parameters, and its output must be the only way its computation reaches
/// the loss. Without blocks, dist.zero = 3 gathers the whole model for each forward and backward.
class BlockStructure {
 public:
  virtual ~BlockStructure() = default;
  std::vector<std::string> block_prefixes;
  BlockHooks* block_hooks = nullptr;

  /// Pipeline parallelism (parallel.pp, dist/stages.h): the part of forward that runs, blocks
  /// [first, end) and the root's embedding (the forward's input is then token ids, else the
  /// previous stage's output) and head. Off the stage, block_enter, block_call and block_leave
  /// and root_call return their input as it is. The default: the whole model.
  struct Stage {
    size_t first = 0, end = SIZE_MAX;
    bool embed = true, head = true;
  };
  Stage stage;
  bool on_stage(size_t i) const { return i >= stage.first && i < stage.end; }
  /// The forward's input is the token ids (else an activation: a stage after the first).
  bool takes_tokens() const { return stage.embed; }

  /// Block i's input and output, through block_hooks on the stage; each also marks the block
  /// running for the flight record's phase (dist/phase.h: "forward of block i").
  torch::Tensor block_enter(size_t i, const torch::Tensor& x);
  torch::Tensor block_leave(size_t i, const torch::Tensor& y);

  /// How a block's own computation runs, between block_enter and block_leave: `run(f, x)` returns
  /// f(x), where f is the block (which it may keep, to call again in backward). Empty: f(x)
  /// directly. Activation checkpointing (dist/recompute.h) sets it; the transformer families'
  /// blocks run through block_run() (models/transformer.h's run_blocks).
  using BlockFunction = std::function<torch::Tensor(const torch::Tensor&)>;
  using BlockRun = std::function<torch::Tensor(BlockFunction f, const torch::Tensor& x)>;
  BlockRun block_runner;
  torch::Tensor block_run(BlockFunction f, const torch::Tensor& x) {
    return block_runner ? block_runner(std::move(f), x) : f(x);
  }

  /// Block i's computation compiled (compile.granularity = "blocks", trainer/compile/
  /// inductor_block.h): its output on `x` (with the rotary angles' cos and sin, (T, head_dim),
  /// where the family has them; else undefined), or an undefined tensor where the compiled
  /// block does not run (another shape, no gradient wanted: evaluation), so that the block runs
  /// as above. Empty: never. The compile stage sets it for the families whose block it packages.
  using BlockCompiled = std::function<torch::Tensor(size_t i, const torch::Tensor& x, const torch::Tensor& cos,
                                                    const torch::Tensor& sin)>;
  BlockCompiled block_compiled;
  /// Under tensor parallelism (compile.granularity = "blocks" with parallel.tp > 1), block i's two
  /// regions between its collectives compiled: the attention's (`x` after tp's enter; the rotary
  /// cos and sin where the family has them) or the MLP's (`x` after its enter) -> the
  /// row-parallel projection's partial product, before tp's leave; or an undefined tensor where
  /// the package does not run (the region then runs eager). Empty: never.
  enum class Region { Attention, Mlp };
  using RegionCompiled = std::function<torch::Tensor(size_t i, Region region, const torch::Tensor& x,
                                                     const torch::Tensor& cos, const torch::Tensor& sin)>;
  RegionCompiled region_compiled;
  /// How a region's own computation runs under tensor parallelism: `run(i, region, f, x)` returns
  /// f(x), the region's partial product (f is block i's region on `x`, after tp's enter). Empty:
  /// f(x) directly. The compile stage sets it for one forward, to trace the regions from the
  /// sharded block (trainer/compile/unit_trace.h).
  using RegionRun =
      std::function<torch::Tensor(size_t i, Region region, const BlockFunction& f, const torch::Tensor& x)>;
  RegionRun region_runner;
  torch::Tensor block_call(size_t i, BlockFunction f, const torch::Tensor& x, const torch::Tensor& cos = {},
                           const torch::Tensor& sin = {}) {
    if (!on_stage(i)) return x;
    if (block_compiled)
      if (torch::Tensor y = block_compiled(i, x, cos, sin); y.defined()) return y;
    return block_run(std::move(f), x);
  }

  /// The root's two parts around the blocks compiled (compile.granularity = "blocks" without
  /// tensor parallelism): Embed, token ids (B, T) -> the first block's input; Head, the last
  /// block's output -> logits (the final norm and the output projection). An undefined tensor
  /// where the package does not run (another shape, evaluation), so that the part runs eager.
  /// Empty: never. A family's forward calls root_call() with its eager part.
  enum class RootPart { Embed, Head };
  using RootCompiled = std::function<torch::Tensor(RootPart part, const torch::Tensor& x)>;
  RootCompiled root_compiled;
  /// A root part's eager computation as a function of its input (`x`: the token ids, or the last
  /// block's output), which the compile stage can trace: what a family passes to root_call.
  using RootFunction = std::function<torch::Tensor(const torch::Tensor&)>;
  /// How a root part's eager computation runs: `run(part, f, x)` returns f(x). Empty: f(x)
  /// directly. The compile stage sets it for one forward, to trace the root's units from the
  /// model's own code (trainer/compile/unit_trace.h).
  using RootRun = std::function<torch::Tensor(RootPart part, const RootFunction& f, const torch::Tensor& x)>;
  RootRun root_runner;
  bool root_on_stage(RootPart part) const { return part == RootPart::Embed ? stage.embed : stage.head; }
  torch::Tensor root_call(RootPart part, const torch::Tensor& x, const RootFunction& eager) {
    if (!root_on_stage(part)) return x;
    if (root_compiled)
      if (torch::Tensor y = root_compiled(part, x); y.defined()) return y;
    return root_runner ? root_runner(part, eager, x) : eager(x);
  }
  /// The same with an eager part that reads its input from the caller's scope (keel before issue
  /// 65): it runs compiled where root_compiled serves it, else eager, and is never traced (a model
  /// whose root parts are given so runs its root eager at compile.granularity = "blocks").
  torch::Tensor root_call(RootPart part, const torch::Tensor& x, const std::function<torch::Tensor()>& eager) {
    if (!root_on_stage(part)) return x;
    if (root_compiled)
      if (torch::Tensor y = root_compiled(part, x); y.defined()) return y;
    return eager();
  }
};

/// A trainable network. Implementations: a torch::nn::Module (ModuleModel) or a TorchScript
/// module. Parameter names are stable and follow PyTorch's dotted convention, since they are
/// the keys of checkpoints and of the golden tests.
class Model {
 public:
  virtual ~Model() = default;
  virtual std::string name() const = 0;
  virtual InputSpec input_spec() const = 0;
  /// input as in InputSpec -> logits. Thread-compatible, not thread-safe.
  virtual torch::Tensor forward(const torch::Tensor& input) = 0;
  virtual NamedTensors named_parameters() const = 0;
  virtual NamedTensors named_buffers() const = 0;
  virtual void to(const torch::Device& device) = 0;
  virtual void train(bool on) = 0;

  /// Floating-point operations of one training sample (forward and backward), for MFU in the
  /// log and summary.json; 0 = not known (no MFU is shown). The usual estimate for dense
  /// layers: 6 x the parameters a sample multiplies with, plus attention's score products.
  virtual double train_flops_per_sample() const { return 0; }

  /// The parameter name prefix of each block, in forward order, and where forward reports
  /// entering and leaving them (BlockHooks); {} and a no-op for a model without blocks.
  virtual std::vector<std::string> block_prefixes() const { return {}; }
  virtual void set_block_hooks(BlockHooks* /*hooks*/) {}
  /// Sets BlockStructure::block_runner (a model without blocks ignores it).
  virtual void set_block_runner(BlockStructure::BlockRun /*run*/) {}
  /// Sets BlockStructure::block_compiled; returns false for a model without blocks.
  virtual bool set_block_compiled(BlockStructure::BlockCompiled /*run*/) { return false; }
  /// Sets BlockStructure::region_compiled; returns false for a model without blocks.
  virtual bool set_region_compiled(BlockStructure::RegionCompiled /*run*/) { return false; }
  /// Sets BlockStructure::root_compiled; returns false for a model without blocks.
  virtual bool set_root_compiled(BlockStructure::RootCompiled /*run*/) { return false; }

  /// The model's BlockStructure (its blocks, hooks and compile seams), or null for a model without
  /// blocks. A wrapper passes its model's on.
  virtual BlockStructure* block_structure() { return nullptr; }

  std::vector<torch::Tensor> parameters() const;
  int64_t num_parameters() const;
};

/// Adapts a torch::nn::Module holder (e.g. a TORCH_MODULE type) to Model.
template <class ModuleHolder>
class ModuleModel : public Model {
 public:
  ModuleModel(std::string name, ModuleHolder module, InputSpec spec, double train_flops_per_sample = 0)
      : name_(std::move(name)), module_(std::move(module)), spec_(std::move(spec)), flops_(train_flops_per_sample) {}
  double train_flops_per_sample() const override { return flops_; }
  std::string name() const override { return name_; }
  InputSpec input_spec() const override { return spec_; }
  torch::Tensor forward(const torch::Tensor& input) override { return module_->forward(input); }
  NamedTensors named_parameters() const override {
    NamedTensors out;
    for (const auto& p : module_->named_parameters(/*recurse=*/true)) out.emplace_back(p.key(), p.value());
    return out;
  }
  NamedTensors named_buffers() const override {
    NamedTensors out;
    for (const auto& b : module_->named_buffers(/*recurse=*/true)) out.emplace_back(b.key(), b.value());
    return out;
  }
  void to(const torch::Device& device) override { module_->to(device); }
  void train(bool on) override { module_->train(on); }
  std::vector<std::string> block_prefixes() const override {
    const auto* b = dynamic_cast<const BlockStructure*>(module_.get());
    return b ? b->block_prefixes : std::vector<std::string>{};
  }
  void set_block_hooks(BlockHooks* hooks) override {
    if (auto* b = dynamic_cast<BlockStructure*>(module_.get())) b->block_hooks = hooks;
  }
  void set_block_runner(BlockStructure::BlockRun run) override {
    if (auto* b = dynamic_cast<BlockStructure*>(module_.get())) b->block_runner = std::move(run);
  }
  bool set_block_compiled(BlockStructure::BlockCompiled run) override {
    auto* b = dynamic_cast<BlockStructure*>(module_.get());
    if (b) b->block_compiled = std::move(run);
    return b != nullptr;
  }
  bool set_region_compiled(BlockStructure::RegionCompiled run) override {
    auto* b = dynamic_cast<BlockStructure*>(module_.get());
    if (b) b->region_compiled = std::move(run);
    return b != nullptr;
  }
  bool set_root_compiled(BlockStructure::RootCompiled run) override {
    auto* b = dynamic_cast<BlockStructure*>(module_.get());
    if (b) b->root_compiled = std::move(run);
    return b != nullptr;
  }
  BlockStructure* block_structure() override { return dynamic_cast<BlockStructure*>(module_.get()); }
  ModuleHolder& module() { return module_; }

 private:
  std::string name_;
  ModuleHolder module_;
  InputSpec spec_;
  double flops_ = 0;
};

/// Builds a model from its config section. `data_kind` is the input kind the chosen dataset
/// produces natively, if it has one (models that can eat either, like torchscript, use it).
using ModelFactory = std::function<std::shared_ptr<Model>(const ModelConfig&, std::optional<InputKind> data_kind)>;

/// Registers a model under `name` (model.name in the config). Thread-safe. Throws
/// std::invalid_argument when the name is empty or already taken (built-ins included).
void register_model(const std::string& name, ModelFactory factory);
/// Names of every registered model, sorted.
std::vector<std::string> registered_models();
/// Builds cfg.name; throws keel::InputError for an unknown name or a bad model config.
std::shared_ptr<Model> create_model(const ModelConfig& cfg, std::optional<InputKind> data_kind = std::nullopt);

// Built-in factories (registered automatically; exposed for tests and the golden checks).
std::shared_ptr<Model> make_mlp(const ModelConfig& cfg);
std::shared_ptr<Model> make_cnn(const ModelConfig& cfg);
std::shared_ptr<Model> make_gpt(const ModelConfig& cfg);
std::shared_ptr<Model> make_torchscript(const ModelConfig& cfg, std::optional<InputKind> data_kind);

}  // namespace keel::models
