// Fault injection: entry parsing, and nonfinite_grad on one of 2 ranks with and without loss
// scaling (every rank skips, or every rank stops with an error; never one rank alone).
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "helpers.h"
#include "multirank.h"
#include "trainer/config.h"
#include "trainer/fault.h"

using keel::FaultPlan;
using namespace keel::testing;

namespace {

std::string plan_error(const std::vector<std::string>& entries, int64_t world = 2) {
  try {
    FaultPlan p(entries, world);
  } catch (const keel::InputError& e) {
    return e.what();
  }
  return "";
}

TEST(FaultPlan, ParsesEntriesAndFiresOncePerJob) {
  FaultPlan p({"nonfinite_grad@step=5,rank=1", "nonfinite_grad@rank=0,step=7,always"}, 2);
  ASSERT_EQ(p.entries().size(), 2u);
  EXPECT_TRUE(p.fires("nonfinite_grad", 5, 1, 0));
  EXPECT_FALSE(p.fires("nonfinite_grad", 5, 0, 0));
  EXPECT_FALSE(p.fires("nonfinite_grad", 6, 1, 0));
  EXPECT_FALSE(p.fires("nonfinite_grad", 5, 1, /*restart_count=*/1));  // not again after a restart
  EXPECT_TRUE(p.fires("nonfinite_grad", 7, 0, 2));                      // unless `always`
  EXPECT_TRUE(FaultPlan({}, 1).entries().empty());
}

TEST(FaultPlan, BadEntriesNameTheEntry) {
  EXPECT_NE(plan_error({"nonfinite_grad"}).find("missing '@'"), std::string::npos);
  EXPECT_NE(plan_error({"meteor@step=1,rank=0"}).find("unknown fault type 'meteor'"), std::string::npos);
  EXPECT_NE(plan_error({"oom@step=1,rank=0"}).find("not implemented"), std::string::npos);
  EXPECT_NE(plan_error({"nonfinite_grad@rank=0"}).find("step=S"), std::string::npos);
  EXPECT_NE(plan_error({"nonfinite_grad@step=x,rank=0"}).find("non-negative integer"), std::string::npos);
  EXPECT_NE(plan_error({"nonfinite_grad@step=1,rank=2"}, 2).find("rank 2 does not exist"), std::string::npos);
  // Config validation refuses a bad entry before anything runs.
  keel::Config cfg;
  cfg.fault.inject = {"nonfinite_grad@step=1"};
  EXPECT_THROW(keel::validate(cfg), keel::InputError);
}

std::vector<ProcResult> keel_ranks(const std::vector<std::string>& args) { return run_keel_ranks(2, args); }

std::vector<std::string> nonfinite_args(const std::string& dir) {
  return {"train", "--model.name=mlp", "--data.name=synthetic", "--train.steps=20", "--train.batch_size=16",
          "--run.threads=1", "--run.dir=" + dir, "--fault.inject=nonfinite_grad@step=5,rank=1"};
}

TEST(FaultNonfiniteGrad, WithLossScalingEveryRankSkipsTheStep) {
  TempDir d;
  auto args = nonfinite_args(d.file("run"));
  args.push_back("--amp.loss_scaling=dynamic");
  auto ranks = keel_ranks(args);
  for (auto& r : ranks) ASSERT_EQ(r.exit_code, 0) << r.output;
  auto s = nlohmann::json::parse(read_text(d.file("run/summary.json")));
  EXPECT_EQ(s["skipped_steps"], 1);
  EXPECT_EQ(s["steps"], 20);
  EXPECT_EQ(s["loss_scale"].get<double>(), 32768.0);
}

TEST(FaultNonfiniteGrad, WithoutScalingItIsAnErrorOnEveryRank) {
  TempDir d;
  auto ranks = keel_ranks(nonfinite_args(d.file("run")));
  for (size_t r = 0; r < ranks.size(); ++r) {
    EXPECT_FALSE(ranks[r].signaled) << ranks[r].output;
    EXPECT_EQ(ranks[r].exit_code, 1) << ranks[r].output;
    EXPECT_NE(ranks[r].output.find("non-finite"), std::string::npos) << ranks[r].output;
    EXPECT_NE(ranks[r].output.find("step 5"), std::string::npos) << ranks[r].output;
  }
}

TEST(FaultNonfiniteGrad, SkipNonfiniteSkipsOnEveryRank) {
  TempDir d;
  auto args = nonfinite_args(d.file("run"));
  args.push_back("--train.skip_nonfinite=true");
  auto ranks = keel_ranks(args);
  for (auto& r : ranks) ASSERT_EQ(r.exit_code, 0) << r.output;
  auto s = nlohmann::json::parse(read_text(d.file("run/summary.json")));
  EXPECT_EQ(s["skipped_steps"], 1);
  EXPECT_TRUE(std::isfinite(s["final_loss"].get<double>()));
}

}  // namespace
