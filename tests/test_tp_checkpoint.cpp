// Checkpoints of tensor-parallel runs (issue 45, item 5): a step holds the whole tensors of a
// tp = 1 run (the same names, dtypes and shapes, so `keel export --hf` and `keel inspect` see no
// difference), each written by one rank; a resume at the same mesh is bit-exact, and a step
// resumes at another (dp, tp, dist.zero): tp 2 -> tp 1, (dp 2, zero 3) -> (dp 1, tp 2); and
// model.init_from loads whole weights into a tp run.
//
// Tolerances: runs at another mesh differ from one rank's only in the order of float32 sums
// (tensor parallelism's reductions, ZeRO's reduce-scatter), compared by the derived bounds of
// tests/helpers.h (adamw_reorder_bound). A gradient element of these 2-block models passes
// through at most 6 reductions that tensor parallelism reorders (two per block, the vocabulary
// lookup and the cross-entropy), each a sum and its all-reduce: 12 roundings. A resume that
// misplaced a slice (a q head read as a k head, another rank's vocabulary rows) moves the
// parameters by O(their size), and one that lost the optimizer state by O(lr) per element per
// step: orders of magnitude above the bound.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <string>
#include <tuple>
#include <vector>

#include "helpers.h"
#include "multirank.h"
#include "step_files.h"

using namespace keel::testing;

namespace {

constexpr int kTpRoundings = 12;
constexpr double kLr = 1e-3;  // train.lr's default

std::vector<std::string> run_args(const std::vector<std::string>& model, const std::string& dir, int steps, int batch,
                                  std::vector<std::string> extra) {
  extra.insert(extra.begin(), model.begin(), model.end());
  extra.insert(extra.begin(), "--train.batch_size=" + std::to_string(batch));
  return checkpointed_run_args(dir, steps, extra);
}

// `run`'s step 20 against one rank's: the same tensors (names, dtypes, shapes), within the bounds.
void expect_near_one_rank(const std::string& one, const std::string& run, const std::string& label,
                          int roundings = kTpRoundings) {
  expect_step_within_reorder_bound(one, run, 20, label, roundings, kLr);
}

int resumed_from(const std::string& dir) { return std::stoi(summary_field(dir + "/run", "resumed_from_step")); }

// One family: one rank, tp 2 whole and resumed at step 10, and tp 2's step 10 resumed at tp 1.
void expect_resumes(const std::vector<std::string>& model, const std::string& label) {
  TempDir d;
  const std::string one = d.file("one"), tp2 = d.file("tp2"), resumed = d.file("resumed"), to1 = d.file("to1");
  const std::vector<std::string> tp = {"--parallel.tp=2"};
  run_keel_job(1, run_args(model, one, 20, 8, {}));
  run_keel_job(2, run_args(model, tp2, 20, 8, tp));
  run_keel_job(2, run_args(model, resumed, 10, 8, tp));
  copy_tree(resumed, to1);
  run_keel_job(2, run_args(model, resumed, 20, 8, tp));
  run_keel_job(1, run_args(model, to1, 20, 8, {}));
  // The same mesh: bit for bit.
  EXPECT_EQ(resumed_from(resumed), 10) << label;
  for (const char* kind : {"model", "optimizer"})
    EXPECT_EQ(max_diff(tp2, resumed, 20, kind), 0.0) << label << " " << kind << ": the tp 2 resume is not bit-exact";
  EXPECT_EQ(metrics_losses(tp2 + "/run"), metrics_losses(resumed + "/run")) << label;
  // tp 2's files are one rank's tensors; tp 2 -> tp 1 continues as one rank does.
  expect_near_one_rank(one, tp2, label + ": tp 2 vs one rank");
  EXPECT_EQ(resumed_from(to1), 10) << label;
  expect_near_one_rank(one, to1, label + ": tp 2 resumed at tp 1 vs one rank");
  const auto a = metrics_losses(one + "/run"), b = metrics_losses(to1 + "/run");
  ASSERT_EQ(a.size(), b.size()) << label;
  for (size_t i = 0; i < a.size(); ++i)
    EXPECT_NEAR(b[i].second, a[i].second, 1e-5 * std::abs(a[i].second)) << label << " at step " << a[i].first;
}

const std::vector<std::string> kGpt = {"--model.name=gpt", "--model.width=32", "--model.depth=2", "--model.heads=4",
                                       "--model.context=16"};

}  // namespace

TEST(TensorParallel, AGptStepHoldsWholeTensorsAndResumesAtTp2ExactlyAndAtTp1) { expect_resumes(kGpt, "gpt"); }

TEST(TensorParallel, ALlamaWithGqaStepHoldsWholeTensorsAndResumesAtTp2ExactlyAndAtTp1) {
  expect_resumes({"--model.name=llama", "--model.width=32", "--model.depth=2", "--model.heads=4", "--model.context=16",
                  "--model.kv_heads=2", "--model.ffn_width=64"},
                 "llama");
}

// (dp 2, zero 3) -> (dp 1, tp 2) with the same global batch; and model.init_from's whole
// weights into a tp 2 run: its first loss is one rank's.
TEST(TensorParallel, AZero3StepResumesAtTp2AndInitFromLoadsWholeWeightsIntoTp2) {
  TempDir d;
  const std::string one = d.file("one"), z3 = d.file("z3");
  run_keel_job(1, run_args(kGpt, one, 20, 8, {}));
  run_keel_job(2, run_args(kGpt, z3, 10, 4, {"--dist.zero=3"}));
  run_keel_job(2, run_args(kGpt, z3, 20, 8, {"--parallel.tp=2"}));
  EXPECT_EQ(resumed_from(z3), 10);
  expect_near_one_rank(one, z3, "gpt: (dp 2, zero 3) resumed at (dp 1, tp 2) vs one rank");

  const std::string init = "--model.init_from=" + one + "/ckpt/step_20";
  run_keel_job(1, run_args(kGpt, d.file("init1"), 1, 8, {init}));
  run_keel_job(2, run_args(kGpt, d.file("init2"), 1, 8, {init, "--parallel.tp=2"}));
  const auto a = metrics_losses(d.file("init1") + "/run"), b = metrics_losses(d.file("init2") + "/run");
  ASSERT_EQ(a.size(), 1u);
  ASSERT_EQ(b.size(), 1u);
  EXPECT_NEAR(b[0].second, a[0].second, 1e-5 * std::abs(a[0].second)) << "the first loss from model.init_from";
  // (and not a fresh model's: the loaded one has trained 20 steps)
  EXPECT_LT(a[0].second, metrics_losses(one + "/run")[0].second);
}

// ZeRO over the dp axis of a tp mesh (item 4 with item 5): a step of (dp 2, tp 2, zero 3) with
// sequence parallelism is written by each parameter's ZeRO owner's tp group (its pieces made a
// whole tp slice over dp, then a whole tensor over tp) and resumes bit-exactly at its mesh, and
// at one rank and at (dp 1, tp 2, zero 1); a step of (dp 2, tp 2, zero 1) resumes at (dp 2,
// zero 2) without tp. One more reordered sum (the dp average) than tp alone: kTpRoundings + 1.
TEST(TensorParallel, ZeroOverTp2StepsResumeAtTheirMeshExactlyAndAtAnyOther) {
  TempDir d;
  const std::string one = d.file("one"), whole = d.file("whole"), part = d.file("part"), to1 = d.file("to1"),
                    to_zero1 = d.file("to_zero1"), z1 = d.file("z1");
  const std::vector<std::string> z3 = {"--parallel.tp=2", "--parallel.sequence_parallel=true", "--dist.zero=3"};
  run_keel_job(1, run_args(kGpt, one, 20, 8, {}));
  run_keel_job(4, run_args(kGpt, whole, 20, 4, z3));
  run_keel_job(4, run_args(kGpt, part, 10, 4, z3));
  copy_tree(part, to1);
  copy_tree(part, to_zero1);
  run_keel_job(4, run_args(kGpt, part, 20, 4, z3));
  EXPECT_EQ(resumed_from(part), 10);
  for (const char* kind : {"model", "optimizer"})
    EXPECT_EQ(max_diff(whole, part, 20, kind), 0.0) << kind << ": the (dp 2, tp 2, zero 3) resume is not bit-exact";
  EXPECT_EQ(metrics_losses(whole + "/run"), metrics_losses(part + "/run"));
  expect_near_one_rank(one, whole, "gpt: (dp 2, tp 2, zero 3, sp) vs one rank", kTpRoundings + 1);
  run_keel_job(1, run_args(kGpt, to1, 20, 8, {}));
  EXPECT_EQ(resumed_from(to1), 10);
  expect_near_one_rank(one, to1, "gpt: (dp 2, tp 2, zero 3, sp) resumed at one rank", kTpRoundings + 1);
  run_keel_job(2, run_args(kGpt, to_zero1, 20, 8, {"--parallel.tp=2", "--dist.zero=1"}));
  EXPECT_EQ(resumed_from(to_zero1), 10);
  expect_near_one_rank(one, to_zero1, "gpt: (dp 2, tp 2, zero 3, sp) resumed at (dp 1, tp 2, zero 1)",
                       kTpRoundings + 1);

  run_keel_job(4, run_args(kGpt, z1, 10, 4, {"--parallel.tp=2", "--dist.zero=1"}));
  run_keel_job(2, run_args(kGpt, z1, 20, 4, {"--dist.zero=2"}));
  EXPECT_EQ(resumed_from(z1), 10);
  expect_near_one_rank(one, z1, "gpt: (dp 2, tp 2, zero 1) resumed at (dp 2, zero 2)", kTpRoundings + 1);
}

// Dropout at tp 2 (each rank's own masks for its heads and, with sequence parallelism, its
// positions, drawn from a seed of the shared generator, whose state the step holds): a resume at
// step 10 trains on bit for bit, at (dp 1, tp 2, sp) and at (dp 2, tp 2, zero 1) without sp.
TEST(TensorParallel, WithDropoutAStepResumesAtItsMeshBitExactly) {
  auto model = kGpt;
  model.push_back("--model.dropout=0.2");
  for (const auto& [ranks, batch, mesh] : std::vector<std::tuple<int, int, std::vector<std::string>>>{
           {2, 8, {"--parallel.tp=2", "--parallel.sequence_parallel=true"}},
           {4, 4, {"--parallel.tp=2", "--dist.zero=1"}}}) {
    TempDir d;
    const std::string whole = d.file("whole"), part = d.file("part"), label = mesh.back();
    run_keel_job(ranks, run_args(model, whole, 20, batch, mesh));
    run_keel_job(ranks, run_args(model, part, 10, batch, mesh));
    run_keel_job(ranks, run_args(model, part, 20, batch, mesh));
    EXPECT_EQ(resumed_from(part), 10) << label;
    for (const char* kind : {"model", "optimizer"})
      EXPECT_EQ(max_diff(whole, part, 20, kind), 0.0) << label << " " << kind << ": the resume is not bit-exact";
    EXPECT_EQ(metrics_losses(whole + "/run"), metrics_losses(part + "/run")) << label;
  }
}

namespace {

// Issue 64 item 7 (the adversarial round): a step saved by fewer ranks than a tp group has,
// resumed at tp 2 with dropout. The ranks of a tp group must draw alike (their shared masks); rank
// 0 restored its saved generator while rank 1, which the step did not have, started from run.seed,
// and the masks parted silently. Now the tp group takes its first rank's generators after every
// resume: the tp run from one rank's step 5 saves equal generators at step 10 on both ranks, and
// resuming that step continues the run exactly.
TEST(TensorParallel, AStepOfFewerRanksResumedAtTp2GivesTheTpGroupOneGeneratorWithDropout) {
  TempDir d;
  std::vector<std::string> model = kGpt;
  model.push_back("--model.dropout=0.1");
  const std::string one = d.file("one"), tp2 = d.file("tp2"), again = d.file("again");
  run_keel_job(1, run_args(model, one, 5, 8, {}));
  std::filesystem::create_directories(tp2);
  std::filesystem::copy(one + "/ckpt", tp2 + "/ckpt", std::filesystem::copy_options::recursive);
  run_keel_job(2, run_args(model, tp2, 15, 8, {"--parallel.tp=2"}));
  ASSERT_EQ(resumed_from(tp2), 5);
  // The tp group's ranks drew alike from the resume on: the generators they saved at step 10 are
  // one (without the fix rank 1 kept its own, run.seed's, and they differ).
  const auto saved = step_tensors(tp2, 10, "rank");
  ASSERT_TRUE(saved.count("rank.0.rng.rng.cpu") && saved.count("rank.1.rng.rng.cpu")) << saved.size();
  EXPECT_TRUE(torch::equal(saved.at("rank.0.rng.rng.cpu"), saved.at("rank.1.rng.rng.cpu")))
      << "the tp group's generators parted after the resume";
  std::filesystem::create_directories(again + "/ckpt");
  std::filesystem::copy(tp2 + "/ckpt/step_10", again + "/ckpt/step_10", std::filesystem::copy_options::recursive);
  run_keel_job(2, run_args(model, again, 15, 8, {"--parallel.tp=2"}));
  ASSERT_EQ(resumed_from(again), 10);
  const auto want = metrics_losses(tp2 + "/run"), got = metrics_losses(again + "/run");
  ASSERT_EQ(want.size(), 10u);
  ASSERT_EQ(got.size(), 5u);
  for (size_t i = 0; i < got.size(); ++i)
    EXPECT_EQ(got[i].second, want[i + 5].second) << "step " << got[i].first << ": the resume parted from the run";
}

}  // namespace
