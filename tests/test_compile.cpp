// The compile stage (compile.mode = trace): each known pitfall reproduced by a small model.
#include <gtest/gtest.h>

#include <sys/stat.h>
#include <cstdio>

#include <torch/library.h>
#include <fstream>

#include <nlohmann/json.hpp>

#include "helpers.h"
#include "keel/models/model.h"
#include "trainer/compile/compile.h"
#include "trainer/compile/compile_cache.h"

using keel::CompileConfig;
using keel::CompileError;
using keel::CompileReport;

namespace {

// A small C++ module whose forward is given as a lambda.
struct LambdaImpl : torch::nn::Module {
  using Fn = std::function<torch::Tensor(LambdaImpl&, const torch::Tensor&)>;
  explicit LambdaImpl(Fn fn) : fn(std::move(fn)) { fc = register_module("fc", torch::nn::Linear(8, 4)); }
  torch::Tensor forward(const torch::Tensor& x) { return fn(*this, x); }
  Fn fn;
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(Lambda);

std::shared_ptr<keel::models::Model> make(LambdaImpl::Fn fn) {
  return std::make_shared<keel::models::ModuleModel<Lambda>>(
      "test", Lambda(std::move(fn)), keel::models::InputSpec{keel::models::InputKind::Image, {8}, 4});
}

CompileConfig trace_cfg(bool fullgraph = false) {
  CompileConfig c;
  c.mode = keel::CompileMode::Trace;
  c.fullgraph = fullgraph;
  return c;
}

std::string compile_error(std::shared_ptr<keel::models::Model> m, const CompileConfig& cfg) {
  CompileReport r;
  try {
    keel::compile_model(m, cfg, torch::randn({5, 8}, at::detail::createCPUGenerator(42)), r);
  } catch (const CompileError& e) {
    return e.what();
  }
  return "";
}

TEST(Compile, TracesAndTrainsLikeEager) {
  torch::manual_seed(0);
  auto m = make([](LambdaImpl& s, const torch::Tensor& x) { return torch::relu(s.fc->forward(x)) * 2; });
  CompileReport r;
  auto traced = keel::compile_model(m, trace_cfg(true), torch::randn({5, 8}), r);
  EXPECT_NE(traced.get(), m.get());
  EXPECT_EQ(r.mode, "trace");
  auto x = torch::randn({5, 8});
  auto eager_out = m->forward(x);
  auto graph_out = traced->forward(x);
  EXPECT_TRUE(torch::allclose(eager_out, graph_out));
  // Gradients through the graph equal eager gradients.
  graph_out.sum().backward();
  std::vector<torch::Tensor> g_graph;
  for (auto& p : m->parameters()) g_graph.push_back(p.grad().clone()), p.mutable_grad() = torch::Tensor();
  m->forward(x).sum().backward();
  auto params = m->parameters();
  for (size_t i = 0; i < params.size(); ++i) EXPECT_TRUE(torch::allclose(params[i].grad(), g_graph[i]));
}

// a. data-dependent control flow
TEST(Compile, GraphBreakFromDataDependentBranch) {
  torch::manual_seed(3);
  auto m = make([](LambdaImpl& s, const torch::Tensor& x) {
    auto h = s.fc->forward(x);
    return h.sum().item<double>() > 0 ? h * 2 : h - 1;  // the value steers the trace
  });
  auto msg = compile_error(m, trace_cfg(true));
  EXPECT_NE(msg.find("graph break"), std::string::npos) << msg;
  CompileReport r;
  auto out = keel::compile_model(m, trace_cfg(false), torch::randn({5, 8}, at::detail::createCPUGenerator(42)), r);
  EXPECT_EQ(out.get(), m.get());  // eager fallback
  EXPECT_EQ(r.mode, "eager-fallback");
}

// b. computation the tracer cannot see
TEST(Compile, UntraceableRawPointerArithmetic) {
  auto m = make([](LambdaImpl& s, const torch::Tensor& x) {
    auto h = s.fc->forward(x).detach().clone();
    float* p = h.data_ptr<float>();  // invisible to the tracer
    for (int64_t i = 0; i < h.numel(); ++i) p[i] = p[i] * p[i];
    return h + s.fc->forward(x);
  });
  auto msg = compile_error(m, trace_cfg(true));
  EXPECT_NE(msg.find("untraceable computation"), std::string::npos) << msg;
}

// b'. a custom op registered with the dispatcher (with a schema) traces and trains.
TORCH_LIBRARY(keel_test, m) { m.def("scaled_tanh(Tensor x, float s) -> Tensor"); }
TORCH_LIBRARY_IMPL(keel_test, CompositeImplicitAutograd, m) {
  m.impl("scaled_tanh", [](const torch::Tensor& x, double s) { return torch::tanh(x) * s; });
}
torch::Tensor scaled_tanh(const torch::Tensor& x, double s) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("keel_test::scaled_tanh", "")
                       .typed<torch::Tensor(const torch::Tensor&, double)>();
  return op.call(x, s);
}

TEST(Compile, CustomOpWithSchemaTracesAndTrains) {
  torch::manual_seed(1);
  auto m = make([](LambdaImpl& s, const torch::Tensor& x) { return scaled_tanh(s.fc->forward(x), 3.0); });
  CompileReport r;
  auto traced = keel::compile_model(m, trace_cfg(true), torch::randn({16, 8}), r);
  ASSERT_EQ(r.mode, "trace");
  auto x = torch::randn({16, 8});
  auto target = torch::randint(0, 4, {16});
  torch::optim::SGD opt(m->parameters(), 0.5);
  double first = 0, last = 0;
  for (int i = 0; i < 30; ++i) {
    opt.zero_grad();
    auto loss = torch::nn::functional::cross_entropy(traced->forward(x), target);
    loss.backward();
    opt.step();
    (i == 0 ? first : last) = loss.item<double>();
  }
  EXPECT_LT(last, first);
}

// c. non-deterministic ops
TEST(Compile, NondeterministicOpsWarnOrFail) {
  auto m = make([](LambdaImpl& s, const torch::Tensor& x) { return torch::dropout(s.fc->forward(x), 0.5, true); });
  CompileReport r;
  keel::compile_model(m, trace_cfg(), torch::randn({5, 8}), r);
  ASSERT_FALSE(r.warnings.empty());
  EXPECT_NE(r.warnings.back().find("aten::dropout"), std::string::npos) << r.warnings.back();
  CompileConfig strict = trace_cfg();
  strict.deterministic = true;
  auto msg = compile_error(m, strict);
  EXPECT_NE(msg.find("compile.deterministic"), std::string::npos) << msg;
  EXPECT_NE(msg.find("aten::dropout"), std::string::npos) << msg;
}

// d. shape guards
TEST(Compile, ReSpecialisesPerShapeUpToTheCap) {
  auto m = make([](LambdaImpl& s, const torch::Tensor& x) { return s.fc->forward(x); });
  CompileConfig cfg = trace_cfg();
  cfg.max_recompiles = 2;
  CompileReport r;
  auto traced = keel::compile_model(m, cfg, torch::randn({5, 8}), r);
  traced->forward(torch::randn({5, 8}));
  EXPECT_EQ(r.recompiles, 0);
  auto y = traced->forward(torch::randn({3, 8}));
  EXPECT_EQ(y.sizes(), (std::vector<int64_t>{3, 4}));
  EXPECT_EQ(r.recompiles, 1);
  traced->forward(torch::randn({3, 8}));  // seen before: no recompile
  traced->forward(torch::randn({2, 8}));
  EXPECT_EQ(r.recompiles, 2);
  try {
    traced->forward(torch::randn({1, 8}));
    FAIL() << "expected a recompilation storm";
  } catch (const CompileError& e) {
    EXPECT_NE(std::string(e.what()).find("recompilation storm"), std::string::npos) << e.what();
  }
}

// e. device transfers inside forward
TEST(Compile, DeviceTransferInsideForward) {
  auto m = make([](LambdaImpl& s, const torch::Tensor& x) { return s.fc->forward(x.to(torch::Device(torch::kCPU))); });
  auto msg = compile_error(m, trace_cfg(true));
  EXPECT_NE(msg.find("device transfer inside forward"), std::string::npos) << msg;
}

// The persistent cache: miss, hit, and a corrupt entry detected and rebuilt.
TEST(CompileCache, MissThenHitThenCorruptEntryIsRebuilt) {
  keel::testing::TempDir d;
  torch::manual_seed(0);
  auto m = make([](LambdaImpl& s, const torch::Tensor& x) { return torch::tanh(s.fc->forward(x)); });
  CompileConfig cfg = trace_cfg(true);
  cfg.cache_dir = d.file("cache");
  const auto example = torch::randn({5, 8});
  auto compile = [&](const std::string& expect) {
    CompileReport r;
    auto traced = keel::compile_model(m, cfg, example, r, "lambda-tanh");
    EXPECT_EQ(r.cache, expect);
    auto x = torch::randn({5, 8});
    EXPECT_TRUE(torch::allclose(traced->forward(x), m->forward(x)));
    return traced;
  };
  compile("miss");
  const std::string entry =
      keel::CompileCache(cfg.cache_dir).entry_path(keel::compile_cache_key("lambda-tanh", cfg, example, "off"));
  ASSERT_TRUE(keel::testing::exists(entry));
  auto traced = compile("hit");
  // Training through a graph loaded from the cache reaches the parameters.
  traced->forward(torch::randn({5, 8})).sum().backward();
  for (auto& p : m->parameters()) EXPECT_TRUE(p.grad().defined());
  // Cut the entry in half: detected, removed, traced again and republished.
  const std::string bytes = keel::testing::read_text(entry);
  keel::testing::write_text(entry, bytes.substr(0, bytes.size() / 2));
  compile("miss");
  compile("hit");
  // Issue 64: an entry is read only with the SHA-256 written beside it. Another entry's bytes put
  // in its place (a loadable TorchScript file), or its checksum file gone: rebuilt, never loaded.
  ASSERT_TRUE(keel::testing::exists(entry + ".sha256"));
  CompileConfig other = cfg;
  other.fullgraph = !cfg.fullgraph;
  CompileReport r;
  keel::compile_model(m, other, example, r, "lambda-tanh");
  const std::string other_entry =
      keel::CompileCache(cfg.cache_dir).entry_path(keel::compile_cache_key("lambda-tanh", other, example, "off"));
  ASSERT_NE(other_entry, entry);
  keel::testing::write_text(entry, keel::testing::read_text(other_entry));
  compile("miss");
  std::remove((entry + ".sha256").c_str());
  compile("miss");
  compile("hit");
}

TEST(CompileCache, KeyCoversShapeConfigAndModel) {
  CompileConfig a = trace_cfg(false), b = trace_cfg(true);
  const auto x = torch::randn({5, 8});
  const auto k = keel::compile_cache_key("m", a, x, "off");
  EXPECT_EQ(k, keel::compile_cache_key("m", a, x.clone(), "off"));
  EXPECT_NE(k, keel::compile_cache_key("m", a, torch::randn({6, 8}), "off"));
  EXPECT_NE(k, keel::compile_cache_key("m", a, x.to(torch::kDouble), "off"));
  EXPECT_NE(k, keel::compile_cache_key("m", b, x, "off"));
  EXPECT_NE(k, keel::compile_cache_key("m2", a, x, "off"));
  EXPECT_NE(k, keel::compile_cache_key("m", a, x, "bf16"));
  EXPECT_EQ(keel::sha256_hex("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
}

TEST(CompileCache, SecondRunOfTheBinaryHits) {
  keel::testing::TempDir d;
  std::string cache[2];
  double loss[2];
  for (int i = 0; i < 2; ++i) {
    const std::string dir = d.file("run" + std::to_string(i));
    auto r = keel::testing::run_keel({"train", "--model.name=mlp", "--data.name=synthetic", "--train.steps=5",
                                      "--compile.mode=trace", "--compile.cache_dir=" + d.file("cache"),
                                      "--run.threads=1", "--run.dir=" + dir});
    ASSERT_EQ(r.exit_code, 0) << r.output;
    auto s = nlohmann::json::parse(keel::testing::read_text(dir + "/summary.json"));
    cache[i] = s["compile_cache"];
    loss[i] = s["final_loss"];
  }
  EXPECT_EQ(cache[0], "miss");
  EXPECT_EQ(cache[1], "hit");
  EXPECT_EQ(loss[0], loss[1]);  // the same graph, the same kernels: bit-identical
}

// A rebuilt binary (its models' code may have changed: a registered C++ model's relu turned
// into tanh) never gets the graph the old binary cached. The "rebuild" here is a copy of keel
// with one byte appended (ELF ignores trailing bytes): other code, same everything else.
TEST(CompileCache, AnotherBuildOfTheCodeMisses) {
  keel::testing::TempDir d;
  const std::string rebuilt = d.file("keel-rebuilt");
  {
    std::ifstream in(KEEL_BINARY, std::ios::binary);
    std::ofstream out(rebuilt, std::ios::binary);
    out << in.rdbuf() << '\n';
  }
  ASSERT_EQ(::chmod(rebuilt.c_str(), 0755), 0);
  std::string cache[3];
  int i = 0;
  for (const std::string& exe : {std::string(KEEL_BINARY), std::string(KEEL_BINARY), rebuilt}) {
    const std::string dir = d.file("run" + std::to_string(i));
    auto r = keel::testing::run_process({exe, "train", "--model.name=mlp", "--data.name=synthetic", "--train.steps=3",
                                         "--compile.mode=trace", "--compile.cache_dir=" + d.file("cache"),
                                         "--run.threads=1", "--run.dir=" + dir});
    ASSERT_EQ(r.exit_code, 0) << r.output;
    cache[i++] = nlohmann::json::parse(keel::testing::read_text(dir + "/summary.json"))["compile_cache"];
  }
  EXPECT_EQ(cache[0], "miss");
  EXPECT_EQ(cache[1], "hit");
  EXPECT_EQ(cache[2], "miss");
}

// trace and off give the same final loss on the cnn after 20 steps.
TEST(Compile, TraceAndOffAgreeOnCnnAfter20Steps) {
  keel::testing::TempDir d;
  double loss[2];
  int i = 0;
  for (const char* mode : {"off", "trace"}) {
    auto r = keel::testing::run_keel({"train", "--model.name=cnn", "--data.name=synthetic", "--train.steps=20",
                                      "--train.batch_size=16", "--compile.mode=" + std::string(mode), "--run.threads=1",
                                      "--run.dir=" + d.file(mode)});
    ASSERT_EQ(r.exit_code, 0) << r.output;
    auto s = nlohmann::json::parse(keel::testing::read_text(d.file(std::string(mode) + "/summary.json")));
    EXPECT_EQ(s["compile_mode"], mode);
    loss[i++] = s["final_loss"].get<double>();
  }
  // Tolerance: the graph runs the same ATen kernels in the same order as eager, so the losses
  // agree to float32 rounding; 1e-4 relative allows for kernel selection differences.
  EXPECT_NEAR(loss[0], loss[1], 1e-4 * std::abs(loss[0])) << "off " << loss[0] << " trace " << loss[1];
}

}  // namespace
