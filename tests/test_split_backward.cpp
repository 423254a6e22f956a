// The zero-bubble schedules' backward split (trainer/step/split_backward.h): I computes the
// stage input's gradient and none of the weights'; W then gives every weight the gradient the
// whole backward gives, bit for bit (the same kernels on the same operands; a weight used twice
// sums its two contributions, and a + b = b + a exactly).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <vector>

#include "trainer/step/split_backward.h"

namespace {

struct Net {
  std::vector<torch::Tensor> params;
  explicit Net(int64_t width) {
    torch::manual_seed(7);
    for (int i = 0; i < 2; ++i) params.push_back(torch::randn({width, width}).div(8).requires_grad_(true));
    params.push_back(torch::randn({width}).requires_grad_(true));  // a bias
    params.push_back(torch::ones({width}).requires_grad_(true));   // a norm's weight
  }
  // A residual block, a norm and the first matrix used a second time (as a tied weight is).
  torch::Tensor forward(const torch::Tensor& x) const {
    torch::Tensor h = torch::gelu(torch::matmul(x, params[0]) + params[2]);
    h = x + torch::matmul(h, params[1]);
    h = torch::layer_norm(h, {h.size(-1)}, params[3]);
    return torch::matmul(h, params[0].t());
  }
  Net clone() const {
    Net n(0);
    n.params.clear();
    for (const auto& p : params) n.params.push_back(p.detach().clone().requires_grad_(true));
    return n;
  }
};

TEST(SplitBackward, InputFirstThenWeightsGiveTheWholeBackwardsGradients) {
  const Net whole(8);
  const Net split = whole.clone();
  const torch::Tensor x0 = torch::randn({4, 3, 8});
  const torch::Tensor g = torch::randn({4, 3, 8});
  const torch::Tensor xa = x0.clone().requires_grad_(true), xb = x0.clone().requires_grad_(true);
  torch::autograd::backward({whole.forward(xa)}, {g});

  keel::WeightBackward w = keel::backward_input(split.forward(xb), g, xb);
  ASSERT_TRUE(xb.grad().defined());
  EXPECT_TRUE(torch::equal(xb.grad(), xa.grad())) << "the input's gradient";
  EXPECT_FALSE(w.whole);
  EXPECT_FALSE(w.roots.empty());
  for (size_t i = 0; i < split.params.size(); ++i)
    EXPECT_FALSE(split.params[i].grad().defined()) << "I computed weight " << i << "'s gradient";
  keel::backward_weight(w);
  for (size_t i = 0; i < split.params.size(); ++i) {
    ASSERT_TRUE(split.params[i].grad().defined()) << "weight " << i;
    EXPECT_TRUE(torch::equal(split.params[i].grad(), whole.params[i].grad())) << "weight " << i;
  }
}

// The first stage (its input needs no gradient): I runs nothing, W the whole backward; a scalar
// loss takes the gradient 1.
TEST(SplitBackward, WithoutAnInputGradientWeightsRunTheWholeBackward) {
  const Net whole(8);
  const Net split = whole.clone();
  const torch::Tensor x = torch::randn({4, 8});
  torch::autograd::backward({whole.forward(x).pow(2).sum()});
  keel::WeightBackward w = keel::backward_input(split.forward(x).pow(2).sum(), torch::Tensor(), x);
  EXPECT_TRUE(w.whole);
  for (const auto& p : split.params) EXPECT_FALSE(p.grad().defined());
  keel::backward_weight(w);
  for (size_t i = 0; i < split.params.size(); ++i)
    EXPECT_TRUE(torch::equal(split.params[i].grad(), whole.params[i].grad())) << "weight " << i;
}

}  // namespace
