// Activation checkpointing (train.activation_checkpointing = "blocks", issue 45 item 6): a block
// that keeps only its input and recomputes its activations in backward runs the same kernels on
// the same values as one that keeps them, under the forward's random generators (dropout) and
// autocast dtypes, so training is the same bit for bit: the per-step losses, gradient norms and
// every tensor of the final checkpoint, at one rank with dropout and bf16 autocast, under DDP with
// dropout, at dist.zero = 2 and 3 (the recomputation inside the block's gather) and at
// parallel.tp = 2 with sequence parallelism and dropout (its collectives issued again in backward,
// each rank's own masks drawn again). And the unit itself:
// recompute()'s gradients equal those of the plain computation, and its forward keeps no activation.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "dist/recompute.h"
#include "helpers.h"
#include "multirank.h"
#include "step_files.h"

using namespace keel::testing;

namespace {

std::vector<std::string> recompute_args(const std::vector<std::string>& model, const std::string& dir,
                                        const std::string& policy, std::vector<std::string> extra) {
  std::vector<std::string> a = {"train",
                                "--data.name=synthetic",
                                "--train.steps=8",
                                "--train.batch_size=8",
                                "--train.grad_clip=1",
                                "--train.eval_interval=8",
                                "--run.threads=1",
                                "--run.dir=" + dir + "/run",
                                "--checkpoint.dir=" + dir + "/ckpt",
                                "--checkpoint.interval=8",
                                "--train.activation_checkpointing=" + policy};
  a.insert(a.begin() + 1, model.begin(), model.end());
  a.insert(a.end(), extra.begin(), extra.end());
  return a;
}

// The same run with and without recomputation, on `ranks` ranks: equal to the last bit.
void expect_bit_identical(int ranks, const std::vector<std::string>& model, std::vector<std::string> extra,
                          const std::string& label) {
  TempDir d;
  std::string log;
  for (const char* policy : {"none", "blocks"}) {
    const auto args = recompute_args(model, d.file(policy), policy, extra);
    if (ranks == 1) {
      const auto r = run_keel(args);
      ASSERT_EQ(r.exit_code, 0) << label << ": " << r.output;
      log = r.output;
    } else {
      const auto rs = run_keel_ranks(ranks, args);
      expect_all_ok(rs);
      log = rs[0].output;
    }
  }
  EXPECT_NE(log.find("recompute: blocks (2 blocks' activations recomputed in backward)"), std::string::npos)
      << label << ": the recompute transform did not run: " << log;
  for (const char* field : {"loss", "grad_norm"})
    EXPECT_EQ(metrics_losses(d.file("none") + "/run", field), metrics_losses(d.file("blocks") + "/run", field))
        << label << " " << field;
  for (const char* kind : {"model", "optimizer"})
    EXPECT_EQ(max_diff(d.file("none"), d.file("blocks"), 8, kind), 0.0) << label << " " << kind;
}

const std::vector<std::string> kGpt = {"--model.name=gpt", "--model.width=32", "--model.depth=2", "--model.heads=4",
                                       "--model.context=16"};

}  // namespace

TEST(Recompute, BlocksTrainBitForBitAsWithoutAtOneRankWithDropoutAndBf16) {
  auto gpt = kGpt;
  gpt.push_back("--model.dropout=0.2");
  expect_bit_identical(1, gpt, {}, "gpt, dropout 0.2");
  expect_bit_identical(1, gpt, {"--amp.dtype=bf16"}, "gpt, dropout 0.2, bf16");
  expect_bit_identical(1,
                       {"--model.name=llama", "--model.width=32", "--model.depth=2", "--model.heads=4",
                        "--model.context=16", "--model.kv_heads=2", "--model.ffn_width=64"},
                       {}, "llama");
  expect_bit_identical(1,
                       {"--model.name=gpt2", "--model.width=32", "--model.depth=2", "--model.heads=4",
                        "--model.context=16", "--model.dropout=0.1"},
                       {}, "gpt2, dropout 0.1");
}

TEST(Recompute, BlocksTrainBitForBitAsWithoutUnderDdpZero2Zero3AndTp2) {
  auto dropout = kGpt;
  dropout.push_back("--model.dropout=0.2");
  expect_bit_identical(2, dropout, {}, "gpt, dropout 0.2, DDP (the Reducer's hooks fire in the recomputing backward)");
  expect_bit_identical(2, kGpt, {"--dist.zero=2"}, "gpt, dist.zero = 2");
  expect_bit_identical(2, kGpt, {"--dist.zero=3"}, "gpt, dist.zero = 3");
  expect_bit_identical(2, dropout, {"--parallel.tp=2", "--parallel.sequence_parallel=true"},
                       "gpt, dropout 0.2, tp 2, sp (each rank's own masks drawn again)");
}

// The unit: gradients of the input and of the parameters f uses equal the plain computation's,
// and the forward keeps only the input (the output's grad_fn is recompute's own node).
TEST(Recompute, GradientsEqualThePlainComputationsAndTheForwardKeepsNoActivation) {
  torch::manual_seed(0);
  auto lin = torch::nn::Linear(6, 6);
  auto f = [&](const torch::Tensor& t) { return torch::tanh(lin->forward(t)).pow(2); };
  const auto x0 = torch::randn({3, 6});
  auto plain_x = x0.clone().requires_grad_(true);
  f(plain_x).sum().backward();
  const auto want_w = lin->weight.grad().clone(), want_x = plain_x.grad().clone();
  lin->zero_grad();
  auto x = x0.clone().requires_grad_(true);
  const auto y = keel::dist::recompute(f, x);
  ASSERT_TRUE(y.grad_fn());
  EXPECT_EQ(y.grad_fn()->name(), "keel::RecomputeBackward");
  EXPECT_EQ(y.grad_fn()->next_edges().size(), 1u);  // the input alone: no saved activation edges
  y.sum().backward();
  EXPECT_TRUE(torch::equal(lin->weight.grad(), want_w));
  EXPECT_TRUE(torch::equal(x.grad(), want_x));
  // Without grad mode it is f(x).
  torch::NoGradGuard ng;
  EXPECT_FALSE(keel::dist::recompute(f, x).requires_grad());
}

TEST(Recompute, WhatItDoesNotServeIsRefusedByName) {
  const std::vector<std::string> base = {"train", "--data.name=synthetic", "--train.steps=1",
                                         "--train.activation_checkpointing=blocks"};
  for (const auto& [extra, message] : std::vector<std::pair<std::vector<std::string>, std::string>>{
           {{"--model.name=mlp"}, "recomputes a transformer's blocks: model.name = \"mlp\" is not one"},
           {{"--model.name=gpt", "--compile.mode=trace"}, "cannot be combined with compile.mode = \"trace\""},
           {{"--model.name=gpt", "--train.activation_checkpointing=selective"}, "\"selective\" (keep the matmul"},
           {{"--model.name=gpt", "--dist.find_unused_parameters=true"},
            "cannot be combined with dist.find_unused_parameters = true at dist.zero = 0"}}) {
    auto a = base;
    a.insert(a.end(), extra.begin(), extra.end());
    TempDir d;
    a.push_back("--run.dir=" + d.file("run"));
    const auto r = run_keel(a);
    EXPECT_EQ(r.exit_code, 2) << extra[0] << ": " << r.output;
    EXPECT_NE(r.output.find(message), std::string::npos) << extra[0] << ": " << r.output;
  }
}
