// amp/: the GradScaler's exact scale sequence, unscale rules, autocast with and without the
// compile stage, and a 2-rank run in which only rank 1 sees an inf.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "amp/autocast.h"
#include "amp/grad_scaler.h"
#include "helpers.h"
#include "keel/trainer/trainer.h"
#include "multirank.h"
#include "trainer/compile/compile.h"

using keel::amp::GradScaler;
using namespace keel::testing;

namespace {

keel::AmpConfig amp_cfg(double init, int64_t interval) {
  keel::AmpConfig a;
  a.loss_scaling = keel::LossScaling::Dynamic;
  a.init_scale = init;
  a.growth_interval = interval;
  return a;  // growth 2.0, backoff 0.5: PyTorch's defaults
}

TEST(GradScaler, ExactScaleSequenceForAScriptedPattern) {
  GradScaler s(amp_cfg(4.0, 3));
  // Each entry: the step's verdict (true = inf/NaN), then the scale and tracker after update().
  struct Step {
    bool inf;
    double scale;
    int64_t tracker;
    const char* why;
  };
  const Step steps[] = {
      {false, 4, 1, "clean step 1 of 3"},
      {false, 4, 2, "clean step 2 of 3"},
      {false, 8, 0, "3rd clean step in a row: grow x2, tracker resets"},
      {true, 4, 0, "inf: back off x0.5, tracker resets (step skipped)"},
      {false, 4, 1, "clean step 1 of 3 again"},
      {true, 2, 0, "NaN: back off again; growth needs 3 clean steps from scratch"},
      {false, 2, 1, "1 of 3"},
      {false, 2, 2, "2 of 3"},
      {false, 4, 0, "grow x2"},
      {false, 4, 1, "1 of 3"},
  };
  for (const auto& st : steps) {
    s.update(st.inf);
    EXPECT_EQ(s.scale_value(), st.scale) << st.why;
    EXPECT_EQ(s.state().growth_tracker, st.tracker) << st.why;
  }
}

TEST(GradScaler, DefaultsArePyTorchs) {
  GradScaler s{keel::AmpConfig{}};
  EXPECT_EQ(s.state().scale, 65536.0);
  EXPECT_EQ(s.state().growth_factor, 2.0);
  EXPECT_EQ(s.state().backoff_factor, 0.5);
  EXPECT_EQ(s.state().growth_interval, 2000);
}

TEST(GradScaler, GrowsOnlyWhenTheGrownScaleIsFinite) {
  GradScaler s(amp_cfg(3e38, 1));  // 6e38 overflows float32
  s.update(false);
  EXPECT_EQ(s.scale_value(), static_cast<float>(3e38));
  EXPECT_EQ(s.state().growth_tracker, 0);
}

TEST(GradScaler, UnscaleDividesAndDetectsNonFinite) {
  GradScaler s(amp_cfg(3.0, 100));
  auto w = torch::zeros({3}, torch::requires_grad());
  w.mutable_grad() = torch::tensor({3.0f, 6.0f, 1.5f});
  EXPECT_FALSE(s.unscale_({w}));
  // The inverse scale is 1/3 computed in double, then applied in float32 (as PyTorch).
  const float inv = static_cast<float>(1.0 / 3.0);
  EXPECT_EQ(w.grad()[1].item<float>(), 6.0f * inv);
  // A second unscale in the same step is an error.
  EXPECT_THROW(s.unscale_({w}), std::logic_error);
  s.update(false);
  w.mutable_grad() = torch::tensor({1.0f, std::numeric_limits<float>::infinity(), 0.0f});
  EXPECT_TRUE(s.unscale_({w}));
  s.update(true);
  w.mutable_grad() = torch::tensor({std::nanf(""), 1.0f, 0.0f});
  EXPECT_TRUE(s.unscale_({w}));
}

TEST(GradScaler, FusedKernelOnlyWhereTheDispatcherHasOne) {
  EXPECT_TRUE(GradScaler::has_fused_unscale(c10::DeviceType::CPU));  // CPU kernels exist from 2.3
}

TEST(Autocast, Bf16OnCpuAndNesting) {
  auto a = torch::randn({4, 4}), b = torch::randn({4, 4});
  {
    keel::amp::Autocast outer(c10::DeviceType::CPU, c10::kBFloat16);
    EXPECT_EQ(torch::matmul(a, b).scalar_type(), c10::kBFloat16);
    {
      keel::amp::Autocast inner(c10::DeviceType::CPU, c10::kBFloat16);
      EXPECT_EQ(torch::mm(a, b).scalar_type(), c10::kBFloat16);
    }
    EXPECT_TRUE(at::autocast::is_autocast_enabled(c10::DeviceType::CPU));
  }
  EXPECT_FALSE(at::autocast::is_autocast_enabled(c10::DeviceType::CPU));
  EXPECT_EQ(torch::matmul(a, b).scalar_type(), c10::kFloat);
}

// Trace under autocast: the casts are part of the graph, so trace + bf16 matches eager + bf16.
TEST(Autocast, TraceAndEagerAgreeUnderBf16) {
  torch::manual_seed(0);
  keel::ModelConfig mc;
  mc.name = "cnn";
  auto m = keel::models::create_model(mc);
  keel::CompileConfig cc;
  cc.mode = keel::CompileMode::Trace;
  cc.fullgraph = true;
  keel::CompileReport r;
  auto x = torch::randn({8, 1, 28, 28});
  std::shared_ptr<keel::models::Model> traced;
  {
    keel::amp::Autocast ac(c10::DeviceType::CPU, c10::kBFloat16);
    traced = keel::compile_model(m, cc, x, r);
  }
  ASSERT_EQ(r.mode, "trace");
  auto target = torch::randint(0, 10, {8});
  auto run = [&](keel::models::Model& model) {
    for (auto& p : m->parameters()) p.mutable_grad() = torch::Tensor();
    keel::amp::Autocast ac(c10::DeviceType::CPU, c10::kBFloat16);
    auto out = model.forward(x);
    EXPECT_EQ(out.scalar_type(), c10::kBFloat16);
    torch::nn::functional::cross_entropy(out.to(torch::kFloat), target).backward();
    std::vector<torch::Tensor> grads;
    for (auto& p : m->parameters()) grads.push_back(p.grad().clone());
    return std::make_pair(out.to(torch::kFloat), grads);
  };
  auto [eager_out, eager_grads] = run(*m);
  auto [graph_out, graph_grads] = run(*traced);
  // Tolerance: both run the same bf16 kernels; bf16 has an 8-bit mantissa (relative step
  // 2^-8 = 0.4%), so any kernel-order difference shows at that scale: rtol 1e-2, atol 1e-2.
  EXPECT_TRUE(torch::allclose(eager_out, graph_out, 1e-2, 1e-2)) << (eager_out - graph_out).abs().max();
  for (size_t i = 0; i < eager_grads.size(); ++i)
    EXPECT_TRUE(torch::allclose(eager_grads[i], graph_grads[i], 1e-2, 1e-2)) << i;
}

// Only rank 1 sees an inf at its 5th forward: both ranks skip that step, parameters stay equal.
struct InfOnceImpl : torch::nn::Module {
  InfOnceImpl() { fc = register_module("fc", torch::nn::Linear(784, 10)); }
  torch::Tensor forward(const torch::Tensor& x) {
    auto y = fc->forward(x.flatten(1));
    const char* rank = std::getenv("RANK");
    if (++calls == 5 && rank && std::string(rank) == "1") y = y * std::numeric_limits<float>::infinity();
    return y;
  }
  int calls = 0;
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(InfOnce);

TEST(AmpDist, OnlyRankOneSeesInfAndBothRanksSkip) {
  TempDir d;
  auto ranks = run_ranks(
      2,
      [](const keel::dist::World& w) {
        keel::models::register_model("inf_once", [](const keel::ModelConfig&, std::optional<keel::models::InputKind>) {
          return std::make_shared<keel::models::ModuleModel<InfOnce>>(
              "inf_once", InfOnce(), keel::models::InputSpec{keel::models::InputKind::Image, {1, 28, 28}, 10});
        });
        TempDir rd;
        keel::Config cfg;
        cfg.run.dir = rd.file("run");
        cfg.run.threads = 1;
        cfg.model.name = "inf_once";
        cfg.data.name = "synthetic";
        cfg.data.synthetic_size = 512;
        cfg.train.steps = 20;
        cfg.train.batch_size = 16;
        cfg.amp.loss_scaling = keel::LossScaling::Dynamic;
        keel::validate(cfg);
        keel::Callbacks cb;
        cb.on_end = [&](keel::models::Model& m) {
          torch::save(m.parameters(),
                      std::string(std::getenv("KEEL_TEST_OUT")) + "/rank" + std::to_string(w.rank) + ".pt");
        };
        auto summary = keel::Trainer(cfg, w, cb).run();
        EXPECT_EQ(summary.skipped_steps, 1);
        EXPECT_EQ(summary.loss_scale.value_or(0), 32768.0);  // one backoff from 65536
      },
      120, {"KEEL_TEST_OUT=" + d.path()});
  if (is_rank_process()) return;
  expect_all_ok(ranks);
  std::vector<torch::Tensor> p0, p1;
  torch::load(p0, d.file("rank0.pt"));
  torch::load(p1, d.file("rank1.pt"));
  ASSERT_EQ(p0.size(), p1.size());
  for (size_t i = 0; i < p0.size(); ++i) {
    EXPECT_TRUE(torch::equal(p0[i], p1[i])) << "parameter " << i << " differs across ranks";
    EXPECT_TRUE(torch::isfinite(p0[i]).all().item<bool>());
  }
}

}  // namespace

namespace {

// bf16 training of the cnn reaches the test accuracy of fp32 within 0.01 after 400 steps.
TEST(AmpEndToEnd, Bf16CnnMatchesFp32AccuracyAfter400Steps) {
  TempDir d;
  double acc[2];
  int i = 0;
  for (const char* dtype : {"off", "bf16"}) {
    const std::string dir = d.file(dtype);
    auto r = run_keel({"train", "--config", source_path("configs/fashion_mnist_cnn.toml"), "--train.epochs=0",
                       "--train.steps=400", "--train.warmup_steps=40", "--train.eval_interval=400",
                       "--amp.dtype=" + std::string(dtype), "--run.threads=2", "--run.dir=" + dir});
    ASSERT_EQ(r.exit_code, 0) << r.output;
    auto s = nlohmann::json::parse(read_text(dir + "/summary.json"));
    EXPECT_EQ(s["amp_dtype"], dtype);
    acc[i++] = s["test_accuracy"].get<double>();
  }
  EXPECT_GT(acc[0], 0.8);
  EXPECT_NEAR(acc[1], acc[0], 0.01) << "fp32 " << acc[0] << ", bf16 " << acc[1];
}

}  // namespace
