// cnn: the "2 Conv + pooling" net of the Fashion-MNIST benchmark table (421,642 parameters):
// Conv(1->32, 3x3, pad 1), ReLU, MaxPool 2; Conv(32->64, 3x3, pad 1), ReLU, MaxPool 2;
// Linear(3136->128), ReLU; Linear(128->num_classes).
#include "keel/models/model.h"
#include "models/deferred_init.h"

namespace keel::models {
namespace {

struct CnnImpl : torch::nn::Module {
  explicit CnnImpl(int64_t classes)
      // Each layer built as a part (model.sharded_init: deferred at dist.zero = 3).
      : conv1(register_module("conv1", build_part([] { return torch::nn::Conv2d(conv(1, 32)); }))),
        conv2(register_module("conv2", build_part([] { return torch::nn::Conv2d(conv(32, 64)); }))),
        fc1(register_module("fc1", build_part([] { return torch::nn::Linear(64 * 7 * 7, 128); }))),
        fc2(register_module("fc2", build_part([classes] { return torch::nn::Linear(128, classes); }))) {}
  static torch::nn::Conv2dOptions conv(int64_t in, int64_t out) {
    return torch::nn::Conv2dOptions(in, out, 3).padding(1);
  }
  // x: (B, 1, 28, 28) -> (B, classes)
  torch::Tensor forward(const torch::Tensor& x) {
    TORCH_CHECK(x.dim() == 4 && x.size(1) == 1 && x.size(2) == 28 && x.size(3) == 28,
                "cnn expects input (B, 1, 28, 28), got ", x.sizes());
    auto h = torch::max_pool2d(torch::relu(conv1->forward(x)), 2);  // (B, 32, 14, 14)
    h = torch::max_pool2d(torch::relu(conv2->forward(h)), 2);       // (B, 64, 7, 7)
    h = torch::relu(fc1->forward(h.flatten(1)));                    // (B, 128)
    return fc2->forward(h);                                         // (B, classes)
  }
  torch::nn::Conv2d conv1, conv2;
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(Cnn);

}  // namespace

std::shared_ptr<Model> make_cnn(const ModelConfig& cfg) {
  InputSpec spec{InputKind::Image, {1, 28, 28}, cfg.num_classes};
  return std::make_shared<ModuleModel<Cnn>>("cnn", Cnn(cfg.num_classes), spec);
}

}  // namespace keel::models
