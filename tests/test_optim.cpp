// Optimizers (trainer/optim.h): keel's fused AdamW and SGD against PyTorch's own fused
// optimizers over 20 steps (tests/golden/make_optim_golden.py: a learning rate that changes
// every step, steps skipped through found_inf), their checkpoint state interchangeable with
// torch::optim's loop optimizers, and the multi-tensor clipping and inf/NaN check.
#include <gtest/gtest.h>
#include <torch/script.h>
#include <torch/serialize.h>

#include "amp/grad_scaler.h"
#include "dist/zero.h"
#include "helpers.h"
#include "keel/dist/collectives.h"
#include "keel/dist/process_group.h"
#include "trainer/optim.h"

namespace {

using keel::NamedTensorList;

// PyTorch's fused optimizers on this process's kernel set: tests/golden/make_optim_golden.py run
// now by keel's Python, which inherits ATEN_CPU_CAPABILITY (issue 44: a file made once on vector
// kernels differs in the last bit from what ATen's scalar `default` kernels compute).
c10::Dict<c10::IValue, c10::IValue> golden() {
  static const keel::testing::TempDir dir;
  static const auto d = [] {
    const std::string out = dir.file("optim.pt");
    const auto r = keel::testing::run_process(
        {KEEL_PYTHON, keel::testing::source_path("tests/golden/make_optim_golden.py"), out}, {}, 300);
    if (r.exit_code != 0) throw std::runtime_error("make_optim_golden.py failed:\n" + r.output);
    const std::string bytes = keel::testing::read_text(out);
    std::vector<char> data(bytes.begin(), bytes.end());
    return torch::pickle_load(data).toGenericDict();
  }();
  return d;
}

torch::Tensor entry(const std::string& key) {
  const auto d = golden();
  EXPECT_TRUE(d.contains(c10::IValue(key))) << key;
  return d.at(c10::IValue(key)).toTensor();
}

constexpr int kParams = 4, kSteps = 20;

// Runs `opt` (built over fresh copies of the case's initial parameters by `make`) through the
// case's 20 steps and compares parameters and state with PyTorch's, bit for bit: both call the
// same ATen kernel on the same inputs.
template <class Make>
void replay(const std::string& name, Make make, const std::vector<std::string>& fields) {
  std::vector<torch::Tensor> params;
  for (int i = 0; i < kParams; ++i)
    params.push_back(entry(name + "/param/" + std::to_string(i)).clone().set_requires_grad(true));
  auto opt = make(params);
  const auto lr = entry(name + "/lr"), skip = entry(name + "/skip");
  for (int s = 0; s < kSteps; ++s) {
    keel::set_lr(*opt, lr[s].item<double>());
    for (int i = 0; i < kParams; ++i)
      params[static_cast<size_t>(i)].mutable_grad() =
          entry(name + "/grad/" + std::to_string(s) + "/" + std::to_string(i)).clone();
    opt->step_unless(skip[s].item<int64_t>() ? torch::ones({}, torch::kFloat) : torch::zeros({}, torch::kFloat));
  }
  NamedTensorList named;
  for (int i = 0; i < kParams; ++i) named.emplace_back(std::to_string(i), params[static_cast<size_t>(i)]);
  std::map<std::string, torch::Tensor> state;
  for (const auto& [n, t] : keel::optimizer_state(*opt, named)) state[n] = t;
  for (int i = 0; i < kParams; ++i) {
    const auto& p = params[static_cast<size_t>(i)];
    const auto want = entry(name + "/final/" + std::to_string(i));
    EXPECT_TRUE(torch::equal(p.detach(), want))
        << name << " parameter " << i << ": max abs diff " << (p.detach() - want).abs().max().item<double>();
    for (const auto& f : fields) {
      const auto want_state = entry(name + "/" + f + "/" + std::to_string(i));
      const auto got = state.at(std::to_string(i) + "." + f);
      if (f == "step") {  // PyTorch keeps a float32 count; keel's checkpoint an int64
        EXPECT_EQ(got.item<int64_t>(), static_cast<int64_t>(want_state.item<double>())) << name << " step of " << i;
        EXPECT_EQ(got.scalar_type(), torch::kLong);
      } else {
        EXPECT_TRUE(torch::equal(got, want_state)) << name << " " << f << " of " << i;
      }
    }
  }
}

TEST(FusedOptimizer, AdamWIsPyTorchsFusedAdamWBitForBit) {
  replay("adamw",
         [](const std::vector<torch::Tensor>& p) {
           return std::make_unique<keel::FusedAdamW>(
               p, torch::optim::AdamWOptions(1e-2).betas({0.8, 0.95}).eps(1e-6).weight_decay(0.1));
         },
         {"step", "exp_avg", "exp_avg_sq"});
}

TEST(FusedOptimizer, SgdIsPyTorchsFusedSgdBitForBit) {
  replay("sgd",
         [](const std::vector<torch::Tensor>& p) {
           return std::make_unique<keel::FusedSgd>(p, torch::optim::SGDOptions(1e-2).momentum(0.9).weight_decay(0.05));
         },
         {"momentum_buffer"});
  replay("sgd_plain",
         [](const std::vector<torch::Tensor>& p) {
           return std::make_unique<keel::FusedSgd>(p, torch::optim::SGDOptions(1e-2).momentum(0.0));
         },
         {});
}

// The train config builds them, and train.fused_optimizer = false the loop optimizers.
TEST(FusedOptimizer, MadeFromTheTrainConfig) {
  std::vector<torch::Tensor> p{torch::zeros({2}, torch::requires_grad())};
  keel::TrainConfig c;
  EXPECT_NE(dynamic_cast<keel::FusedAdamW*>(keel::make_optimizer(c, p).get()), nullptr);
  c.optimizer = "sgd";
  EXPECT_NE(dynamic_cast<keel::FusedSgd*>(keel::make_optimizer(c, p).get()), nullptr);
  c.fused_optimizer = false;
  EXPECT_NE(dynamic_cast<torch::optim::SGD*>(keel::make_optimizer(c, p).get()), nullptr);
  c.optimizer = "adamw";
  EXPECT_NE(dynamic_cast<torch::optim::AdamW*>(keel::make_optimizer(c, p).get()), nullptr);
}

// A first step skipped by found_inf leaves SGD's momentum at zero (PyTorch's fused SGD leaves it
// uninitialised; tests/golden/make_optim_golden.py): the run goes on as if the step never was,
// like the loop optimizer that was never called.
TEST(FusedOptimizer, AFirstStepSkippedLeavesEverythingAsItWas) {
  for (const std::string kind : {"sgd", "adamw"}) {
    keel::TrainConfig c;
    c.optimizer = kind;
    c.lr = 0.1;
    c.weight_decay = 0.01;
    torch::manual_seed(7);
    const auto init = torch::randn({16});
    auto fused_p = init.clone().set_requires_grad(true), loop_p = init.clone().set_requires_grad(true);
    auto fused = keel::make_optimizer(c, {fused_p});
    c.fused_optimizer = false;
    auto loop = keel::make_optimizer(c, {loop_p});
    auto* f = dynamic_cast<keel::FusedOptimizer*>(fused.get());
    ASSERT_NE(f, nullptr);
    fused_p.mutable_grad() = torch::full({16}, 1e3);
    f->step_unless(torch::ones({1}, torch::kFloat));
    EXPECT_TRUE(torch::equal(fused_p.detach(), init)) << "a skipped step changed the parameters";
    for (int s = 0; s < 5; ++s) {
      const auto g = torch::randn({16});
      fused_p.mutable_grad() = g.clone();
      loop_p.mutable_grad() = g.clone();
      f->step_unless(torch::zeros({1}, torch::kFloat));
      loop->step();
    }
    EXPECT_TRUE(torch::allclose(fused_p.detach(), loop_p.detach(), 1e-5, 1e-6))
        << kind << ": max abs diff " << (fused_p - loop_p).abs().max().item<double>();
    NamedTensorList named{{"w", fused_p}};
    for (const auto& [n, t] : keel::optimizer_state(*fused, named))
      if (n == "w.step") EXPECT_EQ(t.item<int64_t>(), 5) << "the skipped step was counted";
  }
}

// Old checkpoints load: the state of torch::optim's loop AdamW and SGD loads into the fused ones
// and back, with the same names, dtypes and shapes, and the runs continue alike.
TEST(FusedOptimizer, StateIsInterchangeableWithTheLoopOptimizers) {
  for (const std::string kind : {"adamw", "sgd"}) {
    keel::TrainConfig c;
    c.optimizer = kind;
    c.weight_decay = 0.01;
    torch::manual_seed(11);
    const auto init = torch::randn({3, 5});
    auto a = init.clone().set_requires_grad(true), b = init.clone().set_requires_grad(true);
    c.fused_optimizer = false;
    auto loop = keel::make_optimizer(c, {a});
    c.fused_optimizer = true;
    auto fused = keel::make_optimizer(c, {b});
    std::vector<torch::Tensor> grads;
    for (int s = 0; s < 6; ++s) grads.push_back(torch::randn({3, 5}));
    for (int s = 0; s < 3; ++s) {
      a.mutable_grad() = grads[static_cast<size_t>(s)].clone();
      loop->step();
    }
    const NamedTensorList pa{{"w", a}}, pb{{"w", b}};
    const auto saved = keel::optimizer_state(*loop, pa);
    {
      torch::NoGradGuard ng;
      b.copy_(a);
    }
    keel::load_optimizer_state(*fused, pb, saved);  // a loop checkpoint into the fused optimizer
    const auto reloaded = keel::optimizer_state(*fused, pb);
    ASSERT_EQ(reloaded.size(), saved.size());
    for (size_t k = 0; k < saved.size(); ++k) {
      EXPECT_EQ(reloaded[k].first, saved[k].first);
      EXPECT_EQ(reloaded[k].second.scalar_type(), saved[k].second.scalar_type()) << saved[k].first;
      EXPECT_TRUE(torch::equal(reloaded[k].second, saved[k].second)) << saved[k].first;
    }
    EXPECT_EQ(keel::optimizer_fields(*fused), keel::optimizer_fields(*loop));
    for (int s = 3; s < 6; ++s) {
      a.mutable_grad() = grads[static_cast<size_t>(s)].clone();
      b.mutable_grad() = grads[static_cast<size_t>(s)].clone();
      loop->step();
      fused->step();
    }
    EXPECT_TRUE(torch::allclose(a.detach(), b.detach(), 1e-5, 1e-6)) << (a - b).abs().max().item<double>();
    // And back: the fused optimizer's state into a loop optimizer.
    auto c2 = init.clone().set_requires_grad(true);
    c.fused_optimizer = false;
    auto loop2 = keel::make_optimizer(c, {c2});
    keel::load_optimizer_state(*loop2, {{"w", c2}}, keel::optimizer_state(*fused, pb));
    const auto back = keel::optimizer_state(*loop2, {{"w", c2}});
    const auto fused_state = keel::optimizer_state(*fused, pb);
    ASSERT_EQ(back.size(), fused_state.size());
    for (size_t k = 0; k < back.size(); ++k) EXPECT_TRUE(torch::equal(back[k].second, fused_state[k].second));
  }
}

std::shared_ptr<keel::dist::Collectives> solo() {
  static auto c = std::make_shared<keel::dist::Collectives>(
      keel::dist::Group::create(keel::dist::World{}, keel::DistConfig{}, torch::kCPU), keel::Validate::Always);
  return c;
}

// Clipping: the norm and the clipped gradients of torch::nn::utils::clip_grad_norm_ (the loop
// over parameters), from one _foreach_norm and one _foreach_mul_; the norm stays a tensor.
TEST(ClipGradNorm, IsTorchsClipGradNormWithForeachOps) {
  for (const double max_norm : {0.5, 1e6}) {  // clipped, and not (coefficient clamped to 1)
    torch::manual_seed(3);
    keel::models::NamedTensors ours;
    std::vector<torch::Tensor> theirs;
    for (const auto& shape : std::vector<std::vector<int64_t>>{{4, 4}, {7}, {2, 3, 5}}) {
      auto p = torch::zeros(shape, torch::requires_grad()), q = torch::zeros(shape, torch::requires_grad());
      const auto g = torch::randn(shape);
      p.mutable_grad() = g.clone();
      q.mutable_grad() = g.clone();
      ours.emplace_back("p" + std::to_string(ours.size()), p);
      theirs.push_back(q);
    }
    const std::vector<int64_t> owner(ours.size(), 0);
    const torch::Tensor norm = keel::dist::clip_grad_norm(ours, owner, *solo(), max_norm, /*sharded=*/false);
    const double want = torch::nn::utils::clip_grad_norm_(theirs, max_norm);
    EXPECT_EQ(norm.dim(), 0);
    EXPECT_NEAR(norm.item<double>(), want, 1e-6 * want);
    for (size_t i = 0; i < ours.size(); ++i)
      EXPECT_TRUE(torch::allclose(ours[i].second.grad(), theirs[i].grad(), 1e-6, 1e-7)) << max_norm << " " << i;
  }
}

// The multi-tensor inf/NaN check reads every gradient and changes none.
TEST(NonfiniteCheck, FindsInfAndNanAndLeavesGradientsAlone) {
  std::vector<torch::Tensor> params;
  for (int i = 0; i < 3; ++i) {
    params.push_back(torch::zeros({5}, torch::requires_grad()));
    params.back().mutable_grad() = torch::randn({5});
  }
  params.push_back(torch::zeros({2}, torch::requires_grad()));  // no gradient: skipped
  std::vector<torch::Tensor> before;
  for (int i = 0; i < 3; ++i) before.push_back(params[static_cast<size_t>(i)].grad().clone());
  EXPECT_EQ(keel::amp::nonfinite(params).item<float>(), 0.0f);
  for (int i = 0; i < 3; ++i)
    EXPECT_TRUE(torch::equal(params[static_cast<size_t>(i)].grad(), before[static_cast<size_t>(i)]));
  params[1].mutable_grad()[3] = std::numeric_limits<float>::infinity();
  EXPECT_EQ(keel::amp::nonfinite(params).item<float>(), 1.0f);
  params[1].mutable_grad()[3] = 0.0f;
  params[2].mutable_grad()[0] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(keel::amp::nonfinite(params).item<float>(), 1.0f);
  EXPECT_EQ(keel::amp::nonfinite({params[3]}).item<float>(), 0.0f);
}

}  // namespace
