// torchscript: trains a TorchScript module loaded from model.path (saved by torch.jit.save in
// Python, or by keel's compile stage). The file must define forward(input) -> logits as in
// InputSpec; its input kind comes from model.input, or from the data when that is "auto".
#include <torch/script.h>

#include "common/file.h"

#include "keel/models/model.h"

namespace keel::models {
namespace {

class TorchScriptModel : public Model {
 public:
  TorchScriptModel(torch::jit::Module m, InputSpec spec) : module_(std::move(m)), spec_(std::move(spec)) {}
  std::string name() const override { return "torchscript"; }
  InputSpec input_spec() const override { return spec_; }
  torch::Tensor forward(const torch::Tensor& input) override {
    auto out = module_.forward({input});
    TORCH_CHECK(out.isTensor(), "torchscript model: forward must return one Tensor, got ", out.tagKind());
    return out.toTensor();
  }
  NamedTensors named_parameters() const override {
    NamedTensors out;
    for (const auto& p : module_.named_parameters(/*recurse=*/true)) out.emplace_back(p.name, p.value);
    return out;
  }
  NamedTensors named_buffers() const override {
    NamedTensors out;
    for (const auto& b : module_.named_buffers(/*recurse=*/true)) out.emplace_back(b.name, b.value);
    return out;
  }
  void to(const torch::Device& device) override { module_.to(device); }
  void train(bool on) override { module_.train(on); }

 private:
  mutable torch::jit::Module module_;
  InputSpec spec_;
};

}  // namespace

std::shared_ptr<Model> make_torchscript(const ModelConfig& cfg, std::optional<InputKind> data_kind) {
  torch::jit::Module m;
  if (const std::string what = not_a_regular_file(cfg.path); !what.empty())
    throw InputError("model.path = \"" + cfg.path +
                     "\": " + (what == "missing" ? "file not found" : "is " + what + ", not a TorchScript file"));
  try {
    m = torch::jit::load(cfg.path);
  } catch (const c10::Error& e) {
    std::string what = e.what_without_backtrace();
    throw InputError("model.path = \"" + cfg.path +
                     "\": cannot load TorchScript module: " + what.substr(0, what.find('\n')));
  }
  InputKind kind = cfg.input == ModelInput::Tokens  ? InputKind::Tokens
                   : cfg.input == ModelInput::Image ? InputKind::Image
                                                    : data_kind.value_or(InputKind::Image);
  InputSpec spec = kind == InputKind::Image ? InputSpec{InputKind::Image, {1, 28, 28}, cfg.num_classes}
                                            : InputSpec{InputKind::Tokens, {cfg.context}, cfg.vocab};
  return std::make_shared<TorchScriptModel>(std::move(m), spec);
}

}  // namespace keel::models
