// trainer/compile/inductor.h: compile.mode = "inductor": the whole training step (forward,
// loss, backward) compiled ahead of time by Inductor and run from C++, with no Python in the
// loop.
//
// Owns: the packaging step (trainer/compile/aot_package.py, run with keel's venv Python when a
// package is missing: make_fx of forward + cross-entropy + autograd.grad, torch.export,
// AOTInductor), the package cache (compile.cache_dir, keyed by the SHA-256 of everything that
// changes the generated code; one process per cache entry compiles while the others wait on its
// lock, published atomically, checked by SHA-256 before it is loaded, rebuilt when damaged),
// loading it (torch::inductor::AOTIModelPackageLoader), and running it inside a C++ autograd
// function: the step returns the loss and every parameter's gradient at once; backward hands the
// gradients to autograd, so c10d's Reducer (buckets, comm hooks, ZeRO stage 2, accumulation),
// the GradScaler's scaling and everything after backward work exactly as in eager mode.
// Parameters stay keel's C++ tensors, passed in as inputs every step (never baked in).
// Does not own: the decision to use it or to fall back to eager (trainer/compile/transforms.h,
// the trainer), evaluation (eager, the same parameters).
#pragma once

#include <torch/torch.h>

#include <nlohmann/json.hpp>

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "keel/trainer/config/config.h"
#include "trainer/compile/compile.h"
#include "trainer/compile/graph_file.h"

namespace torch::inductor {
class AOTIModelPackageLoader;
}

namespace keel {

/// What the packaging step compiles: one model at one static shape.
struct InductorRequest {
  std::string model;            // model.name (logs); "python" with `module`
  nlohmann::json model_config;  // the [model] section
  int64_t batch = 0;            // per-rank micro-batch of the training step
  int64_t ignore_index = -100;  // train.ignore_index: the packaged cross-entropy's (trainer/loss.h)
  std::string amp = "off";      // off | bf16 | fp16 (CUDA)
  /// The package takes the loss scale as an input (its gradients are of loss x grad_scale, computed
  /// under autocast already scaled, so that small fp16 gradients do not flush to zero): what
  /// amp.dtype = fp16's GradScaler needs. Implied by amp = fp16; settable alone (tests, on the CPU).
  bool grad_scale = false;
  torch::Device device{torch::kCPU};
  int64_t threads = 1;                    // intra-op threads (Inductor's CPU kernels are compiled for a count)
  CompileConfig cfg;                      // fullgraph, deterministic, max_autotune, cache_dir, python
  std::vector<std::string> param_names;   // the model's, in order (the package must take exactly these)
  std::vector<std::string> buffer_names;  // the same for its buffers (passed in; those updated, copied back)
  /// Each parameter's and buffer's shape and dtype as "[2, 3] float32", in the same order: a
  /// package whose inputs differ is refused before it runs (it does not check its inputs' sizes).
  /// Empty: not checked.
  std::vector<std::string> param_specs, buffer_specs;
  /// model.name = "python": the user's module, FILE.py:FACTORY (model.path, model.factory), and
  /// the shapes and dtypes of the run's batches ({"input": {"shape", "dtype"}, "target": ..., "classes"}).
  std::string module;
  nlohmann::json example;
  /// > 0: the package also holds the evaluation forward at this batch (InductorStep::forward).
  int64_t eval_batch = 0;
  /// A checkpoint step directory whose stored package (graph.pt2 + graph.json, checkpoint.save_graph)
  /// may serve this request when the cache has none: used when its cache key is this request's
  /// and both files have the SHA-256 meta.json lists; otherwise the step is packaged anew.
  std::string seed_dir;
  /// "step": the whole training step (InductorStep); "blocks": a transformer block's forward and
  /// backward, reused for every block of the model (trainer/compile/inductor_block.h).
  std::string granularity = "step";
  int64_t tp = 1;  // blocks under parallel.tp = N: the block's tensor-parallel regions, as one rank holds them
  /// What keel's C++ code computes, traced from the placed model with `loss` on a batch whose
  /// targets are `example_target`: at granularity "step" the training step (graph_file.h, traced by
  /// PlacedModel::compile), at "blocks" the bundle of units (unit_trace.h, traced by
  /// compile_blocks). What the packaging step compiles and what the cache is keyed by, for every C++
  /// model (built in or registered). Unset only for a Python module (`module`).
  std::shared_ptr<const GraphFile> graph;
  std::function<torch::Tensor(const torch::Tensor&, const torch::Tensor&)> loss;
  torch::Tensor example_target;
  /// The batch the units of granularity "blocks" are traced on (compile_blocks); unset: random
  /// token ids of the model's input spec, and targets likewise where example_target is unset.
  torch::Tensor example_input;
  /// Called on every rank right after the step is traced, with this rank's refusal ("" when none):
  /// throws on a rank that did not refuse when another did (Run agrees over the ranks), so that no
  /// rank packages while another has refused. Empty: one process (keel compile).
  std::function<void(const std::string&)> agree_on_trace;
  /// Whether what is packaged is traced from the C++ model (every model but a Python module, which
  /// the packaging step traces in Python): its step at granularity "step" (traces_step), its units
  /// at "blocks" (compile_blocks).
  bool traces() const;
  bool traces_step() const;
};

/// A loaded package as checkpoint.save_graph stores it (graph.pt2, graph.json).
struct PackageFiles {
  std::string path, sha256;
  std::string manifest;  // with "cache_key": what a resume seeds the compile cache from
  std::string what;      // "the training step", "the transformer block"
};

/// A package in the compile cache: found, taken from a checkpoint or built (under the entry's
/// lock), its SHA-256 checked against its manifest.
struct PackageEntry {
  std::string path;
  nlohmann::json manifest;  // with "cache_key"
  std::chrono::steady_clock::time_point started;
  /// Logs the load and sets report.compile_ms (call once the package's loaders exist).
  void loaded(CompileReport& report) const;
};
/// The package for `req` from the cache, or compiled into it; sets report.cache, mode, package
/// and package_sha256. Throws as InductorStep::load_or_compile.
PackageEntry fetch_package(const InductorRequest& req, CompileReport& report);

/// "[2, 3] float32": a tensor's shape and dtype as InductorRequest and the package's manifest name them.
std::string tensor_spec(const torch::Tensor& t);

/// A loaded training-step package.
class InductorStep {
 public:
  /// The package for `req` from the cache, or compiled into it (see above). Fills `report`
  /// (mode, compile_ms, cache, package). Throws CompileError when the step cannot be captured
  /// (a graph break, a non-deterministic op with compile.deterministic, a custom op without a
  /// fake kernel), naming the op and the Python source line; InputError for a request keel
  /// cannot package (another model); std::runtime_error when the packaging step fails.
  static std::shared_ptr<InductorStep> load_or_compile(const InductorRequest& req, CompileReport& report);
  ~InductorStep();

  /// Whether a batch of this shape runs in the package (else the step runs eager).
  bool fits(const torch::Tensor& input, const torch::Tensor& target) const;
  /// Runs the step on `params` and `buffers` (the model's, in its order), `input` and `target`:
  /// returns the mean cross-entropy (float32, 0-dim) whose backward gives each parameter its
  /// gradient (times the gradient of the loss: a 1/grad_accum, a loss scale). Buffers the step
  /// updates (BatchNorm's running statistics) are updated in place. `grad_scale` (float32, one
  /// element, on the device; the GradScaler's scale_tensor()): what a package that takes_scale()
  /// scales its gradients by inside the graph; the backward then divides it out of the gradient
  /// of the loss it receives (the same scale, applied to the loss by GradScaler::scale), so the
  /// gradients come out as in eager mode: of loss x scale / grad_accum. Ignored by other packages;
  /// undefined = 1.
  torch::Tensor loss(const std::vector<torch::Tensor>& params, const std::vector<torch::Tensor>& buffers,
                     const torch::Tensor& input, const torch::Tensor& target,
                     const torch::Tensor& grad_scale = torch::Tensor());
  /// Whether the package takes the loss scale (InductorRequest::grad_scale).
  bool takes_scale() const { return takes_scale_; }
  /// Whether the package holds the evaluation forward, and at which batch.
  bool has_forward() const { return forward_loader_ != nullptr; }
  int64_t eval_batch() const { return eval_batch_; }
  /// Why the package has no evaluation forward (the packaging step's line), when it has none.
  std::string no_forward_reason() const;
  /// The evaluation forward (eval mode, no autocast): logits of `input`, whose batch must be
  /// eval_batch() (python_model.cpp pads a shorter one).
  torch::Tensor forward(const std::vector<torch::Tensor>& params, const std::vector<torch::Tensor>& buffers,
                        const torch::Tensor& input);
  /// The package's SHA-256 (ranks agree on it in the per-step consensus).
  const std::string& sha256() const { return sha256_; }
  const std::string& path() const { return path_; }
  /// Its manifest (inputs, outputs, SHA-256) with "cache_key": what checkpoint.save_graph
  /// stores beside the package as graph.json.
  std::string manifest_for_checkpoint() const;
  /// The cache key of `req` (hex SHA-256; tests).
  static std::string cache_key(const InductorRequest& req);

  /// Runs the package for the autograd function (internal): params, buffers, input, target in;
  /// the loss and the gradients out (buffer updates already copied into `buffers`).
  std::vector<torch::Tensor> run(std::vector<torch::Tensor> inputs, const std::vector<torch::Tensor>& buffers);

 private:
  InductorStep() = default;
  void read_signature(const InductorRequest& req);
  std::unique_ptr<torch::inductor::AOTIModelPackageLoader> loader_, forward_loader_;
  std::string path_, sha256_;
  nlohmann::json manifest_;
  std::vector<int64_t> input_shape_, target_shape_, eval_input_shape_;
  size_t num_params_ = 0, num_buffers_ = 0;
  bool takes_scale_ = false;
  std::vector<size_t> updated_buffers_;  // the buffer index of each output after the gradients
  int64_t eval_batch_ = 0;
};

/// The training step of `model` (placed, under the caller's autocast) traced for `req`: its loss
/// (keel's cross-entropy with req.ignore_index when none is set) on `input` and req.example_target.
GraphFile trace_step(models::Model& model, const torch::Tensor& input, const InductorRequest& req);
/// The loss `req` packages: req.loss, or keel's cross-entropy with req.ignore_index.
std::function<torch::Tensor(const torch::Tensor&, const torch::Tensor&)> request_loss(const InductorRequest& req);
/// `trace` run, then the ranks agreed on its outcome (req.agree_on_trace): the graph, or the refusal
/// (GraphRefusal; CompileError for what keel's graph file cannot carry) on every rank.
GraphFile traced_and_agreed(const InductorRequest& req, const std::function<GraphFile()>& trace);

/// The [model] section of `cfg` as the packaging step reads it (--model-config).
nlohmann::json model_config_json(const Config& cfg);

/// `keel compile`: the package for the run `cfg` describes (one process; the per-rank threads
/// of this launch), from the cache or compiled into it. Returns what compile() reports.
CompileReport package_training_step(const Config& cfg);

}  // namespace keel
