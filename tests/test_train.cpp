// The training loop end to end (through the keel binary), the LR schedule, and launcher
// detection.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <thread>

#include "checkpoint/safetensors.h"
#include "helpers.h"
#include "keel/dist/world.h"
#include "keel/trainer/trainer.h"
#include "multirank.h"
#include "trainer/metrics.h"
#include "trainer/optim.h"

using keel::testing::expect_all_ok;
using keel::testing::is_rank_process;
using keel::testing::run_keel;
using keel::testing::run_ranks;
using keel::testing::TempDir;
using keel::testing::write_token_file;

namespace {

std::vector<nlohmann::json> read_jsonl(const std::string& path) {
  std::vector<nlohmann::json> out;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line))
    if (!line.empty()) out.push_back(nlohmann::json::parse(line));
  return out;
}

TEST(EndToEnd, ShortCnnRunOnFashionMnistLossFalls) {
  TempDir d;
  auto r = run_keel({"train", "--config", keel::testing::source_path("configs/fashion_mnist_cnn.toml"),
                     "--train.epochs=0", "--train.steps=150", "--train.warmup_steps=10", "--train.eval_interval=150",
                     "--data.eval_batch_size=500", "--run.dir=" + d.file("run"), "--run.threads=1"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto metrics = read_jsonl(d.file("run/metrics.jsonl"));
  ASSERT_EQ(metrics.size(), 150u);
  for (const char* k : {"step", "loss", "lr", "step_ms", "samples_per_s"}) EXPECT_TRUE(metrics[0].contains(k)) << k;
  double first = 0, last = 0;
  for (int i = 0; i < 10; ++i) first += metrics[i]["loss"].get<double>() / 10;
  for (int i = 140; i < 150; ++i) last += metrics[i]["loss"].get<double>() / 10;
  EXPECT_LT(last, 0.5 * first) << "loss did not fall: " << first << " -> " << last;
  EXPECT_TRUE(metrics.back().contains("test_accuracy"));

  auto summary = nlohmann::json::parse(keel::testing::read_text(d.file("run/summary.json")));
  for (const char* k : {"world_size", "steps", "median_step_ms", "samples_per_s", "final_loss", "test_accuracy"})
    EXPECT_TRUE(summary.contains(k)) << k;
  EXPECT_EQ(summary["world_size"], 1);
  EXPECT_EQ(summary["steps"], 150);
  EXPECT_GT(summary["test_accuracy"].get<double>(), 0.6);  // 10% is chance
  // The resolved config replays the run.
  EXPECT_TRUE(keel::testing::exists(d.file("run/config.toml")));
  auto replay = run_keel({"train", "--config", d.file("run/config.toml"), "--print-config"});
  EXPECT_EQ(replay.exit_code, 0) << replay.output;
}

TEST(EndToEnd, GptOnTextReportsTokensPerSecond) {
  TempDir d;
  std::string text;
  for (int i = 0; i < 400; ++i) text += "the quick brown fox jumps over the lazy dog. ";
  keel::testing::write_text(d.file("corpus.txt"), text);
  auto r =
      run_keel({"train", "--model.name=gpt", "--model.width=64", "--model.depth=2", "--model.context=32",
                "--data.name=text", "--data.path=" + d.file("corpus.txt"), "--train.steps=60", "--train.batch_size=8",
                "--train.lr=3e-3", "--train.eval_interval=60", "--run.dir=" + d.file("run"), "--run.threads=1"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto summary = nlohmann::json::parse(keel::testing::read_text(d.file("run/summary.json")));
  EXPECT_TRUE(summary.contains("tokens_per_s"));
  EXPECT_LT(summary["final_loss"].get<double>(), 3.0);  // ln(256) = 5.5 at the start
  // The log line says how long is left and how well the hardware is used (MFU against a
  // peak measured at start: gpt reports its FLOPs); summary.json keeps both at the last log.
  EXPECT_NE(r.output.find("| ETA 0m00s"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("% | ETA"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("MFU against a peak of"), std::string::npos) << r.output;
  ASSERT_TRUE(summary["mfu"].is_number()) << summary.dump();
  EXPECT_GT(summary["mfu"].get<double>(), 0.0);
  EXPECT_GT(summary["peak_tflops"].get<double>(), 0.0);
  EXPECT_EQ(summary["eta_s"].get<double>(), 0.0);  // the last step: nothing left
  const auto lines = read_jsonl(d.file("run/metrics.jsonl"));
  ASSERT_EQ(lines.size(), 60u);
  EXPECT_GT(lines[0]["eta_s"].get<double>(), 0.0);
  EXPECT_TRUE(lines[0]["mfu"].is_number());
}

// TensorBoard (run.tensorboard, on by default): rank 0's event files, read back with
// TensorBoard's own reader (the PyPI package in keel's venv) and compared value by value with
// metrics.jsonl: a 2-rank run (per-rank spread) with dynamic loss scaling, clipping and
// evaluations, then a run resumed from step 6 of it, whose redone steps TensorBoard must show
// once, as metrics.jsonl does.
TEST(TensorBoard, TheTensorboardReaderGetsWhatMetricsJsonlHolds) {
  TempDir d;
  std::vector<std::string> args = {"train",
                                   "--model.name=gpt",
                                   "--model.width=32",
                                   "--model.depth=1",
                                   "--model.context=16",
                                   "--data.name=synthetic",
                                   "--train.steps=12",
                                   "--train.batch_size=4",
                                   "--train.eval_interval=5",
                                   "--train.grad_clip=1",
                                   "--amp.loss_scaling=dynamic",
                                   "--run.threads=1",
                                   "--checkpoint.interval=6",
                                   "--checkpoint.dir=" + d.file("ckpt"),
                                   "--run.dir=" + d.file("run")};
  keel::testing::expect_all_ok(keel::testing::run_keel_ranks(2, args));
  args.push_back("--checkpoint.resume_from=" + d.file("ckpt/step_6"));
  keel::testing::expect_all_ok(keel::testing::run_keel_ranks(2, args));
  auto check = keel::testing::run_process(
      {KEEL_PYTHON, keel::testing::source_path("tests/tensorboard_check.py"), d.file("run")}, {}, 120);
  if (check.exit_code == 77) GTEST_SKIP() << check.output;
  EXPECT_EQ(check.exit_code, 0) << check.output;
  std::printf("%s", check.output.c_str());
}

// run.profile_steps: LibTorch's profiler over steps 3-4 on both ranks, a Chrome trace each
// (what Perfetto opens) holding the loop's regions and the gradient all-reduce, for exactly
// those two steps.
TEST(Profiler, TraceOfTheGivenStepsHasTheLoopsRegions) {
  TempDir d;
  keel::testing::expect_all_ok(keel::testing::run_keel_ranks(
      2, {"train", "--model.name=mlp", "--model.width=32", "--model.depth=2", "--data.name=synthetic",
          "--train.steps=6", "--train.batch_size=8", "--train.eval_interval=0", "--run.threads=1",
          "--run.profile_steps=3-4", "--run.dir=" + d.file("run")}));
  for (int rank = 0; rank < 2; ++rank) {
    const std::string path = d.file("run/trace.rank" + std::to_string(rank) + ".json");
    ASSERT_TRUE(keel::testing::exists(path)) << path;
    const auto trace = nlohmann::json::parse(keel::testing::read_text(path));
    ASSERT_TRUE(trace.contains("traceEvents")) << path;
    std::map<std::string, int> count;
    int all_reduce = 0;
    for (const auto& e : trace["traceEvents"]) {
      if (!e.contains("name") || !e["name"].is_string()) continue;
      const std::string n = e["name"];
      ++count[n];
      if (n.find("all_reduce") != std::string::npos || n.find("allreduce") != std::string::npos) ++all_reduce;
    }
    for (const char* region : {"keel::forward", "keel::backward", "keel::consensus", "keel::optimizer"})
      EXPECT_EQ(count[region], 2) << region << " in " << path;  // steps 3 and 4, one micro-batch each
    EXPECT_GT(all_reduce, 0) << "no all-reduce in " << path;
  }
  for (const std::string bad : {"5-3", "x", "0-2", "3-"}) {
    const auto r = run_keel({"train", "--run.profile_steps=" + bad, "--print-config"});
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_NE(r.output.find("run.profile_steps = \"" + bad + "\""), std::string::npos) << r.output;
  }
}

// MFU's denominator can be given (run.peak_tflops): then it is that, and MFU scales with it.
TEST(EndToEnd, GivenPeakIsMfusDenominator) {
  TempDir d;
  auto r =
      run_keel({"train", "--model.name=mlp", "--data.name=synthetic", "--train.steps=10", "--train.batch_size=16",
                "--train.eval_interval=0", "--run.peak_tflops=1e-6", "--run.dir=" + d.file("run"), "--run.threads=1"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto summary = nlohmann::json::parse(keel::testing::read_text(d.file("run/summary.json")));
  EXPECT_EQ(summary["peak_tflops"].get<double>(), 1e-6);
  EXPECT_NE(r.output.find("(run.peak_tflops)"), std::string::npos) << r.output;
  // 1 MFLOP/s of peak: any real run is far above it.
  EXPECT_GT(summary["mfu"].get<double>(), 1.0);
}

TEST(EndToEnd, GradAccumAndSgdOnSynthetic) {
  TempDir d;
  auto r = run_keel({"train", "--model.name=mlp", "--data.name=synthetic", "--train.steps=30", "--train.batch_size=16",
                     "--train.grad_accum=4", "--train.optimizer=sgd", "--train.lr=0.05", "--run.dir=" + d.file("run"),
                     "--run.threads=1"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto summary = nlohmann::json::parse(keel::testing::read_text(d.file("run/summary.json")));
  EXPECT_EQ(summary["global_batch"], 64);
}

// Every value the documented ranges accept starts training (nothing is sized by the planned
// step count): train.steps at 1e10 and train.epochs at 1e9 train until stopped; epochs that
// make more than 1e12 steps are refused up front (exit 2 naming the key).
TEST(EndToEnd, HugePlannedRunsStartAndStopCleanly) {
  for (const std::string option : {"--train.steps=10000000000", "--train.epochs=1000000000"}) {
    TempDir d;
    auto child = keel::testing::spawn_keel({"train", "--model.name=mlp", "--data.name=synthetic", option,
                                            "--run.dir=" + d.file("run"), "--run.threads=1"});
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (std::chrono::steady_clock::now() < deadline && read_jsonl(d.file("run/metrics.jsonl")).size() < 2)
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    kill(child.pid, SIGTERM);
    auto r = keel::testing::wait_process(child, 60);
    EXPECT_EQ(r.exit_code, 128 + SIGTERM) << option << "\n" << r.output;
    auto summary = nlohmann::json::parse(keel::testing::read_text(d.file("run/summary.json")));
    EXPECT_GE(summary["planned_steps"].get<int64_t>(), int64_t{1000000000}) << option;
  }
  TempDir d;
  auto r = keel::testing::run_keel({"train", "--model.name=mlp", "--data.name=synthetic", "--train.epochs=1000000000",
                                    "--train.batch_size=1", "--run.dir=" + d.file("run")});  // 4096 batches an epoch
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("train.epochs = 1000000000 makes more than"), std::string::npos) << r.output;
}

TEST(EndToEnd, SigtermStopsCleanlyAfterTheCurrentStep) {
  TempDir d;
  auto child = keel::testing::spawn_keel({"train", "--model.name=mlp", "--data.name=synthetic", "--train.steps=100000",
                                          "--run.dir=" + d.file("run"), "--run.threads=1"});
  // Wait until it is training.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (std::chrono::steady_clock::now() < deadline && read_jsonl(d.file("run/metrics.jsonl")).size() < 3)
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  kill(child.pid, SIGTERM);
  auto r = keel::testing::wait_process(child, 60);
  EXPECT_FALSE(r.signaled) << r.output;
  EXPECT_EQ(r.exit_code, 128 + SIGTERM) << r.output;
  auto summary = nlohmann::json::parse(keel::testing::read_text(d.file("run/summary.json")));
  EXPECT_FALSE(summary["completed"].get<bool>());
  EXPECT_EQ(summary["stop_signal"], SIGTERM);
  EXPECT_EQ(summary["steps"].get<int64_t>(), static_cast<int64_t>(read_jsonl(d.file("run/metrics.jsonl")).size()));
}

TEST(Schedule, WarmupThenCosineExactValues) {
  keel::TrainConfig t;
  t.lr = 1.0;
  t.min_lr = 0.0;
  t.warmup_steps = 4;
  t.schedule = "cosine";
  keel::LrSchedule s(t, 14);
  EXPECT_DOUBLE_EQ(s.at(0), 0.25);   // (0 + 1) / 4
  EXPECT_DOUBLE_EQ(s.at(3), 1.0);    // end of warmup
  EXPECT_DOUBLE_EQ(s.at(4), 1.0);    // cosine progress 0
  EXPECT_NEAR(s.at(9), 0.5, 1e-12);  // progress 5/10: 0.5 * (1 + cos(pi/2))
  EXPECT_NEAR(s.at(14), 0.0, 1e-12);
  t.schedule = "constant";
  keel::LrSchedule c(t, 14);
  EXPECT_DOUBLE_EQ(c.at(1), 0.5);
  EXPECT_DOUBLE_EQ(c.at(13), 1.0);
}

// The InputError a run of `cfg` stops with, or "(it trained)" when it ran to the end.
std::string input_error_of_run(const keel::Config& cfg) {
  try {
    keel::Trainer(cfg, keel::dist::World{}).run();
  } catch (const keel::InputError& e) {
    return e.what();
  }
  return "(it trained)";
}

// The registries' tests' run: a 16-wide one-layer mlp on 256 synthetic samples, batch 8, one
// thread, no TensorBoard.
keel::Config small_mlp(const std::string& run_dir, int64_t steps, double lr) {
  keel::Config cfg;
  cfg.run.dir = run_dir;
  cfg.run.threads = 1;
  cfg.run.tensorboard = false;
  cfg.model.name = "mlp";
  cfg.model.width = 16;
  cfg.model.depth = 1;
  cfg.data.name = "synthetic";
  cfg.data.synthetic_size = 256;
  cfg.train.steps = steps;
  cfg.train.batch_size = 8;
  cfg.train.lr = lr;
  return cfg;
}

// Extension points (issue 26, item 3): a library user registers a learning-rate schedule and a
// loss by name, as models and datasets are registered, and a config chooses them; a name taken
// (built-ins included) is refused, and an unknown one is refused at start naming the choices.
TEST(Registries, AScheduleAndALossRegisteredByNameTrainAndUnknownNamesAreRefused) {
  keel::register_schedule("halving_every_2", [](int64_t step, int64_t, const keel::TrainConfig& t) {
    return t.lr / static_cast<double>(int64_t{1} << (step / 2));
  });
  int64_t loss_calls = 0;
  keel::register_loss("counted_cross_entropy", [&](const torch::Tensor& out, const torch::Tensor& target) {
    ++loss_calls;
    return torch::nn::functional::cross_entropy(out.reshape({-1, out.size(-1)}), target.reshape({-1}));
  });
  EXPECT_THROW(keel::register_schedule("cosine", nullptr), std::invalid_argument);
  EXPECT_THROW(keel::register_loss("cross_entropy", nullptr), std::invalid_argument);
  const auto schedules = keel::registered_schedules(), losses = keel::registered_losses();
  EXPECT_NE(std::find(schedules.begin(), schedules.end(), "halving_every_2"), schedules.end());
  EXPECT_NE(std::find(losses.begin(), losses.end(), "cross_entropy"), losses.end());

  TempDir d;
  keel::Config cfg = small_mlp(d.file("run"), 6, 0.08);
  cfg.train.eval_interval = 6;
  cfg.train.schedule = "halving_every_2";
  cfg.train.loss = "counted_cross_entropy";
  keel::validate(cfg);
  const keel::Summary s = keel::Trainer(cfg, keel::dist::World{}).run();
  EXPECT_EQ(s.steps, 6);
  EXPECT_GE(loss_calls, 6) << "the registered loss trains (and evaluates)";
  ASSERT_TRUE(s.test_loss.has_value());
  EXPECT_TRUE(std::isfinite(*s.test_loss));
  EXPECT_TRUE(!s.test_accuracy || std::isnan(*s.test_accuracy)) << "a loss other than cross_entropy: no accuracy";
  const auto lines = read_jsonl(d.file("run/metrics.jsonl"));
  ASSERT_EQ(lines.size(), 6u);
  for (size_t i = 0; i < lines.size(); ++i)
    EXPECT_DOUBLE_EQ(lines[i]["lr"].get<double>(), 0.08 / static_cast<double>(int64_t{1} << (i / 2))) << "step " << i;

  cfg.train.schedule = "halving";
  cfg.run.dir = d.file("run2");
  const std::string unknown_schedule = input_error_of_run(cfg);
  EXPECT_NE(unknown_schedule.find("train.schedule = \"halving\" is not a registered schedule; known: "
                                  "constant, cosine, halving_every_2"),
            std::string::npos)
      << unknown_schedule;
  auto unknown_loss = run_keel({"train", "--model.name=mlp", "--data.name=synthetic", "--train.steps=1",
                                "--train.loss=mse", "--run.dir=" + d.file("run3")});
  EXPECT_EQ(unknown_loss.exit_code, 2) << unknown_loss.output;
  EXPECT_NE(unknown_loss.output.find("train.loss = \"mse\" is not a registered loss; known: cross_entropy"),
            std::string::npos)
      << unknown_loss.output;
}

// Issue 64 item 1: a model that cannot train is never silent. A loss that does not reach the
// parameters (the output times zero: every gradient exactly 0) at lr > 0 is said in the log, with
// the step, whether or not train.grad_clip measures the norm (without it the norm is measured on
// the loop's first step and every train.log_interval-th), on the host-decided and the late
// (device-decided) consensus; the same loss at lr = 0, and the default loss, say nothing.
TEST(Registries, ALossThatLeavesEveryGradientZeroAtAPositiveLrIsSaidInTheLog) {
  auto ranks = run_ranks(1, [](const keel::dist::World& w) {
    struct Case {
      const char* name;
      double lr, clip;
      bool zero_loss;
      keel::Consensus consensus;
    };
    for (const Case& c : {Case{"zero_loss", 0.05, 0, true, keel::Consensus::Step},
                          Case{"zero_loss_late_clipped", 0.05, 1.0, true, keel::Consensus::Late},
                          Case{"zero_loss_at_lr_0", 0, 0, true, keel::Consensus::Step},
                          Case{"default_loss", 0.05, 0, false, keel::Consensus::Late}}) {
      TempDir d;
      keel::Config cfg = small_mlp(d.file("run"), 4, c.lr);
      cfg.train.min_lr = 0;
      cfg.train.grad_clip = c.clip;
      cfg.dist.consensus = c.consensus;
      keel::validate(cfg);
      keel::Callbacks cb;
      if (c.zero_loss) cb.loss = [](const torch::Tensor& out, const torch::Tensor&) { return (out * 0.0).sum(); };
      std::fprintf(stderr, "=== case %s\n", c.name);
      std::fflush(stderr);
      EXPECT_EQ(keel::Trainer(cfg, w, cb).run().steps, 4) << c.name;
      std::fflush(stderr);
    }
    std::fprintf(stderr, "=== end\n");
  });
  if (is_rank_process()) return;
  expect_all_ok(ranks);
  const std::string& out = ranks[0].output;
  auto section = [&](const std::string& name) {
    const auto at = out.find("=== case " + name);
    const auto end = out.find("=== ", at + 4);
    return at == std::string::npos ? std::string() : out.substr(at, end - at);
  };
  const std::string warning = "every gradient is exactly zero (global norm 0)";
  for (const char* name : {"zero_loss", "zero_loss_late_clipped"}) {
    const std::string s = section(name);
    EXPECT_NE(s.find("step 1: " + warning), std::string::npos) << name << ":\n" << s;
  }
  for (const char* name : {"zero_loss_at_lr_0", "default_loss"}) {
    const std::string s = section(name);
    EXPECT_FALSE(s.empty()) << name << ":\n" << out;
    EXPECT_EQ(s.find(warning), std::string::npos) << name << ":\n" << s;
  }
}

// A gpt trains on an llm.c token file: each rank's windows come from the sampler, whose position
// is in the checkpoint, so 3 steps + a resume of 3 equal 6 steps bit for bit; data.eval_samples
// bounds an evaluation to the test split's first windows.
TEST(TokenFiles, AGptTrainsOnATokenFileAndResumesBitExactly) {
  TempDir d;
  std::vector<uint32_t> tokens;
  for (uint32_t i = 0; i < 20000; ++i) tokens.push_back((i * 31 + i / 97) % 256);
  write_token_file(d.file("corpus.bin"), tokens, 2, true);
  auto config = [&](const std::string& ckpt, int64_t steps) {
    keel::Config cfg = small_mlp(d.file("run-" + ckpt + "-" + std::to_string(steps)), steps, 0.01);
    cfg.model.name = "gpt";
    cfg.model.width = 32;
    cfg.model.depth = 1;
    cfg.model.heads = 2;
    cfg.model.context = 16;
    cfg.data.name = "tokens";
    cfg.data.path = d.file("corpus.bin");
    cfg.data.eval_samples = 5;
    cfg.train.schedule = "constant";  // the same learning rates whether the run is cut or not
    cfg.train.eval_interval = 3;
    cfg.checkpoint.dir = d.file(ckpt);
    cfg.checkpoint.interval = 3;
    keel::validate(cfg);
    return cfg;
  };
  std::vector<int64_t> evaluated;
  keel::Callbacks cb;
  cb.on_eval = [&](const keel::EvalResult& e) { evaluated.push_back(e.count); };
  const keel::Summary whole = keel::Trainer(config("a", 6), keel::dist::World{}, cb).run();
  EXPECT_EQ(whole.steps, 6);
  EXPECT_EQ(whole.data, "tokens");
  ASSERT_FALSE(evaluated.empty());
  for (const int64_t c : evaluated) EXPECT_EQ(c, 5 * 16) << "data.eval_samples = 5 windows of 16 tokens";
  keel::Trainer(config("b", 3), keel::dist::World{}).run();
  const keel::Summary resumed = keel::Trainer(config("b", 6), keel::dist::World{}).run();
  ASSERT_EQ(resumed.resumed_from_step.value_or(-1), 3);
  EXPECT_EQ(resumed.final_loss, whole.final_loss);
  const auto a = keel::checkpoint::read_safetensors(d.file("a") + "/step_6/model-00001-of-00001.safetensors");
  const auto b = keel::checkpoint::read_safetensors(d.file("b") + "/step_6/model-00001-of-00001.safetensors");
  ASSERT_EQ(a.tensors.size(), b.tensors.size());
  for (size_t i = 0; i < a.tensors.size(); ++i)
    EXPECT_TRUE(torch::equal(a.tensors[i].second, b.tensors[i].second)) << a.tensors[i].first;

  // Two ranks under torchrun, each reading its own windows of the same mapped file.
  auto two = keel::testing::run_torchrun_keel(
      2,
      {"train", "--model.name=gpt", "--model.width=32", "--model.depth=1", "--model.context=16", "--data.name=tokens",
       "--data.path=" + d.file("corpus.bin"), "--train.steps=4", "--train.batch_size=4", "--run.threads=1",
       "--run.dir=" + d.file("run-two")},
      d.file("two-logs"));
  ASSERT_EQ(two.exit_code, 0) << two.output;
  EXPECT_EQ(keel::testing::summary_field(d.file("run-two"), "world_size"), "2");

  // A token outside the vocabulary stops the command line at start: exit 2 naming the file.
  tokens[777] = 4000;
  write_token_file(d.file("wide.bin"), tokens, 2, true);
  auto r = run_keel({"train", "--model.name=gpt", "--model.width=32", "--model.depth=1", "--model.context=16",
                     "--data.name=tokens", "--data.path=" + d.file("wide.bin"), "--train.steps=1",
                     "--run.dir=" + d.file("run-wide")});
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find(d.file("wide.bin") + ": token 4000 at position 777 is outside the model's vocabulary of 256"),
            std::string::npos)
      << r.output;
}

// A resume reads the optimizer state as the optimizer that wrote it: adamw's moments are not
// taken by another optimizer with the same fields (torch::optim::Adam registered as "adam",
// step / exp_avg / exp_avg_sq), which loaded them as its own before meta.json named the writer.
TEST(Registries, AResumeWithAnotherOptimizerOfTheSameFieldsIsRefused) {
  keel::register_optimizer<torch::optim::AdamParamState>(
      "adam", [](std::vector<torch::Tensor> params, const keel::TrainConfig& t) {
        return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(t.lr));
      });
  TempDir d;
  auto config = [&](const std::string& optimizer, int64_t steps) {
    keel::Config cfg = small_mlp(d.file("run-" + optimizer + std::to_string(steps)), steps, 0.01);
    cfg.train.optimizer = optimizer;
    cfg.checkpoint.dir = d.file("ckpt");
    cfg.checkpoint.interval = 3;
    keel::validate(cfg);
    return cfg;
  };
  keel::Trainer(config("adamw", 3), keel::dist::World{}).run();
  const auto meta = nlohmann::json::parse(keel::testing::read_text(d.file("ckpt/step_3/meta.json")));
  EXPECT_EQ(meta["components"]["optimizer"]["values"]["optimizer_name"], "adamw") << meta.dump();
  const std::string other = input_error_of_run(config("adam", 6));
  EXPECT_NE(other.find("its optimizer state was written by train.optimizer = \"adamw\", and this run's "
                       "train.optimizer = \"adam\" would read it as its own"),
            std::string::npos)
      << other;
  const keel::Summary same = keel::Trainer(config("adamw", 6), keel::dist::World{}).run();
  EXPECT_EQ(same.resumed_from_step.value_or(-1), 3);
}

// `keel tokenize` (keel's venv Python, Hugging Face tokenizers): a byte-level BPE trained on the
// user's text writes an llm.c token file, a held-out file and its tokenizer.json; encoding with
// that tokenizer.json gives the same tokens; a gpt trains on the result. Bad input: exit 2.
TEST(TokenFiles, KeelTokenizeWritesFilesAGptTrainsOn) {
  TempDir d;
  std::vector<std::string> docs;
  const std::vector<std::string> words = {"the",  "ranks", "agree",      "on",       "every",
                                          "step", "and",   "checkpoint", "gradients"};
  for (int k = 0; k < 5; ++k) {
    std::string text;
    for (int i = 0; i < 3000; ++i) text += words[(i * (k + 3) + i / 7) % words.size()] + (i % 11 ? " " : ".\n");
    docs.push_back(d.file("doc" + std::to_string(k) + ".txt"));
    keel::testing::write_text(docs.back(), text);
  }
  std::vector<std::string> args = {
      "tokenize",       "--train-bpe", "280", "--out", d.file("out/train.bin"), "--val-out", d.file("out/val.bin"),
      "--val-fraction", "0.2"};
  args.insert(args.end(), docs.begin(), docs.end());
  auto r = run_keel(args);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("--model.vocab=280"), std::string::npos) << r.output;
  args = {"tokenize", "--tokenizer", d.file("out/train.tokenizer.json"), "--out", d.file("again.bin")};
  args.insert(args.end(), docs.begin(), docs.end() - 1);  // the four train documents
  r = run_keel(args);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::string train = keel::testing::read_text(d.file("out/train.bin"));
  EXPECT_EQ(keel::testing::read_text(d.file("again.bin")), train);
  int32_t header[3];
  ASSERT_GT(train.size(), 1024u);
  std::memcpy(header, train.data(), sizeof header);
  EXPECT_EQ(header[0], 20240520);
  EXPECT_EQ(header[1], 1);
  EXPECT_EQ(static_cast<size_t>(header[2]) * 2 + 1024, train.size());

  r = run_keel({"train", "--model.name=gpt", "--model.width=32", "--model.depth=1", "--model.context=16",
                "--model.vocab=280", "--data.name=tokens", "--data.path=" + d.file("out/train.bin"),
                "--data.test_path=" + d.file("out/val.bin"), "--train.steps=3", "--train.eval_interval=3",
                "--data.eval_samples=4", "--run.dir=" + d.file("run")});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(std::isfinite(std::stod(keel::testing::summary_field(d.file("run"), "test_loss"))));

  r = run_keel({"tokenize", "--train-bpe", "300", "--out", d.file("x.bin"), d.file("missing.txt")});
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find(d.file("missing.txt") + ": no such file"), std::string::npos) << r.output;
  r = run_keel({"tokenize", "--tokenizer", docs[0], "--out", d.file("x.bin"), docs[0]});
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find(docs[0] + ": not a tokenizer.json"), std::string::npos) << r.output;
  r = run_keel({"tokenize", "--train-bpe", "100", "--out", d.file("x.bin"), docs[0]});
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_FALSE(std::filesystem::exists(d.file("x.bin")));
}

// An optimizer that keeps its state flattened: keel could not checkpoint it shaped like its
// parameter, so it is refused at start.
struct FlatOptions : torch::optim::OptimizerCloneableOptions<FlatOptions> {
  explicit FlatOptions(double lr) : lr_(lr) {}
  TORCH_ARG(double, lr);
  double get_lr() const override { return lr(); }
  void set_lr(const double lr) override { this->lr(lr); }
};
struct FlatState : torch::optim::OptimizerCloneableParamState<FlatState> {
  TORCH_ARG(torch::Tensor, buf);
  void serialize(torch::serialize::OutputArchive& a) const override { a.write("buf", buf()); }
  void serialize(torch::serialize::InputArchive& a) override {
    torch::Tensor t;
    a.read("buf", t);
    buf(t);
  }
};
class FlatMomentum : public torch::optim::Optimizer {
 public:
  FlatMomentum(std::vector<torch::Tensor> params, FlatOptions o)
      : Optimizer({torch::optim::OptimizerParamGroup(std::move(params))}, std::make_unique<FlatOptions>(o)) {}
  torch::Tensor step(LossClosure = nullptr) override {
    torch::NoGradGuard no_grad;
    for (auto& group : param_groups())
      for (auto& p : group.params()) {
        if (!p.grad().defined()) continue;
        auto& s = state_[p.unsafeGetTensorImpl()];
        if (!s) s = std::make_unique<FlatState>(FlatState().buf(torch::zeros({p.numel()})));
        auto& buf = static_cast<FlatState&>(*s).buf();
        buf.mul_(0.9).add_(p.grad().flatten());
        p.sub_(buf.view_as(p) * group.options().get_lr());
      }
    return {};
  }
};

// An optimizer registered by name (torch::optim::Adagrad here, whose state keel knows only
// through its serialize()) trains, checkpoints its state as "<param>.<field>" tensors and
// resumes bit-exactly; an unknown name and an optimizer keel cannot step are refused at start.
TEST(Registries, AnOptimizerRegisteredByNameTrainsAndResumesBitExactly) {
  keel::register_optimizer<torch::optim::AdagradParamState>(
      "adagrad", [](std::vector<torch::Tensor> params, const keel::TrainConfig& t) {
        return std::make_unique<torch::optim::Adagrad>(params, torch::optim::AdagradOptions(t.lr));
      });
  keel::register_optimizer<torch::optim::LBFGSParamState>(
      "lbfgs", [](std::vector<torch::Tensor> params, const keel::TrainConfig& t) {
        return std::make_unique<torch::optim::LBFGS>(params, torch::optim::LBFGSOptions(t.lr));
      });
  const keel::OptimizerFn adam = [](std::vector<torch::Tensor> params, const keel::TrainConfig& t) {
    return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(t.lr));
  };
  EXPECT_THROW(keel::register_optimizer<torch::optim::AdamParamState>("sgd", adam), std::invalid_argument)
      << "a built-in's name is taken";
  EXPECT_THROW(keel::register_optimizer<torch::optim::AdamParamState>("adam2", nullptr), std::invalid_argument)
      << "no function";
  const auto names = keel::registered_optimizers();
  for (const char* n : {"adagrad", "adamw", "lbfgs", "sgd"})  // "flat" comes later; other tests add theirs
    EXPECT_NE(std::find(names.begin(), names.end(), n), names.end()) << n;
  EXPECT_TRUE(std::is_sorted(names.begin(), names.end()));

  TempDir d;
  auto config = [&](const std::string& ckpt, int64_t steps) {
    keel::Config cfg = small_mlp(d.file("run-" + ckpt + "-" + std::to_string(steps)), steps, 0.05);
    cfg.train.schedule = "constant";
    cfg.train.optimizer = "adagrad";
    cfg.checkpoint.dir = d.file(ckpt);
    cfg.checkpoint.interval = 3;
    keel::validate(cfg);
    return cfg;
  };
  const keel::Summary whole = keel::Trainer(config("a", 6), keel::dist::World{}).run();
  EXPECT_EQ(whole.steps, 6);
  keel::Trainer(config("b", 3), keel::dist::World{}).run();
  const keel::Summary resumed = keel::Trainer(config("b", 6), keel::dist::World{}).run();
  ASSERT_EQ(resumed.resumed_from_step.value_or(-1), 3);
  EXPECT_EQ(resumed.final_loss, whole.final_loss);
  for (const char* kind : {"model", "optimizer"}) {
    const std::string file = std::string("/step_6/") + kind + "-00001-of-00001.safetensors";
    const auto a = keel::checkpoint::read_safetensors(d.file("a") + file);
    const auto b = keel::checkpoint::read_safetensors(d.file("b") + file);
    ASSERT_EQ(a.tensors.size(), b.tensors.size()) << kind;
    for (size_t i = 0; i < a.tensors.size(); ++i) {
      EXPECT_EQ(a.tensors[i].first, b.tensors[i].first);
      EXPECT_TRUE(torch::equal(a.tensors[i].second, b.tensors[i].second)) << kind << " " << a.tensors[i].first;
    }
  }
  const auto opt = keel::checkpoint::read_safetensors(d.file("a") + "/step_6/optimizer-00001-of-00001.safetensors");
  std::map<std::string, torch::Tensor> by_name(opt.tensors.begin(), opt.tensors.end());
  ASSERT_TRUE(by_name.count("fc.0.weight.sum")) << "Adagrad's sum, by parameter";
  ASSERT_TRUE(by_name.count("fc.0.weight.step"));
  EXPECT_EQ(by_name["fc.0.weight.step"].item<int64_t>(), 6);
  EXPECT_GT(by_name["fc.0.weight.sum"].abs().sum().item<double>(), 0);
  const auto meta = nlohmann::json::parse(keel::testing::read_text(d.file("a") + "/step_6/meta.json"));
  EXPECT_EQ(meta["components"]["optimizer"]["values"]["fields"], (nlohmann::json{{"step", "scalar"}, {"sum", "param"}}))
      << meta.dump();

  auto lbfgs = config("c", 2);
  lbfgs.train.optimizer = "lbfgs";
  const std::string needs_closure = input_error_of_run(lbfgs);
  EXPECT_NE(needs_closure.find("train.optimizer = \"lbfgs\": a step of it on a probe parameter failed"),
            std::string::npos)
      << needs_closure;
  keel::register_optimizer<FlatState>("flat", [](std::vector<torch::Tensor> params, const keel::TrainConfig& t) {
    return std::make_unique<FlatMomentum>(params, FlatOptions(t.lr));
  });
  auto flat = config("e", 2);
  flat.train.optimizer = "flat";
  const std::string flattened = input_error_of_run(flat);
  EXPECT_NE(flattened.find("train.optimizer = \"flat\": its state field 'buf' is a Float tensor of shape [6] for a "
                           "Float parameter of shape [2, 3]"),
            std::string::npos)
      << flattened;
  auto unknown = run_keel({"train", "--model.name=mlp", "--data.name=synthetic", "--train.steps=1",
                           "--train.optimizer=adam", "--run.dir=" + d.file("run-unknown")});
  EXPECT_EQ(unknown.exit_code, 2) << unknown.output;
  EXPECT_NE(unknown.output.find("train.optimizer = \"adam\" is not a registered optimizer; known: adamw, sgd"),
            std::string::npos)
      << unknown.output;
}

// Hardening class 7: when the disk fills up, metrics.jsonl keeps only whole lines (a write
// cut short is rolled back) and the lost lines are counted. RLIMIT_FSIZE stops a write in the
// middle of a line exactly as a full disk does; it is set in a child process.
TEST(Metrics, AFullDiskLeavesOnlyWholeLinesAndCountsTheLostOnes) {
  keel::testing::TempDir d;
  const std::string path = d.file("metrics.jsonl");
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    ::signal(SIGXFSZ, SIG_IGN);  // the write then fails with EFBIG instead of killing
    struct rlimit lim {
      100, 100
    };
    ::setrlimit(RLIMIT_FSIZE, &lim);
    keel::JsonlWriter w(path);
    int ok = 0;
    for (int i = 0; i < 5; ++i) ok += w.write({{"step", i}, {"pad", std::string(20, 'x')}}) ? 1 : 0;
    std::_Exit(ok * 10 + static_cast<int>(w.lines_lost()));
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  ASSERT_TRUE(WIFEXITED(status));
  const int written = WEXITSTATUS(status) / 10, lost = WEXITSTATUS(status) % 10;
  EXPECT_EQ(written + lost, 5);
  EXPECT_GT(lost, 0);
  std::ifstream in(path);
  std::string line;
  int lines = 0;
  while (std::getline(in, line)) {
    EXPECT_NO_THROW(nlohmann::json::parse(line)) << "a torn line: " << line;
    ++lines;
  }
  EXPECT_EQ(lines, written);
}

// summary.json that cannot be written is a failure of the disk (exit 1), not bad input (2).
TEST(Metrics, SummaryThatCannotBeWrittenExitsOne) {
  keel::testing::TempDir d;
  ASSERT_EQ(::mkdir(d.file("run").c_str(), 0755), 0);
  ASSERT_EQ(::mkdir(d.file("run/summary.json").c_str(), 0755), 0);  // a directory where the file goes
  keel::testing::write_text(d.file("run/summary.json/blocker"), "x");
  auto r = keel::testing::run_keel({"train", "--model.name=mlp", "--data.name=synthetic", "--train.steps=2",
                                    "--run.threads=1", "--run.dir=" + d.file("run")});
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("summary.json"), std::string::npos) << r.output;
}

TEST(Metrics, Median) {
  EXPECT_DOUBLE_EQ(keel::median({3, 1, 2}), 2);
  EXPECT_DOUBLE_EQ(keel::median({4, 1, 3, 2}), 2.5);
  EXPECT_TRUE(std::isnan(keel::median({})));
}

TEST(World, SingleProcessByDefault) {
  auto w = keel::dist::detect_world({{"HOME", "/root"}});
  EXPECT_EQ(w.size, 1);
  EXPECT_EQ(w.launcher, keel::dist::Launcher::None);
}

TEST(World, Torchrun) {
  auto w = keel::dist::detect_world({{"RANK", "1"},
                                     {"WORLD_SIZE", "2"},
                                     {"LOCAL_RANK", "1"},
                                     {"LOCAL_WORLD_SIZE", "2"},
                                     {"MASTER_ADDR", "127.0.0.1"},
                                     {"MASTER_PORT", "29500"},
                                     {"TORCHELASTIC_RESTART_COUNT", "3"}});
  EXPECT_EQ(w.launcher, keel::dist::Launcher::Torchrun);
  EXPECT_EQ(w.rank, 1);
  EXPECT_EQ(w.size, 2);
  EXPECT_EQ(w.restart_count, 3);
  EXPECT_EQ(w.master_port, 29500);
}

TEST(World, Mpirun) {
  auto w = keel::dist::detect_world({{"OMPI_COMM_WORLD_RANK", "3"},
                                     {"OMPI_COMM_WORLD_SIZE", "4"},
                                     {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                                     {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}});
  EXPECT_EQ(w.launcher, keel::dist::Launcher::Mpirun);
  EXPECT_EQ(w.rank, 3);
  EXPECT_EQ(w.local_size, 2);
}

TEST(World, Srun) {
  auto w = keel::dist::detect_world({{"SLURM_PROCID", "5"},
                                     {"SLURM_NTASKS", "8"},
                                     {"SLURM_LOCALID", "1"},
                                     {"SLURM_NTASKS_PER_NODE", "4(x2)"},
                                     {"MASTER_ADDR", "node1"},
                                     {"MASTER_PORT", "1234"}});
  EXPECT_EQ(w.launcher, keel::dist::Launcher::Srun);
  EXPECT_EQ(w.rank, 5);
  EXPECT_EQ(w.local_size, 4);
}

TEST(World, PartialOrInconsistentEnvironmentIsRefused) {
  try {
    keel::dist::detect_world({{"RANK", "0"}, {"WORLD_SIZE", "2"}});
    FAIL();
  } catch (const keel::InputError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("found RANK=0, WORLD_SIZE=2"), std::string::npos) << m;
    EXPECT_NE(m.find("missing MASTER_ADDR, MASTER_PORT"), std::string::npos) << m;
  }
  EXPECT_THROW(
      keel::dist::detect_world({{"RANK", "2"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "1"}}),
      keel::InputError);
  EXPECT_THROW(
      keel::dist::detect_world({{"RANK", "x"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "1"}}),
      keel::InputError);
  EXPECT_THROW(keel::dist::detect_world({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_LOCALID", "0"}}),
               keel::InputError);
}

}  // namespace
