#include "trainer/loss.h"

#include "keel/common/error.h"

namespace keel {

torch::Tensor cross_entropy(const torch::Tensor& logits, const torch::Tensor& target, int64_t ignore_index) {
  namespace F = torch::nn::functional;
  const torch::Tensor t = target.reshape({-1});
  // The sum over the targets that count, divided by their count (at least 1): PyTorch's mean is
  // that very sum over that very count, so where any target counts the two agree bit for bit.
  const torch::Tensor sum =
      F::cross_entropy(logits.reshape({-1, logits.size(-1)}), t,
                       F::CrossEntropyFuncOptions().reduction(torch::kSum).ignore_index(ignore_index));
  return sum / t.ne(ignore_index).sum().clamp_min(1).to(sum.scalar_type());
}

std::string screen_targets(torch::Tensor& target, int64_t classes, int64_t ignore_index, const std::string& where) {
  if (!target.defined() || !target.device().is_cpu() || target.numel() == 0) return "";
  if (!c10::isIntegralType(target.scalar_type(), /*includeBool=*/false))
    throw InputError("data: the " + where + " has targets of dtype " +
                     std::string(c10::toString(target.scalar_type())) +
                     "; train.loss = \"cross_entropy\" takes class indices (int64)");
  const torch::Tensor t = target.to(torch::kLong);
  const torch::Tensor bad = (t.lt(0) | t.ge(classes)) & t.ne(ignore_index);
  if (!bad.any().item<bool>()) return "";
  const torch::Tensor at = bad.nonzero()[0];
  std::vector<int64_t> position(at.data_ptr<int64_t>(), at.data_ptr<int64_t>() + at.numel());
  int64_t flat = 0;
  for (int64_t d = 0; d < t.dim(); ++d) flat = flat * t.size(d) + position[static_cast<size_t>(d)];
  const int64_t value = t.reshape({-1})[flat].item<int64_t>();
  target = t.masked_fill(bad, ignore_index);  // int64, as the loss takes it
  return "data: the " + where + " has target " + std::to_string(value) + " at position " + "[" +
         c10::Join(", ", position) + "], outside the model's " + std::to_string(classes) + " classes [0, " +
         std::to_string(classes) + ") and not train.ignore_index = " + std::to_string(ignore_index) +
         " (targets that should count for nothing take that value)";
}

void check_targets(const torch::Tensor& target, int64_t classes, int64_t ignore_index, const std::string& where) {
  torch::Tensor t = target;
  if (const std::string bad = screen_targets(t, classes, ignore_index, where); !bad.empty()) throw InputError(bad);
}

Registry<LossFn>& losses() {
  static Registry<LossFn> r("loss", "train.loss", [](Registry<LossFn>& t) {
    t.add_builtin("cross_entropy", LossFn([](const torch::Tensor& logits, const torch::Tensor& target) {
                    return cross_entropy(logits, target, -100);
                  }));
  });
  return r;
}

void register_loss(const std::string& name, LossFn loss) { losses().add(name, std::move(loss)); }

std::vector<std::string> registered_losses() { return losses().names(); }

}  // namespace keel
