#include "trainer/loss.h"

namespace keel {

// Cross-entropy over the last dimension: logits (..., C), target (...) int64.
namespace {

torch::Tensor cross_entropy(const torch::Tensor& logits, const torch::Tensor& target) {
  return torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}), target.reshape({-1}));
}

}  // namespace

Registry<LossFn>& losses() {
  static Registry<LossFn> r("loss", "train.loss",
                            [](Registry<LossFn>& t) { t.add_builtin("cross_entropy", LossFn(cross_entropy)); });
  return r;
}

void register_loss(const std::string& name, LossFn loss) { losses().add(name, std::move(loss)); }

std::vector<std::string> registered_losses() { return losses().names(); }

}  // namespace keel
