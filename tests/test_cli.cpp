// The keel binary as a user meets it: exit codes and messages for every class of bad input
// (never a signal), --help listing every key, --version, --print-config.
#include <gtest/gtest.h>

#include <fstream>

#include <torch/cuda.h>

#include "helpers.h"
#include "idx_fixture.h"
#include "trainer/config.h"

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
  const std::vector<std::string> base = {"train", "--config", keel::testing::source_path("configs/synthetic_smoke.toml"),
                                         "--train.steps=2", "--run.dir=" + d.file("run")};
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
  for (const auto& f : keel::config_schema()) EXPECT_NE(r.output.find("| `" + f.key + "` |"), std::string::npos) << f.dotted();
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
  expect_input_error(run_keel({"train", "--data.name=imagenet"}), "data.name = \"imagenet\"");
}

TEST(CliBadInput, MissingDataDirectory) {
  expect_input_error(run_keel({"train", "--data.path=/nonexistent/fmnist"}), "/nonexistent/fmnist");
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
  expect_input_error(run_keel({"train", "--model.name=torchscript", "--model.path=/nonexistent/m.pt",
                               "--data.name=synthetic"}),
                     "/nonexistent/m.pt");
}

TEST(CliBadInput, ModelAndDataDisagree) {
  expect_input_error(run_keel({"train", "--model.name=gpt"}), "expects tokens");
}

TEST(CliBadInput, PartialLauncherEnvironment) {
  expect_input_error(run_keel({"train", "--data.name=synthetic", "--train.steps=1"}, {"RANK=0", "WORLD_SIZE=2"}),
                     "missing MASTER_ADDR");
}

// keel plot: PNG curves from metrics.jsonl (loss, throughput, loss scale, per-rank compute).
TEST(KeelPlot, WritesPngCurvesFromMetrics) {
  TempDir d;
  auto r = run_keel({"train", "--model.name=mlp", "--data.name=synthetic", "--train.steps=12", "--train.batch_size=16",
                     "--train.eval_interval=6", "--amp.loss_scaling=dynamic", "--run.threads=1", "--run.dir=" + d.file("run")});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto p = run_keel({"plot", d.file("run")});
  ASSERT_EQ(p.exit_code, 0) << p.output;
  for (const char* f : {"loss.png", "throughput.png", "loss_scale.png"}) {
    const std::string png = keel::testing::read_text(d.file(std::string("run/plots/") + f));
    ASSERT_GT(png.size(), 2000u) << f;
    EXPECT_EQ(png.substr(0, 8), std::string("\x89PNG\r\n\x1a\n", 8)) << f;  // the PNG signature
  }
  EXPECT_EQ(run_keel({"plot", d.file("no-such-run")}).exit_code, 2);
}

}  // namespace
