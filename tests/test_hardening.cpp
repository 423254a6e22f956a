// The second hardening round (issue 23): one test per defect class that a hostile user or an
// unlucky operator found, each at the root of the class. Classes 5, 9, 10 and 11 (what keel
// writes besides checkpoints) are in test_hardening_outputs.cpp, class 7 (documented maxima) in
// test_limits.cpp. docs/inputs.md lists every class with its outcome and its test.
#include <gtest/gtest.h>

#include <signal.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "checkpoint/checkpointer.h"
#include "checkpoint/io.h"
#include "checkpoint/safetensors.h"
#include "helpers.h"
#include "idx_fixture.h"
#include "multirank.h"

using namespace keel::testing;
using keel::checkpoint::NamedTensors;
using keel::checkpoint::verify_step;

namespace {

nlohmann::json read_json(const std::string& path) { return nlohmann::json::parse(read_text(path)); }
void write_json(const std::string& path, const nlohmann::json& j) { write_text(path, j.dump(2) + "\n"); }

// A careful tamperer: after changing `file` of a step, records its new size and SHA-256 in
// meta.json, so that every checksum is consistent and only keel's own checks can tell.
void rerecord(const std::string& step_dir, const std::string& file) {
  auto meta = read_json(step_dir + "/meta.json");
  const std::string path = step_dir + "/" + file;
  meta["files"][file]["bytes"] = std::filesystem::file_size(path);
  meta["files"][file]["sha256"] = keel::checkpoint::sha256_file(path);
  write_json(step_dir + "/meta.json", meta);
}

// Rewrites the optimizer file `file` of a step through `edit` (its tensors, by name), keeping
// the index and meta.json consistent with what is left.
void edit_optimizer_file(const std::string& step_dir, const std::string& file,
                         const std::function<void(NamedTensors&)>& edit) {
  const std::string path = step_dir + "/" + file;
  auto f = keel::checkpoint::read_safetensors(path);
  NamedTensors tensors;
  for (auto& [n, t] : f.tensors) tensors.emplace_back(n, t.clone());
  edit(tensors);
  std::remove(path.c_str());
  keel::checkpoint::write_safetensors(path, tensors, {{"keel_step", f.header.metadata["keel_step"]}});
  auto index = read_json(step_dir + "/optimizer.safetensors.index.json");
  nlohmann::json kept = nlohmann::json::object();
  for (auto it = index["weight_map"].begin(); it != index["weight_map"].end(); ++it) {
    if (it.value() != file) {
      kept[it.key()] = it.value();
      continue;
    }
    for (const auto& [n, t] : tensors)
      if (n == it.key()) kept[it.key()] = it.value();
  }
  index["weight_map"] = kept;
  write_json(step_dir + "/optimizer.safetensors.index.json", index);
  rerecord(step_dir, file);
  rerecord(step_dir, "optimizer.safetensors.index.json");
}

// The name of a tensor of `file` whose name ends with `suffix`.
std::string tensor_in(const std::string& step_dir, const std::string& file, const std::string& suffix) {
  for (const auto& [n, t] : keel::checkpoint::read_safetensors(step_dir + "/" + file).tensors)
    if (n.size() > suffix.size() && n.compare(n.size() - suffix.size(), suffix.size(), suffix) == 0) return n;
  return "";
}

void copy_tree(const std::string& from, const std::string& to) {
  std::filesystem::copy(from, to, std::filesystem::copy_options::recursive);
}

// A short 2-rank (or 1-rank) run of the synthetic MLP, checkpoints every 5 steps under DIR/ckpt.
std::vector<std::string> run_args(const std::string& dir, int steps, std::vector<std::string> extra = {}) {
  std::vector<std::string> a = {"train",
                                "--model.name=mlp",
                                "--data.name=synthetic",
                                "--train.steps=" + std::to_string(steps),
                                "--train.batch_size=8",
                                "--run.threads=1",
                                "--run.dir=" + dir + "/run",
                                "--checkpoint.dir=" + dir + "/ckpt",
                                "--checkpoint.interval=5",
                                "--dist.timeout_s=60"};
  a.insert(a.end(), extra.begin(), extra.end());
  return a;
}

nlohmann::json summary_of(const std::string& dir) { return read_json(dir + "/run/summary.json"); }

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

}  // namespace

// Class 1: a step whose optimizer partition for some parameters is absent (rank 1's file
// deleted, its index entries removed, checksums consistent) is not resumed with fresh state
// for those parameters: the loader and `keel inspect` both refuse it, naming the parameters,
// and every rank falls back to the previous step.
TEST(Hardening, MissingOptimizerStateIsRefusedByTheLoaderAndInspectAlike) {
  TempDir d;
  expect_all_ok(run_keel_ranks(2, run_args(d.path(), 10, {"--dist.zero=1"})));
  const std::string step = d.file("ckpt/step_10");
  const std::string gone = keel::checkpoint::component_file("optimizer", 1, 2);
  const std::string param = tensor_in(step, gone, ".exp_avg");
  ASSERT_FALSE(param.empty());
  std::remove((step + "/" + gone).c_str());
  auto meta = read_json(step + "/meta.json");
  meta["files"].erase(gone);
  write_json(step + "/meta.json", meta);
  auto index = read_json(step + "/optimizer.safetensors.index.json");
  nlohmann::json kept = nlohmann::json::object();
  for (auto it = index["weight_map"].begin(); it != index["weight_map"].end(); ++it)
    if (it.value() != gone) kept[it.key()] = it.value();
  index["weight_map"] = kept;
  write_json(step + "/optimizer.safetensors.index.json", index);
  rerecord(step, "optimizer.safetensors.index.json");

  auto inspect = run_keel({"inspect", d.file("ckpt")});
  EXPECT_EQ(inspect.exit_code, 1) << inspect.output;
  EXPECT_TRUE(contains(inspect.output, gone)) << inspect.output;

  auto ranks = run_keel_ranks(2, run_args(d.path(), 15, {"--dist.zero=1"}));
  expect_all_ok(ranks);
  EXPECT_EQ(summary_of(d.path())["resumed_from_step"], 5);
  for (const auto& r : ranks) EXPECT_TRUE(contains(r.output, "step_10 cannot be used")) << r.output;
}

// Class 1, the state gone from the index and meta.json's file list but the optimizer's record
// kept: the parameters are named.
TEST(Hardening, OptimizerStateMissingFromTheIndexNamesTheParameter) {
  TempDir d;
  auto r0 = run_keel(run_args(d.path(), 10));
  ASSERT_EQ(r0.exit_code, 0) << r0.output;
  const std::string step = d.file("ckpt/step_10");
  const std::string file = keel::checkpoint::component_file("optimizer", 0, 1);
  const std::string victim = tensor_in(step, file, ".exp_avg_sq");
  ASSERT_FALSE(victim.empty());
  const std::string param = victim.substr(0, victim.size() - std::string(".exp_avg_sq").size());
  edit_optimizer_file(step, file, [&](NamedTensors& t) {
    NamedTensors kept;
    for (auto& [n, x] : t)
      if (n.rfind(param + ".", 0) != 0) kept.emplace_back(n, x);
    t = kept;
  });
  auto inspect = run_keel({"inspect", d.file("ckpt")});
  EXPECT_EQ(inspect.exit_code, 1) << inspect.output;
  EXPECT_TRUE(contains(inspect.output, param + ".exp_avg")) << inspect.output;
  auto r = run_keel(run_args(d.path(), 15));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "missing from the index")) << r.output;
  EXPECT_TRUE(contains(r.output, param + ".")) << r.output;
  EXPECT_EQ(summary_of(d.path())["resumed_from_step"], 5);
}

// Class 6: damaged optimizer state (one .step missing, exp_avg in float64, a 2-element .step;
// checksums consistent) held by rank 1's partition only: every rank reaches the same verdict
// (the step is unusable, both fall back to step 5, exit 0), the message names the file and the
// tensor on both ranks, and `keel inspect` refuses the same step.
TEST(Hardening, DamagedOptimizerStateIsJudgedAlikeOnEveryRank) {
  TempDir base;
  expect_all_ok(run_keel_ranks(2, run_args(base.path(), 10, {"--dist.zero=1"})));
  const std::string file = keel::checkpoint::component_file("optimizer", 1, 2);
  struct Case {
    const char* what;
    const char* suffix;
    std::function<void(NamedTensors&, const std::string&)> damage;
  };
  const std::vector<Case> cases = {
      {"a .step missing", ".step",
       [](NamedTensors& t, const std::string& victim) {
         NamedTensors kept;
         for (auto& [n, x] : t)
           if (n != victim) kept.emplace_back(n, x);
         t = kept;
       }},
      {"exp_avg in float64", ".exp_avg",
       [](NamedTensors& t, const std::string& victim) {
         for (auto& [n, x] : t)
           if (n == victim) x = x.to(torch::kDouble);
       }},
      {"a 2-element .step", ".step",
       [](NamedTensors& t, const std::string& victim) {
         for (auto& [n, x] : t)
           if (n == victim) x = torch::tensor({3, 3}, torch::kLong);
       }},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.what);
    TempDir d;
    copy_tree(base.file("ckpt"), d.file("ckpt"));
    const std::string step = d.file("ckpt/step_10");
    const std::string victim = tensor_in(step, file, c.suffix);
    ASSERT_FALSE(victim.empty());
    edit_optimizer_file(step, file, [&](NamedTensors& t) { c.damage(t, victim); });

    auto inspect = run_keel({"inspect", d.file("ckpt")});
    EXPECT_EQ(inspect.exit_code, 1) << inspect.output;
    EXPECT_TRUE(contains(inspect.output, victim)) << inspect.output;

    auto ranks = run_keel_ranks(2, run_args(d.path(), 15, {"--dist.zero=1"}));
    for (size_t k = 0; k < ranks.size(); ++k) {
      const auto& r = ranks[k];
      EXPECT_EQ(r.exit_code, 0) << "rank " << k << ":\n" << r.output;
      EXPECT_TRUE(contains(r.output, "step_10 cannot be used")) << r.output;
      EXPECT_TRUE(contains(r.output, victim)) << "rank " << k << " does not name the tensor:\n" << r.output;
      EXPECT_FALSE(contains(r.output, "cannot be converted to Scalar")) << r.output;
      EXPECT_FALSE(contains(r.output, "train.optimizer")) << r.output;
    }
    EXPECT_EQ(summary_of(d.path())["resumed_from_step"], 5);
  }
}

// Class 6's twin that is the user's choice: another train.optimizer on resume is exit 2 on
// every rank alike, although only the owners read the partitioned tensors.
TEST(Hardening, AnotherOptimizerOnResumeIsExitTwoOnEveryRank) {
  TempDir d;
  expect_all_ok(
      run_keel_ranks(2, run_args(d.path(), 10, {"--dist.zero=1", "--train.optimizer=sgd", "--train.momentum=0.9"})));
  auto ranks = run_keel_ranks(2, run_args(d.path(), 15, {"--dist.zero=1"}));
  for (size_t k = 0; k < ranks.size(); ++k) {
    EXPECT_EQ(ranks[k].exit_code, 2) << "rank " << k << ":\n" << ranks[k].output;
    EXPECT_TRUE(contains(ranks[k].output, "train.optimizer")) << ranks[k].output;
  }
}

// Class 2: a SIGTERM (or SIGINT), and a second one after it, at every phase of a run (start,
// compile, a step, evaluation, a periodic save, an async save, the final save) ends with a
// committed final checkpoint, summary.json and 128+N on every rank; no rank is killed mid-save.
TEST(Hardening, SignalsAtEveryPhaseEndWithAFinalCheckpoint) {
  struct Case {
    const char* phase;
    std::vector<std::string> faults;
    int64_t final_step;  // the step the run stops after (async: this one or the next)
    std::vector<std::string> extra;
    int sig = SIGTERM;
  };
  const std::vector<Case> cases = {
      {"start", {"signal@step=1,rank=1,phase=start", "signal@step=1,rank=1,phase=save"}, 1, {}},
      {"compile", {"signal@step=1,rank=0,phase=compile,twice"}, 1, {}},
      {"step", {"signal@step=2,rank=1", "signal@step=2,rank=0,phase=save"}, 2, {}},
      {"evaluation", {"signal@step=3,rank=0,phase=eval,twice"}, 4, {}},
      {"periodic save", {"signal@step=5,rank=1,phase=save", "signal@step=6,rank=1,phase=save"}, 6, {}},
      {"async save", {"signal@step=5,rank=0,phase=save,twice"}, 6, {"--checkpoint.async=true", "--checkpoint.keep=2"}},
      {"final save", {"signal@step=8,rank=1,phase=save,twice,sig=2"}, 8, {}, SIGINT},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.phase);
    TempDir d;
    auto args = run_args(d.path(), 8, {"--train.eval_interval=3"});
    args.insert(args.end(), c.extra.begin(), c.extra.end());
    for (const auto& f : c.faults) args.push_back("--fault.inject=" + f);
    auto ranks = run_keel_ranks(2, args);
    for (size_t k = 0; k < ranks.size(); ++k) {
      EXPECT_FALSE(ranks[k].signaled) << "rank " << k << " was killed:\n" << ranks[k].output;
      EXPECT_EQ(ranks[k].exit_code, 128 + c.sig) << "rank " << k << ":\n" << ranks[k].output;
    }
    ASSERT_TRUE(exists(d.file("run/summary.json")));
    const auto s = summary_of(d.path());
    EXPECT_EQ(s["stop_signal"], c.sig);
    // With checkpoint.async the signal comes from the writer thread, while the next step may
    // already be past its consensus: the run stops after that step or the one after.
    const int64_t steps = s["steps"].get<int64_t>();
    if (c.extra.empty())
      EXPECT_EQ(steps, c.final_step);
    else
      EXPECT_TRUE(steps == c.final_step || steps == c.final_step + 1) << steps;
    EXPECT_EQ(s["checkpoint_step"], steps);
    const std::string step = d.file("ckpt/step_" + std::to_string(steps));
    EXPECT_TRUE(exists(step + "/meta.json"));
    EXPECT_TRUE(verify_step(step).empty());
  }
}

// Class 3: the resolved config is a valid input that reproduces the run: --print-config of every
// file in configs/ reads back to the same text, and the quick start's own (epoch-based) run's
// <run.dir>/config.toml replays it, step for step. A value that TOML cannot hold (a run.name
// that is not UTF-8) is refused up front naming the key, never written into a config.toml that
// cannot be read back.
TEST(Hardening, TheResolvedConfigReplaysTheRun) {
  TempDir d;
  for (const auto& entry : std::filesystem::directory_iterator(source_path("configs"))) {
    const std::string cfg = entry.path().string();
    SCOPED_TRACE(cfg);
    auto first = run_keel({"train", "--config", cfg, "--print-config"});
    ASSERT_EQ(first.exit_code, 0) << first.output;
    write_text(d.file("resolved.toml"), first.output);
    auto again = run_keel({"train", "--config", d.file("resolved.toml"), "--print-config"});
    ASSERT_EQ(again.exit_code, 0) << again.output;
    EXPECT_EQ(again.output, first.output);
  }
  // The quick start's run (configs/fashion_mnist_cnn.toml, 2 ranks, epochs) on a small copy of
  // its data, then its own config.toml replayed on 2 ranks into another run.dir.
  std::filesystem::create_directories(d.file("data"));
  write_small_fashion_mnist(d.file("data"), 128, 32);
  const std::vector<std::string> quick = {"train",
                                          "--config",
                                          source_path("configs/fashion_mnist_cnn.toml"),
                                          "--data.path=" + d.file("data"),
                                          "--train.epochs=2",
                                          "--run.dir=" + d.file("quick"),
                                          "--run.threads=1"};
  expect_all_ok(run_keel_ranks(2, quick));
  expect_all_ok(run_keel_ranks(
      2, {"train", "--config", d.file("quick/config.toml"), "--run.dir=" + d.file("replay"), "--run.threads=1"}));
  const auto a = metrics_losses(d.file("quick")), b = metrics_losses(d.file("replay"));
  ASSERT_FALSE(a.empty());
  EXPECT_EQ(a, b);
  EXPECT_EQ(read_json(d.file("quick/summary.json"))["steps"], read_json(d.file("replay/summary.json"))["steps"]);

  auto bad = run_keel({"train", "--config", source_path("configs/synthetic_smoke.toml"), "--run.name=caf\xe9",
                       "--run.dir=" + d.file("bad"), "--print-config"});
  EXPECT_EQ(bad.exit_code, 2) << bad.output;
  EXPECT_TRUE(contains(bad.output, "run.name")) << bad.output;
  EXPECT_TRUE(contains(bad.output, "UTF-8")) << bad.output;
}

// Class 4: a second run on a run.dir or a checkpoint.dir that a running job holds is refused
// on every rank, exit 2, naming the directory and the holder; the lock is the kernel's (flock),
// so it goes with the holder however it ends, SIGKILL included.
TEST(Hardening, ASecondRunOnTheSameDirectoriesIsRefusedNamingTheHolder) {
  TempDir d;
  Child first = spawn_keel(run_args(d.path(), 100000000, {"--checkpoint.interval=50"}));
  struct KillAtExit {  // whatever fails below, the first run does not outlive the test
    Child& c;
    ~KillAtExit() {
      if (c.pid > 0) ::kill(-c.pid, SIGKILL), ::kill(c.pid, SIGKILL);
    }
  } guard{first};
  const std::string metrics = d.file("run/metrics.jsonl");
  for (int i = 0; i < 3000 && !(exists(metrics) && read_text(metrics).size() > 200); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  ASSERT_TRUE(exists(metrics)) << "the first run never started";
  const std::string holder = "pid " + std::to_string(first.pid);

  // The same run.dir, 2 ranks: refused on both, naming run.dir and the first run's pid.
  auto same_run = run_keel_ranks(2, {"train", "--model.name=mlp", "--data.name=synthetic", "--train.steps=2",
                                     "--run.dir=" + d.file("run"), "--run.threads=1"});
  for (size_t k = 0; k < same_run.size(); ++k) {
    EXPECT_EQ(same_run[k].exit_code, 2) << "rank " << k << ":\n" << same_run[k].output;
    EXPECT_TRUE(contains(same_run[k].output, "run.dir")) << same_run[k].output;
  }
  EXPECT_TRUE(contains(same_run[0].output, holder)) << same_run[0].output;
  // Another run.dir, the same checkpoint.dir: refused naming checkpoint.dir; the first run's
  // files are untouched (its metrics go on growing).
  auto same_ckpt = run_keel({"train", "--model.name=mlp", "--data.name=synthetic", "--train.steps=2",
                             "--run.dir=" + d.file("other"), "--checkpoint.dir=" + d.file("ckpt"), "--run.threads=1"});
  EXPECT_EQ(same_ckpt.exit_code, 2) << same_ckpt.output;
  EXPECT_TRUE(contains(same_ckpt.output, "checkpoint.dir")) << same_ckpt.output;
  EXPECT_TRUE(contains(same_ckpt.output, holder)) << same_ckpt.output;
  EXPECT_TRUE(exists(metrics));

  ::kill(first.pid, SIGKILL);
  wait_process(first, 60);
  first.pid = -1;
  auto after = run_keel(run_args(d.path(), 3));
  EXPECT_EQ(after.exit_code, 0) << after.output;
}

// Class 8: checkpoint metadata is read within a bound (as configs are) and the file is named:
// a 64 GiB meta.json (sparse), a meta.json padded with zero bytes, a 64 GiB optimizer index.
// The step is unusable (fallback to step 5, exit 0) and `keel inspect` names the file.
TEST(Hardening, CheckpointMetadataIsReadWithinABoundNamingTheFile) {
  TempDir base;
  auto r0 = run_keel(run_args(base.path(), 10));
  ASSERT_EQ(r0.exit_code, 0) << r0.output;
  struct Case {
    const char* file;
    uint64_t size;  // 0: pad with 1 MiB of zero bytes
    const char* says;
  };
  const std::vector<Case> cases = {{"meta.json", uint64_t{64} << 30, "68719476736 bytes"},
                                   {"meta.json", 0, "NUL byte"},
                                   {"optimizer.safetensors.index.json", uint64_t{64} << 30, "68719476736 bytes"}};
  for (const auto& c : cases) {
    SCOPED_TRACE(std::string(c.file) + (c.size ? " huge" : " padded"));
    TempDir d;
    copy_tree(base.file("ckpt"), d.file("ckpt"));
    const std::string path = d.file("ckpt/step_10/") + c.file;
    if (c.size) {
      std::filesystem::resize_file(path, c.size);
    } else {
      write_text(path, read_text(path) + std::string(size_t{1} << 20, '\0'));
    }
    auto inspect = run_keel({"inspect", d.file("ckpt")});
    EXPECT_EQ(inspect.exit_code, 1) << inspect.output;
    EXPECT_TRUE(contains(inspect.output, path)) << inspect.output;
    EXPECT_TRUE(contains(inspect.output, c.says)) << inspect.output;
    auto r = run_keel(run_args(d.path(), 12));
    EXPECT_EQ(r.exit_code, 0) << r.output;
    EXPECT_TRUE(contains(r.output, path)) << r.output;
    EXPECT_FALSE(contains(r.output, "bad_alloc")) << r.output;
    EXPECT_EQ(summary_of(d.path())["resumed_from_step"], 5);
  }
}

// model.name = "python": a module whose forward raises (its own exception, or a torch error at its
// line: a Linear whose in_features do not fit the data), or whose output keel's loss cannot take
// (a tuple, a 1-D tensor, a last dimension other than model.num_classes, which used to compile and
// then read out of bounds inside the package), is the user's input: refused at packaging with exit
// 2 naming the module's file and line (and model.num_classes), never exit 1 or a C++ backtrace.
TEST(Hardening, APythonModuleThatRaisesOrReturnsTheWrongShapeIsRefusedNamingTheFileAndLine) {
  TempDir d;
  // Line 6 is forward's `def`, line 7 its body.
  auto module = [&](const std::string& name, const std::string& linear, const std::string& body) {
    const std::string file = d.file(name + ".py");
    write_text(file,
               "import torch\n"
               "class Net(torch.nn.Module):\n"
               "    def __init__(self):\n"
               "        super().__init__()\n"
               "        self.fc = torch.nn.Linear(" +
                   linear +
                   ")\n"
                   "    def forward(self, x):\n"
                   "        " +
                   body +
                   "\n"
                   "def build_model():\n"
                   "    return Net()\n");
    return file;
  };
  auto run = [&](const std::string& file, const std::string& sub) {
    return run_keel({"train", "--model.name=python", "--model.path=" + file, "--compile.mode=inductor",
                     "--compile.cache_dir=" + d.file("cache"), "--data.name=synthetic", "--data.synthetic_size=512",
                     "--train.batch_size=8", "--train.steps=2", "--run.threads=1", "--run.dir=" + d.file(sub),
                     "--dist.timeout_s=300"},
                    {}, 300);
  };
  struct Case {
    std::string name, linear, body;
    std::vector<std::string> says;
  };
  const std::vector<Case> cases = {
      {"raises", "784, 10", "raise ValueError(\"boom from forward\")", {":7: ValueError: boom from forward"}},
      {"wrong_in", "100, 10", "return self.fc(x.flatten(1))", {":7: RuntimeError", "[8, 784] X [100, 10]"}},
      {"tuple", "784, 10", "return self.fc(x.flatten(1)), x", {":6 (Net.forward)", "returns a tuple"}},
      {"one_d", "784, 10", "return self.fc(x.flatten(1)).sum(1)", {":6 (Net.forward)", "logits of shape [8]"}},
      {"five", "784, 5", "return self.fc(x.flatten(1))", {":6 (Net.forward)", "[8, 5]", "model.num_classes = 10"}},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    const std::string file = module(c.name, c.linear, c.body);
    auto r = run(file, c.name);
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_FALSE(r.signaled) << r.output;
    EXPECT_TRUE(contains(r.output, "model.path " + file)) << r.output;
    for (const auto& s : c.says) EXPECT_TRUE(contains(r.output, s)) << s << "\n" << r.output;
    EXPECT_FALSE(contains(r.output, "the packaging step failed")) << r.output;
    EXPECT_FALSE(contains(r.output, "index out of bounds")) << r.output;
    EXPECT_FALSE(exists(d.file(c.name + "/summary.json"))) << "no training step ran";
  }
}

// An export never lands where a run would remove it (issue 44, item 5): a directory named as a
// step of a checkpoint directory (step_<N> beside committed steps) would be taken by the next run
// on that directory for an uncommitted step and deleted. Refused, exit 2, nothing written.
TEST(Hardening, AnExportNamedAsAStepOfTheCheckpointDirectoryIsRefused) {
  TempDir d;
  auto r = run_keel(run_args(d.path(), 5));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (const std::string out : {d.file("ckpt/step_9"), d.file("ckpt/step_9/"), d.file("ckpt/./step_10")}) {
    auto x = run_keel({"export", d.file("ckpt/step_5"), out});
    EXPECT_EQ(x.exit_code, 2) << out << "\n" << x.output;
    EXPECT_TRUE(contains(x.output, "named as a step of the checkpoint directory")) << x.output;
  }
  EXPECT_FALSE(std::filesystem::exists(d.file("ckpt/step_9")));
  EXPECT_FALSE(std::filesystem::exists(d.file("ckpt/step_10")));
  // Beside the checkpoint directory, or under another name in it, the export is made.
  auto ok = run_keel({"export", d.file("ckpt/step_5"), d.file("ckpt/exported")});
  EXPECT_EQ(ok.exit_code, 0) << ok.output;
}

// The packaging step's Python is the user's setting (compile.python): one that does not exist or
// has no torch is refused naming the key, exit 2 (issue 44, item 5: exit 1, "the packaging step
// failed (exit 127)", the key unnamed).
TEST(Hardening, APackagingPythonThatCannotRunTheStepIsRefusedNamingCompilePython) {
  TempDir d;
  auto run = [&](const std::string& python, const std::string& sub) {
    return run_keel({"train", "--model.name=mlp", "--data.name=synthetic", "--train.steps=1", "--run.threads=1",
                     "--compile.mode=inductor", "--compile.python=" + python, "--compile.cache_dir=" + d.file("cache"),
                     "--run.dir=" + d.file(sub)});
  };
  auto missing = run(d.file("no/python"), "a");
  EXPECT_EQ(missing.exit_code, 2) << missing.output;
  EXPECT_TRUE(contains(missing.output, "compile.python = \"" + d.file("no/python") + "\": not an executable file"))
      << missing.output;
  // A real Python that sees no site-packages, so no torch.
  const std::string bare = d.file("bare-python");
  write_text(bare, "#!/bin/sh\nexec python3 -I -S \"$@\"\n");
  ASSERT_EQ(::chmod(bare.c_str(), 0755), 0);
  auto no_torch = run(bare, "b");
  EXPECT_EQ(no_torch.exit_code, 2) << no_torch.output;
  EXPECT_TRUE(contains(no_torch.output, "No module named 'torch'")) << no_torch.output;
  EXPECT_TRUE(contains(no_torch.output, "set compile.python to a Python with torch")) << no_torch.output;
  // Programs that are not a Python (issue 64, item 7: exit 1, "the packaging step wrote no usable
  // package", the key unnamed): /bin/true ends with status 0 having run nothing, /bin/false with 1.
  for (const char* program : {"/bin/true", "/bin/false"}) {
    auto r = run(program, std::string("c") + program);
    EXPECT_EQ(r.exit_code, 2) << program << ": " << r.output;
    EXPECT_TRUE(contains(r.output, std::string("compile.python = \"") + program + "\" does not run Python 3"))
        << r.output;
  }
}

// SIGTERM while the step is being packaged (a compile of minutes on a large model) is passed on
// to the packaging step at once and ends the run with 143 (issue 44, item 5: keel waited for the
// whole compile; SIGINT ended as exit 1, the packager's KeyboardInterrupt).
TEST(Hardening, SigtermWhileTheStepIsPackagedEndsTheRunAtOnceWith143) {
  TempDir d;
  Child run =
      spawn_keel({"train", "--model.name=mlp", "--data.name=synthetic", "--train.steps=1", "--run.threads=1",
                  "--compile.mode=inductor", "--compile.cache_dir=" + d.file("cache"), "--run.dir=" + d.file("run")});
  bool packaging = false;
  for (int i = 0; i < 6000 && !packaging; ++i) {
    packaging = contains(read_text(run.output_path), "compile: packaging the mlp training step");
    if (!packaging) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ASSERT_TRUE(packaging) << read_text(run.output_path);
  const auto t0 = std::chrono::steady_clock::now();
  ::kill(run.pid, SIGTERM);
  const auto r = wait_process(run, 120);
  const double waited_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_FALSE(r.timed_out) << r.output;
  EXPECT_EQ(r.exit_code, 128 + SIGTERM) << r.output;
  EXPECT_TRUE(contains(r.output, "stopped by signal 15 while")) << r.output;
  // The packaging step was stopped, not waited out: it never published its package (by rename,
  // at its end).
  for (const auto& e : std::filesystem::directory_iterator(d.file("cache/inductor")))
    EXPECT_NE(e.path().extension(), ".pt2") << e.path() << ": the compile ran to its end";
  std::printf("exit %d %.1f s after SIGTERM\n", r.exit_code, waited_s);
}

// Issue 64 item 4, the compile cache's leftovers from the last round:
//  - a relative compile.cache_dir packages (it failed in Inductor's C++ compile: the packaging
//    step's compilers run in another directory), here on 2 ranks of a Python module;
//  - the rank that waited while the other packaged says so (summary.json's compile_cache =
//    "waited", its log "another process made"), instead of "hit";
//  - the module's initial weights are read back only as their manifest says: changed on disk,
//    they are taken again (warned), never used silently;
//  - a module whose import or factory ends the interpreter with status 0 (sys.exit(0), or
//    os._exit(0), which Python cannot catch) is exit 2 naming model.path, not exit 1 naming a
//    cache file.
TEST(Hardening, TheCompileCacheIsRelativeSafeSaysWhoPackagedAndReadsBackOnlyWhatItsManifestSays) {
  TempDir d;
  auto module = [&](const std::string& name, const std::string& before) {
    const std::string file = d.file(name + ".py");
    write_text(file, "import os, sys\nimport torch\n" + before +
                         "class Net(torch.nn.Module):\n"
                         "    def __init__(self):\n"
                         "        super().__init__()\n"
                         "        self.fc = torch.nn.Linear(784, 10)\n"
                         "    def forward(self, x):\n"
                         "        return self.fc(x.flatten(1))\n"
                         "def build_model():\n"
                         "    return Net()\n");
    return file;
  };
  // Relative to the working directory the ranks inherit (the test's), pointing into d.
  const std::string cache = std::filesystem::relative(d.file("cache")).string();
  ASSERT_NE(cache.front(), '/');
  auto args = [&](const std::string& file, const std::string& sub, int steps) {
    return std::vector<std::string>{"train",
                                    "--model.name=python",
                                    "--model.path=" + file,
                                    "--compile.mode=inductor",
                                    "--compile.cache_dir=" + cache,
                                    "--data.name=synthetic",
                                    "--data.synthetic_size=256",
                                    "--train.batch_size=8",
                                    "--train.steps=" + std::to_string(steps),
                                    "--train.eval_interval=0",
                                    "--run.threads=1",
                                    "--run.dir=" + d.file(sub),
                                    "--dist.timeout_s=600"};
  };
  // Two runs at once on the one cache (as two ranks of a job, or two jobs): one packages the
  // entry, the other waits for its lock and then loads it.
  const std::string net = module("net", "");
  Child a = spawn_keel(args(net, "a", 2)), b = spawn_keel(args(net, "b", 2));
  const ProcResult ra = wait_process(a, 900), rb = wait_process(b, 900);
  ASSERT_EQ(ra.exit_code, 0) << ra.output;
  ASSERT_EQ(rb.exit_code, 0) << rb.output;
  std::multiset<std::string> cached;
  for (const auto& [run, r] : {std::pair{"a", &ra}, std::pair{"b", &rb}}) {
    const std::string c = read_json(d.file(run) + "/summary.json")["compile_cache"];
    cached.insert(c);
    EXPECT_EQ(contains(r->output, "compile: another process made"), c == "waited") << r->output;
    EXPECT_EQ(contains(r->output, "compile: built the inductor package"), c == "miss") << r->output;
  }
  EXPECT_EQ(cached, (std::multiset<std::string>{"miss", "waited"}));
  // The initial weights changed on disk (a byte of a tensor's data): taken again, warned.
  std::string weights;
  for (const auto& e : std::filesystem::directory_iterator(d.file("cache/inductor")))
    if (e.path().extension() == ".safetensors") weights = e.path().string();
  ASSERT_FALSE(weights.empty());
  {
    std::string bytes = read_text(weights);
    bytes[bytes.size() - 3] ^= 0x40;
    write_text(weights, bytes);
  }
  auto again = run_keel(args(net, "again", 1), {}, 600);
  EXPECT_EQ(again.exit_code, 0) << again.output;
  EXPECT_TRUE(contains(again.output, weights + " cannot be used")) << again.output;
  EXPECT_TRUE(contains(again.output, "SHA-256 differs from its manifest")) << again.output;
  EXPECT_EQ(read_json(d.file("again") + "/summary.json")["compile_cache"], "hit") << again.output;
  // sys.exit(0) in the factory or at import, and os._exit(0): exit 2 naming model.path.
  for (const auto& [name, before] :
       std::vector<std::pair<std::string, std::string>>{{"exits_in_factory", "def _boom():\n    sys.exit(0)\n"},
                                                        {"exits_at_import", "sys.exit(0)\n"},
                                                        {"os_exit", "os._exit(0)\n"}}) {
    std::string file = module(name, before);
    if (name == "exits_in_factory") {  // the factory calls it
      std::string text = read_text(file);
      text.replace(text.find("    return Net()"), 16, "    _boom()\n    return Net()");
      write_text(file, text);
    }
    auto r = run_keel(args(file, name, 1), {}, 300);
    EXPECT_EQ(r.exit_code, 2) << name << "\n" << r.output;
    EXPECT_TRUE(contains(r.output, "model.path = \"" + file + "\"")) << name << "\n" << r.output;
    EXPECT_FALSE(contains(r.output, "the packaging step failed")) << name << "\n" << r.output;
  }
  // Not the module's doing but compile.python's: a program that is no Python, named as such.
  auto not_python = args(module("fresh", "x = 1\n"), "true", 1);  // nothing of it cached
  not_python.push_back("--compile.python=/bin/true");
  auto r = run_keel(not_python, {}, 300);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(contains(r.output, "compile.python = \"/bin/true\" does not run Python 3")) << r.output;
}
