// The keel binary as a user meets it: exit codes and messages for every class of bad input
// (never a signal), --help listing every key, --version, --print-config.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <sys/stat.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include <torch/cuda.h>

#include "helpers.h"
#include "idx_fixture.h"
#include "keel/trainer/config/config.h"
#include "keel/trainer/trainer.h"
#include "trainer/app/plot.h"

using keel::testing::run_keel;
using keel::testing::TempDir;
using keel::testing::write_text;

namespace {

// Expects a clean exit 2 whose output contains `needle`.
void expect_input_error(const keel::testing::ProcResult& r, const std::string& needle) {
  EXPECT_FALSE(r.signaled) << "ended by signal " << r.signal << "\n" << r.output;
  EXPECT_FALSE(r.timed_out);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find(needle), std::string::npos) << "expected '" << needle << "' in:\n" << r.output;
}

// A CUDA build on a machine without a GPU (CI): the same binary trains on the CPU, and asking
// for CUDA or NCCL is bad input naming the key, never a crash.
TEST(CliNoGpu, CudaDeviceNcclAndFp16ExitTwoSayingThereIsNoGpu) {
  if (!KEEL_CUDA_BUILD) GTEST_SKIP() << "a CPU build refuses these while loading the config (ConfigErrors.*)";
  if (torch::cuda::is_available()) GTEST_SKIP() << "this machine has a GPU";
  TempDir d;
  const std::vector<std::string> base = {"train", "--config",
                                         keel::testing::source_path("configs/synthetic_smoke.toml"), "--train.steps=2",
                                         "--run.dir=" + d.file("run")};
  auto with = [&](const std::string& extra) {
    auto a = base;
    a.push_back(extra);
    return run_keel(a);
  };
  expect_input_error(with("--run.device=cuda"), "run.device = \"cuda\" but no CUDA device is available");
  expect_input_error(with("--dist.backend=nccl"), "dist.backend = \"nccl\" needs CUDA devices");
  expect_input_error(with("--amp.dtype=fp16"), "amp.dtype = \"fp16\" needs a CUDA device");
  // And the same binary trains on the CPU.
  auto ok = run_keel(base);
  EXPECT_EQ(ok.exit_code, 0) << ok.output;
}

// The command line wins over the file, also for the two keys that exclude each other.
TEST(Cli, CommandLineStepsOrEpochsReplaceTheFilesOther) {
  TempDir d;
  write_text(d.file("epochs.toml"), "[train]\nepochs = 2\n");
  write_text(d.file("steps.toml"), "[train]\nsteps = 7\n");
  auto r = run_keel({"train", "--config", d.file("epochs.toml"), "--train.steps=20", "--print-config"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("steps = 20"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("epochs = 0"), std::string::npos) << r.output;
  r = run_keel({"train", "--config", d.file("steps.toml"), "--train.epochs=3", "--print-config"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("epochs = 3"), std::string::npos) << r.output;
  // Both on the same layer stay an error, on the command line as in a file.
  expect_input_error(run_keel({"train", "--train.steps=20", "--train.epochs=3"}), "not both");
  write_text(d.file("both.toml"), "[train]\nsteps = 7\nepochs = 2\n");
  expect_input_error(run_keel({"train", "--config", d.file("both.toml")}), "not both");
}

// `keel train --print-schedule` prints the pipeline schedule of the config's keys without training
// (issue 66 item 3): each rank's actions with the sends and receives, and the simulator's verdict;
// a schedule that cannot be made exits 2 naming the keys, at pp = 1 too, where validate() lets
// the pipeline keys be.
TEST(Cli, PrintScheduleShowsEachRanksActionsAndTheSimulation) {
  TempDir d;
  auto r = run_keel({"train", "--model.name=gpt", "--parallel.pp=2", "--parallel.pp_schedule=gpipe",
                     "--train.grad_accum=2", "--run.dir=" + d.file("run"), "--print-schedule"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("gpipe: pp 2, 2 stages, 2 micro-batches\n"
                          "rank 0: 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1\n"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("peak micro-batches in flight per rank: 2 2"), std::string::npos) << r.output;
  EXPECT_FALSE(std::filesystem::exists(d.file("run"))) << "--print-schedule trained";
  expect_input_error(run_keel({"train", "--model.name=gpt", "--parallel.pp_schedule=dualpipev", "--print-schedule"}),
                     "parallel.pp_schedule = \"dualpipev\" at parallel.pp = 1 with train.grad_accum = 1");
}

// Hardening class 2: a word on the command line that no option takes is bad usage naming the
// word, wherever it stands; it never becomes a value.
TEST(CliBadInput, StrayWordsAreUsageErrors) {
  expect_input_error(run_keel({"train", "--train.lr=0.5", "0.7", "--print-config"}), "unexpected argument '0.7'");
  expect_input_error(run_keel({"train", "--run.name=my", "experiment"}), "unexpected argument 'experiment'");
  expect_input_error(run_keel({"train", "--train.steps", "5", "runs/x"}), "unexpected argument 'runs/x'");
  expect_input_error(run_keel({"train", "stray", "--train.steps=5"}), "unexpected argument 'stray'");
  expect_input_error(run_keel({"train", "--print-config", "extra"}), "unexpected argument 'extra'");
  // Values given apart from their option, negative numbers and quoted spaces still work.
  auto r = run_keel({"train", "--train.steps", "5", "--train.lr", "1e-3", "--amp.init_scale", "-1", "--print-config"});
  EXPECT_EQ(r.exit_code, 2) << r.output;  // -1 reaches the range check: the value was taken
  EXPECT_NE(r.output.find("amp.init_scale"), std::string::npos) << r.output;
  r = run_keel({"train", "--run.name", "my experiment", "--train.steps", "5", "--print-config"});
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("name = \"my experiment\""), std::string::npos) << r.output;
}

// Hardening class 1: every input path is checked for its kind before a byte is read: a
// directory, a FIFO or a device is refused at once naming the path, never read without bound
// (/dev/zero) or waited on (a FIFO). Each run is given 60 s; none may need it.
TEST(CliBadInput, InputsThatAreNotRegularFilesAreRefusedAtOnce) {
  TempDir d;
  const std::string fifo = d.file("fifo");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0644), 0);
  const std::string dir = d.path();
  const std::vector<std::string> smoke = {"train", "--config",
                                          keel::testing::source_path("configs/synthetic_smoke.toml"), "--train.steps=2",
                                          "--run.dir=" + d.file("run")};
  auto with = [&](std::vector<std::string> extra) {
    auto a = smoke;
    a.insert(a.end(), extra.begin(), extra.end());
    return run_keel(a, {}, 60);
  };
  expect_input_error(run_keel({"train", "-c", "/dev/zero"}, {}, 60), "/dev/zero: is a character device");
  expect_input_error(run_keel({"train", "-c", dir}, {}, 60), "is a directory");
  expect_input_error(run_keel({"train", "-c", fifo}, {}, 60), "is a FIFO");
  expect_input_error(with({"--model.name=gpt", "--data.name=text", "--data.path=" + fifo}), "is a FIFO");
  expect_input_error(with({"--model.name=gpt", "--data.name=text", "--data.path=/dev/zero"}), "character device");
  expect_input_error(with({"--model.name=torchscript", "--model.path=" + dir}), "is a directory");
  expect_input_error(with({"--model.name=torchscript", "--model.path=" + fifo}), "is a FIFO");
  expect_input_error(run_keel({"plot", dir}, {}, 60), "metrics.jsonl");

  // A checkpoint whose meta.json is a FIFO: inspect reports it, train falls back; neither waits.
  const std::string ck = d.file("ck");
  auto r = with({"--checkpoint.dir=" + ck, "--checkpoint.interval=1"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  ASSERT_EQ(std::remove((ck + "/step_2/meta.json").c_str()), 0);
  ASSERT_EQ(::mkfifo((ck + "/step_2/meta.json").c_str(), 0644), 0);
  auto insp = run_keel({"inspect", ck}, {}, 60);
  EXPECT_FALSE(insp.timed_out);
  EXPECT_EQ(insp.exit_code, 1) << insp.output;
  EXPECT_NE(insp.output.find("is a FIFO"), std::string::npos) << insp.output;
  r = with({"--checkpoint.dir=" + ck, "--checkpoint.interval=1", "--train.steps=3"});
  EXPECT_FALSE(r.timed_out);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("is a FIFO"), std::string::npos) << r.output;
}

TEST(Cli, Version) {
  auto r = run_keel({"--version"});
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_NE(r.output.find("keel 0."), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("LibTorch"), std::string::npos) << r.output;
}

TEST(Cli, HelpListsEveryKeyWithDefaultAndDoc) {
  auto r = run_keel({"train", "--help"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const keel::Config defaults;
  for (const auto& f : keel::config_schema()) {
    auto pos = r.output.find("--" + f.dotted() + " ");
    ASSERT_NE(pos, std::string::npos) << f.dotted();
    auto line_end = r.output.find("\n  --", pos + 1);
    const std::string entry = r.output.substr(pos, line_end - pos);
    EXPECT_NE(entry.find("=" + keel::to_toml_literal(f.get(defaults))), std::string::npos) << entry;
    EXPECT_NE(entry.find(f.doc.substr(0, 20)), std::string::npos) << entry;
  }
  // docs/config.md (kept equal to `keel config-reference` below) shows the same defaults and docs.
  const std::string doc = keel::testing::read_text(keel::testing::source_path("docs/config.md"));
  for (const auto& f : keel::config_schema()) {
    std::string escaped = f.doc;
    for (size_t p = 0; (p = escaped.find('|', p)) != std::string::npos; p += 2) escaped.replace(p, 1, "\\|");
    EXPECT_NE(doc.find("| `" + f.key + "` | "), std::string::npos) << f.dotted();
    EXPECT_NE(doc.find("`" + keel::to_toml_literal(f.get(defaults)) + "` | " + escaped + " |"), std::string::npos)
        << f.dotted() << ": its default or doc in docs/config.md differs from --help";
  }
}

TEST(Cli, ConfigReferenceDocIsInSync) {
  auto r = run_keel({"config-reference"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(keel::testing::read_text(keel::testing::source_path("docs/config.md")), r.output)
      << "docs/config.md is stale: regenerate it with `build/keel config-reference > docs/config.md`";
  for (const auto& f : keel::config_schema())
    EXPECT_NE(r.output.find("| `" + f.key + "` |"), std::string::npos) << f.dotted();
}

// summary.json's keys are declared once (KEEL_SUMMARY_FIELDS): what a run writes is exactly
// what docs/summary.md lists, and the file is what `keel summary-reference` prints.
TEST(Cli, SummaryReferenceDocIsInSyncWithWhatARunWrites) {
  auto r = run_keel({"summary-reference"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(keel::testing::read_text(keel::testing::source_path("docs/summary.md")), r.output)
      << "docs/summary.md is stale: regenerate it with `build/keel summary-reference > docs/summary.md`";
  keel::Summary s;
  s.tokens_per_s = 1;
  s.test_accuracy = 0.5;
  s.test_loss = 1;
  const nlohmann::json j = s.to_json();
  size_t rows = 0;
  for (size_t p = 0; (p = r.output.find("\n| `", p)) != std::string::npos; ++p) ++rows;
  size_t keys = 0;
  for (const auto& [k, v] : j.items()) {
    EXPECT_NE(r.output.find("| `" + k + "` |"), std::string::npos) << k;
    keys += v.is_object() ? v.size() : 1;
    if (v.is_object())
      for (const auto& [sub, x] : v.items())
        EXPECT_NE(r.output.find("| `" + k + "." + sub + "` |"), std::string::npos) << k << "." << sub;
  }
  EXPECT_EQ(rows, keys + 1) << "one row per key, and one for control_per_step itself";
  const nlohmann::json empty = keel::Summary{}.to_json();
  EXPECT_FALSE(empty.contains("tokens_per_s"));
  EXPECT_FALSE(empty.contains("test_accuracy"));
  EXPECT_TRUE(empty.at("loss_scale").is_null());
  EXPECT_TRUE(empty.at("stop_signal").is_null());
  EXPECT_EQ(empty.at("world_size"), 1);
  EXPECT_EQ(empty.at("control_per_step").at("validation_probes"), 0.0);
}

TEST(Cli, NoSubcommandIsUsageError) {
  auto r = run_keel({});
  EXPECT_EQ(r.exit_code, 2) << r.output;
}

TEST(Cli, UnknownOptionIsUsageError) { expect_input_error(run_keel({"train", "--train.bogus=1"}), "bogus"); }

TEST(Cli, PrintConfigAppliesOverrides) {
  auto r = run_keel({"train", "--config", keel::testing::source_path("configs/fashion_mnist_cnn.toml"),
                     "--train.lr=0.125", "--print-config"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("lr = 0.125"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("name = \"cnn\""), std::string::npos) << r.output;
}

TEST(Cli, EmptyStringValuesAndBareFlags) {
  auto r = run_keel({"train", "--compile.cache_dir=", "--data.drop_last", "--fault.inject=", "--print-config"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("cache_dir = \"\""), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("drop_last = true"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("inject = []"), std::string::npos) << r.output;
}

TEST(CliBadInput, MalformedToml) {
  TempDir d;
  write_text(d.file("bad.toml"), "[train\nlr = 1\n");
  expect_input_error(run_keel({"train", "--config", d.file("bad.toml")}), "bad.toml:1:");
}

TEST(CliBadInput, UnknownSection) {
  TempDir d;
  write_text(d.file("c.toml"), "[optim]\nlr = 1.0\n");
  expect_input_error(run_keel({"train", "--config", d.file("c.toml")}), "unknown section [optim]");
}

TEST(CliBadInput, UnknownKey) {
  TempDir d;
  write_text(d.file("c.toml"), "[train]\nlearning_rate = 1.0\n");
  expect_input_error(run_keel({"train", "--config", d.file("c.toml")}), "unknown key 'train.learning_rate'");
}

TEST(CliBadInput, WrongType) {
  TempDir d;
  write_text(d.file("c.toml"), "[train]\nsteps = \"ten\"\n");
  expect_input_error(run_keel({"train", "--config", d.file("c.toml")}), "'train.steps' expects int");
}

TEST(CliBadInput, OutOfRangeOnCommandLine) {
  expect_input_error(run_keel({"train", "--train.batch_size=0"}), "--train.batch_size");
}

TEST(CliBadInput, UnknownModel) {
  expect_input_error(run_keel({"train", "--model.name=resnet", "--data.name=synthetic"}),
                     "model.name = \"resnet\" is not a registered model");
}

TEST(CliBadInput, UnknownDataset) {
  TempDir d;  // a run.dir of its own: runs lock theirs (two tests on the default one would collide)
  expect_input_error(run_keel({"train", "--data.name=imagenet", "--run.dir=" + d.file("run")}),
                     "data.name = \"imagenet\"");
}

TEST(CliBadInput, MissingDataDirectory) {
  TempDir d;
  expect_input_error(run_keel({"train", "--data.path=/nonexistent/fmnist", "--run.dir=" + d.file("run")}),
                     "/nonexistent/fmnist");
}

TEST(CliBadInput, TruncatedDatasetFile) {
  TempDir d;
  keel::testing::write_small_fashion_mnist(d.path());
  // Cut the gzip stream of the train images in half.
  std::string gz = keel::testing::read_text(d.file("train-images-idx3-ubyte.gz"));
  write_text(d.file("train-images-idx3-ubyte.gz"), gz.substr(0, gz.size() / 2));
  auto r = run_keel({"train", "--data.path=" + d.path(), "--train.steps=1", "--run.dir=" + d.file("run")});
  EXPECT_FALSE(r.signaled) << r.output;
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("train-images-idx3-ubyte.gz"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("truncated"), std::string::npos) << r.output;
}

TEST(CliBadInput, BinaryFileAsConfig) {
  expect_input_error(run_keel({"train", "--config", KEEL_BINARY}), "not a TOML file");
}

TEST(CliBadInput, MissingConfigFile) {
  expect_input_error(run_keel({"train", "--config", "/nonexistent/x.toml"}), "/nonexistent/x.toml");
}

TEST(CliBadInput, MissingTorchScriptFile) {
  TempDir d;
  expect_input_error(run_keel({"train", "--model.name=torchscript", "--model.path=/nonexistent/m.pt",
                               "--data.name=synthetic", "--run.dir=" + d.file("run")}),
                     "/nonexistent/m.pt");
}

TEST(CliBadInput, ModelAndDataDisagree) {
  TempDir d;
  expect_input_error(run_keel({"train", "--model.name=gpt", "--run.dir=" + d.file("run")}), "expects tokens");
}

TEST(CliBadInput, PartialLauncherEnvironment) {
  expect_input_error(run_keel({"train", "--data.name=synthetic", "--train.steps=1"}, {"RANK=0", "WORLD_SIZE=2"}),
                     "missing MASTER_ADDR");
}

// What the launcher's environment may say is bounded, and a rendezvous that cannot complete
// ends within dist.timeout_s naming who never came, whatever the world size.
TEST(CliBadInput, AbsurdWorldSizesAreRefusedOrTimeOutNamingTheMissing) {
  const std::string port = "MASTER_PORT=" + std::to_string(keel::testing::free_port());
  const std::vector<std::string> train = {"train", "--data.name=synthetic", "--train.steps=1", "--dist.timeout_s=3",
                                          "--run.threads=1"};
  for (const char* huge : {"WORLD_SIZE=1000000", "WORLD_SIZE=100000000000"})
    expect_input_error(run_keel(train, {"RANK=0", huge, "MASTER_ADDR=127.0.0.1", port}), "more than keel supports");
  keel::testing::TempDir d;
  auto args = train;
  args.push_back("--run.dir=" + d.file("run"));
  auto big = run_keel(args, {"RANK=0", "WORLD_SIZE=200000", "MASTER_ADDR=127.0.0.1", port}, 120);
  EXPECT_EQ(big.exit_code, 1) << big.output;
  EXPECT_NE(big.output.find("199999 of 200000 ranks never joined"), std::string::npos) << big.output;
  auto three = run_keel(args, {"RANK=0", "WORLD_SIZE=3", "MASTER_ADDR=127.0.0.1", port}, 120);
  EXPECT_EQ(three.exit_code, 1) << three.output;
  EXPECT_NE(three.output.find("rank(s) 1, 2 of 3 never joined"), std::string::npos) << three.output;
}

// Decided (issue 15, class 12): run.name is a plain name (run.dir says where else to write);
// a checkpoint.dir that is a file is refused at start, not at the first save; a port another
// program holds is named as the likely cause.
TEST(CliBadInput, RunNameCheckpointDirAndTakenPort) {
  keel::testing::TempDir d;
  for (const char* name : {"../..", "a/b", ".."})
    expect_input_error(run_keel({"train", "--data.name=synthetic", std::string("--run.name=") + name}),
                       "must be a plain name");
  keel::testing::write_text(d.file("file"), "x");
  expect_input_error(run_keel({"train", "--model.name=mlp", "--data.name=synthetic", "--train.steps=1",
                               "--run.dir=" + d.file("run"), "--checkpoint.dir=" + d.file("file")}),
                     "checkpoint.dir");
  // A listening socket that is not a TCPStore holds the port rank 0 wants.
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  ASSERT_EQ(::listen(fd, 4), 0);
  socklen_t len = sizeof a;
  ASSERT_EQ(::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len), 0);
  const std::string port = "MASTER_PORT=" + std::to_string(ntohs(a.sin_port));
  auto r =
      run_keel({"train", "--data.name=synthetic", "--train.steps=1", "--dist.timeout_s=5", "--run.dir=" + d.file("r")},
               {"RANK=0", "WORLD_SIZE=2", "MASTER_ADDR=127.0.0.1", port}, 120);
  ::close(fd);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("a port another program holds"), std::string::npos) << r.output;
}

// keel plot: PNG curves from metrics.jsonl (loss, throughput, loss scale, per-rank compute).
TEST(KeelPlot, WritesPngCurvesFromMetrics) {
  TempDir d;
  auto r = run_keel({"train", "--model.name=mlp", "--data.name=synthetic", "--train.steps=12", "--train.batch_size=16",
                     "--train.eval_interval=6", "--amp.loss_scaling=dynamic", "--run.threads=1",
                     "--run.dir=" + d.file("run")});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto p = run_keel({"plot", d.file("run")});
  ASSERT_EQ(p.exit_code, 0) << p.output;
  for (const char* f : {"loss.png", "throughput.png", "loss_scale.png"}) {
    const std::string png = keel::testing::read_text(d.file(std::string("run/plots/") + f));
    ASSERT_GT(png.size(), 2000u) << f;
    EXPECT_EQ(png.substr(0, 8), std::string("\x89PNG\r\n\x1a\n", 8)) << f;  // the PNG signature
  }
  EXPECT_EQ(run_keel({"plot", d.file("no-such-run")}).exit_code, 2);
  // The smoothed loss curve is drawn from its own data file: one point per finite step loss.
  const std::string smooth = keel::testing::read_text(d.file("run/plots/loss_smoothed.dat"));
  EXPECT_EQ(std::count(smooth.begin(), smooth.end(), '\n'), 12) << smooth;
}

// The smoothing is TensorBoard's debiased EMA: a constant stays constant (no pull toward 0 at
// the start), a step change is followed gradually, NaN losses are skipped.
TEST(KeelPlot, SmoothingIsADebiasedEmaThatSkipsNaN) {
  const std::string s = keel::smoothed({{1, 2.0}, {2, 2.0}, {3, NAN}, {4, 2.0}, {5, 4.0}}, 0.5);
  EXPECT_EQ(s, "1\t2\n2\t2\n4\t2\n5\t3.06667\n");
  EXPECT_DOUBLE_EQ(keel::smoothing_weight(40), 0.6);
  EXPECT_DOUBLE_EQ(keel::smoothing_weight(400), 0.9);
  EXPECT_DOUBLE_EQ(keel::smoothing_weight(1000000), 0.99);
}

// Hardening class 11: a run directory whose path holds an apostrophe plots; a metrics line
// with values of the wrong type is named by file and line, not a raw JSON error.
TEST(KeelPlot, OddPathsAndBadValuesInMetrics) {
  TempDir d;
  const std::string run = d.file("bob's run");
  auto r = run_keel({"train", "--model.name=mlp", "--data.name=synthetic", "--train.steps=4", "--train.batch_size=16",
                     "--run.threads=1", "--run.dir=" + run});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto p = run_keel({"plot", run});
  EXPECT_EQ(p.exit_code, 0) << p.output;
  EXPECT_TRUE(keel::testing::exists(run + "/plots/loss.png"));
  ASSERT_EQ(::mkdir(d.file("bad").c_str(), 0755), 0);
  write_text(d.file("bad/metrics.jsonl"), "{\"step\": 1, \"loss\": \"high\"}\n{\"step\": \"two\", \"loss\": 1.0}\n");
  expect_input_error(run_keel({"plot", d.file("bad")}), "metrics.jsonl:2: \"step\" is \"two\"");
}

}  // namespace
