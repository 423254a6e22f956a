// trainer/compile/python_model.h: model.name = "python": a user's own PyTorch module
// (model.path = FILE.py, model.factory = a function returning the nn.Module), trained by keel
// with no Python in the training loop (compile.mode = "inductor").
//
// Owns: taking the module's initial parameters and buffers (the packaging step run once with
// --init-out, after torch.manual_seed(run.seed), cached in compile.cache_dir beside the packages),
// and a C++ module that holds exactly those tensors under the same names, in the same order
// (submodules made for every dotted prefix), so that keel's optimizer, DDP, ZeRO, checkpoints,
// model.init_from and resume treat it like a built-in model. Its forward in eval mode is the
// package's evaluation forward (shorter batches padded); a training batch runs only in the package.
// Does not own: the packages (trainer/compile/inductor.h), the decision to build one (the trainer).
#pragma once

#include <torch/torch.h>

#include <nlohmann/json.hpp>

#include <memory>
#include <optional>
#include <string>

#include "keel/models/model.h"

namespace keel {

struct Config;
class InductorStep;

class PythonModel : public models::Model {
 public:
  /// The module cfg.model names, with its initial weights; throws InputError (exit 2) for a
  /// missing file, a factory that fails or returns no nn.Module, naming the file and line.
  static std::shared_ptr<PythonModel> create(const Config& cfg, std::optional<models::InputKind> data_kind);

  std::string name() const override { return "python"; }
  models::InputSpec input_spec() const override { return spec_; }
  /// Eval mode: the package's evaluation forward (attach() first). Training mode: refused (a
  /// training batch of another shape than the package's cannot run: the module has no C++ code).
  torch::Tensor forward(const torch::Tensor& input) override;
  models::NamedTensors named_parameters() const override;
  models::NamedTensors named_buffers() const override;
  void to(const torch::Device& device) override { module_->to(device); }
  void train(bool on) override { module_->train(on); }

  /// FILE.py:FACTORY, as the packaging step takes it.
  const std::string& module_spec() const { return module_spec_; }
  /// The shapes and dtypes of a batch of `batch` samples, and the classes (--example).
  nlohmann::json example(int64_t batch) const;
  /// The compiled step, whose evaluation forward serves forward() in eval mode. Throws
  /// CompileError when the run evaluates and the package has none (it could not be captured).
  void attach(std::shared_ptr<InductorStep> step, bool evaluates);

 private:
  PythonModel() = default;
  std::shared_ptr<torch::nn::Module> module_;
  models::InputSpec spec_;
  std::string module_spec_;
  std::shared_ptr<InductorStep> step_;
};

}  // namespace keel
