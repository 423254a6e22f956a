// mlp: flatten 784 -> `depth` hidden Linear(width) layers with ReLU -> Linear(num_classes).
// Defaults (width 256, depth 8) are the shape bench/ compares against PyTorch.
#include "keel/models/model.h"
#include "models/deferred_init.h"

namespace keel::models {
namespace {

struct MlpImpl : torch::nn::Module, BlockStructure {
  MlpImpl(int64_t in, int64_t width, int64_t depth, int64_t classes) {
    fc = register_module("fc", torch::nn::ModuleList());
    int64_t d = in;
    // Each layer built as a part (model.sharded_init: deferred at dist.zero = 3).
    for (int64_t i = 0; i < depth; ++i, d = width)
      fc->push_back(build_part([d, width] { return torch::nn::Linear(d, width); }));
    fc->push_back(build_part([d, classes] { return torch::nn::Linear(d, classes); }));
    for (size_t i = 0; i < fc->size(); ++i) block_prefixes.push_back("fc." + std::to_string(i) + ".");
  }
  // x: (B, C, H, W) -> (B, classes)
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = x.flatten(1);
    const size_t n = fc->size();
    for (size_t i = 0; i < n; ++i) {
      h = block_leave(i, fc[i]->as<torch::nn::Linear>()->forward(block_enter(i, h)));
      if (i + 1 < n) h = torch::relu(h);
    }
    return h;
  }
  torch::nn::ModuleList fc{nullptr};
};
TORCH_MODULE(Mlp);

}  // namespace

std::shared_ptr<Model> make_mlp(const ModelConfig& cfg) {
  InputSpec spec{InputKind::Image, {1, 28, 28}, cfg.num_classes};
  const int64_t width = cfg.width > 0 ? cfg.width : 256;
  const int64_t depth = cfg.depth > 0 ? cfg.depth : 8;
  Mlp mlp(784, width, depth, cfg.num_classes);
  int64_t params = 0;
  for (const auto& p : mlp->parameters()) params += p.numel();
  return std::make_shared<ModuleModel<Mlp>>("mlp", mlp, spec, 6.0 * static_cast<double>(params));  // dense layers only
}

}  // namespace keel::models
