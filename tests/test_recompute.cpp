// Activation checkpointing (train.activation_checkpointing = "blocks" and "selective", issue 45
// item 6): a block that keeps only its input (blocks), or its input and its dense products
// (selective), and recomputes the rest of its activations in backward runs the same kernels on
// the same values as one that keeps them, under the forward's random generators (dropout) and
// autocast dtypes, so training is the same bit for bit: the per-step losses, gradient norms and
// every tensor of the final checkpoint, at one rank with dropout and bf16 autocast, under DDP with
// dropout, at dist.zero = 2 and 3 (the recomputation inside the block's gather) and at
// parallel.tp = 2 with sequence parallelism and dropout (its collectives issued again in backward,
// each rank's own masks drawn again). And the unit itself: recompute()'s gradients equal those of
// the plain computation, its forward keeps no activation (blocks) or only the dense products
// (selective), whose recomputation hands the kept product back instead of multiplying again.
// And what it is for, counted exactly (run.count_tensor_memory): blocks holds less activation
// memory than selective, which holds less than none.
#include <ATen/autocast_mode.h>
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "common/tensor_memory.h"
#include "dist/recompute.h"
#include "helpers.h"
#include "models/transformer.h"
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

// The same run without recomputation, with blocks and with selective, on `ranks` ranks: equal to
// the last bit.
void expect_bit_identical(int ranks, const std::vector<std::string>& model, std::vector<std::string> extra,
                          const std::string& label) {
  TempDir d;
  std::map<std::string, std::string> logs;
  for (const char* policy : {"none", "blocks", "selective"}) {
    const auto args = recompute_args(model, d.file(policy), policy, extra);
    if (ranks == 1) {
      const auto r = run_keel(args);
      ASSERT_EQ(r.exit_code, 0) << label << ", " << policy << ": " << r.output;
      logs[policy] = r.output;
    } else {
      const auto rs = run_keel_ranks(ranks, args);
      expect_all_ok(rs);
      logs[policy] = rs[0].output;
    }
  }
  EXPECT_NE(logs["blocks"].find("recompute: blocks (2 blocks' activations recomputed in backward)"), std::string::npos)
      << label << ": the recompute transform did not run: " << logs["blocks"];
  EXPECT_NE(logs["selective"].find("recompute: selective (2 blocks' dense products kept, their other activations "
                                   "recomputed in backward)"),
            std::string::npos)
      << label << ": the selective recompute transform did not run: " << logs["selective"];
  for (const char* policy : {"blocks", "selective"}) {
    for (const char* field : {"loss", "grad_norm"})
      EXPECT_EQ(metrics_losses(d.file("none") + "/run", field), metrics_losses(d.file(policy) + "/run", field))
          << label << ", " << policy << ": " << field;
    for (const char* kind : {"model", "optimizer"})
      EXPECT_EQ(max_diff(d.file("none"), d.file(policy), 8, kind), 0.0) << label << ", " << policy << ": " << kind;
  }
}

const std::vector<std::string> kGpt = {"--model.name=gpt", "--model.width=32", "--model.depth=2", "--model.heads=4",
                                       "--model.context=16"};

}  // namespace

TEST(Recompute, BlocksAndSelectiveTrainBitForBitAsWithoutAtOneRankWithDropoutAndBf16) {
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

TEST(Recompute, BlocksAndSelectiveTrainBitForBitAsWithoutUnderDdpZero2Zero3AndTp2) {
  auto dropout = kGpt;
  dropout.push_back("--model.dropout=0.2");
  expect_bit_identical(2, dropout, {}, "gpt, dropout 0.2, DDP (the Reducer's hooks fire in the recomputing backward)");
  expect_bit_identical(2, kGpt, {"--dist.zero=2"}, "gpt, dist.zero = 2");
  expect_bit_identical(2, kGpt, {"--dist.zero=3"}, "gpt, dist.zero = 3");
  expect_bit_identical(2, dropout, {"--parallel.tp=2", "--parallel.sequence_parallel=true"},
                       "gpt, dropout 0.2, tp 2, sp (each rank's own masks drawn again)");
}

// Each product form under tensor parallelism and bf16: llama's Linears without a bias (the
// row-parallel partial products among them) with sequence parallelism (x gathered, not
// contiguous), GPT-2's Conv1D (its row-parallel partial products a matmul without the bias).
TEST(Recompute, BlocksAndSelectiveTrainBitForBitAsWithoutAtTp2WithBf16ForLlamaAndGpt2) {
  expect_bit_identical(2,
                       {"--model.name=llama", "--model.width=32", "--model.depth=2", "--model.heads=4",
                        "--model.context=16", "--model.kv_heads=2", "--model.ffn_width=64"},
                       {"--parallel.tp=2", "--parallel.sequence_parallel=true", "--amp.dtype=bf16"},
                       "llama, tp 2, sp, bf16");
  expect_bit_identical(2,
                       {"--model.name=gpt2", "--model.width=32", "--model.depth=2", "--model.heads=4",
                        "--model.context=16", "--model.dropout=0.1"},
                       {"--parallel.tp=2", "--amp.dtype=bf16"}, "gpt2, dropout 0.1, tp 2, bf16");
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

// Selective, on each form of models::dense_product (a Linear with its bias added after the
// matmul, a Linear without a bias, GPT-2's Conv1D as one addmm): the recomputation hands the
// forward's product back instead of multiplying again (the same storage; the Linear's bias is
// added into a copy in the forward, so it is left out of that check), and the output and the
// gradients equal the plain computation's bit for bit, also with bf16 autocast's casts.
TEST(Recompute, SelectiveKeepsTheDenseProductAndItsGradientsEqualThePlainComputations) {
  struct Form {
    const char* name;
    bool conv1d, bias;
  };
  for (const Form form :
       {Form{"linear + bias", false, true}, Form{"linear", false, false}, Form{"conv1d + bias", true, true}}) {
    for (const bool bf16 : {false, true}) {
      const std::string label = std::string(form.name) + (bf16 ? ", bf16" : ", fp32");
      torch::manual_seed(0);
      const auto w = (form.conv1d ? torch::randn({6, 5}) : torch::randn({5, 6})).requires_grad_(true);
      const auto b = form.bias ? torch::randn({5}).requires_grad_(true) : torch::Tensor();
      std::vector<const void*> products;  // each product's storage, as f saw it
      auto f = [&](const torch::Tensor& t) {
        keel::models::DenseTape* tape = keel::models::DenseTape::current();
        auto h = tape ? tape->project(t.tanh(), w, b, form.conv1d)
                      : keel::models::dense_product(t.tanh(), w, b, form.conv1d);
        products.push_back(h.data_ptr());
        return torch::sigmoid(h).pow(2);
      };
      // Autocast around the forwards only, as the trainer has it; each forward casts afresh.
      auto autocast = [bf16](bool on) {
        at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
        at::autocast::set_autocast_enabled(at::kCPU, on && bf16);
        at::autocast::clear_cache();
      };
      auto grads = [&](const torch::Tensor& x) {
        std::vector<torch::Tensor> g{x.grad(), w.grad().clone()};
        if (b.defined()) g.push_back(b.grad().clone());
        w.mutable_grad().reset();
        if (b.defined()) b.mutable_grad().reset();
        return g;
      };
      const auto x0 = torch::randn({2, 3, 6});
      auto plain_x = x0.clone().requires_grad_(true);
      autocast(true);
      const auto plain_y = f(plain_x);
      autocast(false);
      plain_y.sum().backward();
      const auto want = grads(plain_x);
      products.clear();
      const auto x = x0.clone().requires_grad_(true);
      autocast(true);
      const auto y = keel::dist::recompute(f, x, keel::dist::Recompute::Selective);
      autocast(false);
      ASSERT_EQ(y.grad_fn()->name(), "keel::RecomputeBackward");
      EXPECT_TRUE(torch::equal(y, plain_y)) << label;
      y.sum().backward();
      ASSERT_EQ(products.size(), 2u) << label;
      if (form.conv1d || !form.bias) EXPECT_EQ(products[0], products[1]) << label << ": the product was made again";
      const auto got = grads(x);
      for (size_t i = 0; i < want.size(); ++i)
        EXPECT_TRUE(torch::equal(got[i], want[i])) << label << ", gradient " << i;
    }
  }
}

// A second backward through a retained graph: blocks recomputes again, selective (whose kept
// products went to the first) says so instead of failing on a missing tensor.
TEST(Recompute, ASecondBackwardThroughARetainedGraphRecomputesOrIsRefusedByName) {
  torch::manual_seed(0);
  const auto w = torch::randn({5, 6}).requires_grad_(true);
  auto f = [&](const torch::Tensor& t) {
    keel::models::DenseTape* tape = keel::models::DenseTape::current();
    return (tape ? tape->project(t, w, {}, false) : keel::models::dense_product(t, w, {}, false)).tanh();
  };
  const auto x = torch::randn({2, 3, 6}).requires_grad_(true);
  auto blocks = keel::dist::recompute(f, x, keel::dist::Recompute::Blocks).sum();
  blocks.backward({}, /*retain_graph=*/true);
  const auto once = w.grad().clone();
  blocks.backward();
  EXPECT_TRUE(torch::allclose(w.grad(), 2 * once));
  auto selective = keel::dist::recompute(f, x, keel::dist::Recompute::Selective).sum();
  selective.backward({}, /*retain_graph=*/true);
  try {
    selective.backward();
    ADD_FAILURE() << "a second selective backward ran";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("ran a second time (retain_graph)"), std::string::npos) << e.what();
  }
}

TEST(Recompute, WhatItDoesNotServeIsRefusedByName) {
  const std::vector<std::string> base = {"train", "--data.name=synthetic", "--train.steps=1",
                                         "--train.activation_checkpointing=blocks"};
  for (const auto& [extra, message] : std::vector<std::pair<std::vector<std::string>, std::string>>{
           {{"--model.name=mlp"}, "recomputes a transformer's blocks: model.name = \"mlp\" is not one"},
           {{"--model.name=mlp", "--train.activation_checkpointing=selective"},
            "\"selective\" recomputes a transformer's blocks: model.name = \"mlp\""},
           {{"--model.name=gpt", "--compile.mode=trace"}, "cannot be combined with compile.mode = \"trace\""},
           {{"--model.name=gpt", "--train.activation_checkpointing=selective", "--compile.mode=trace"},
            "\"selective\" recomputes the eager blocks and cannot be combined with compile.mode"},
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

// run.count_tensor_memory (common/tensor_memory.h): every CPU tensor byte counted while it lives.
TEST(TensorMemory, CountsEveryLiveCpuTensorByteAndThePeak) {
  keel::count_tensor_memory();
  const auto before = keel::tensor_memory();
  ASSERT_TRUE(before.has_value());
  {
    const auto t = torch::empty({1000}, torch::kFloat);
    const auto during = keel::tensor_memory();
    EXPECT_EQ(during->live - before->live, 4000);
    EXPECT_GE(during->peak, during->live);
    const auto u = t.to(torch::kDouble);
    EXPECT_EQ(keel::tensor_memory()->live - before->live, 12000);
  }
  EXPECT_EQ(keel::tensor_memory()->live, before->live);
  EXPECT_GE(keel::tensor_memory()->peak, before->live + 12000);
}

// What activation checkpointing is for, counted exactly (the peak bytes of live CPU tensors over
// those alive at the end, when only the model, its gradients, the optimizer state and the data
// are): blocks holds less than selective, which holds less than none. The counts are
// deterministic (the same allocations every run), so the order is not a matter of noise: here
// about 36, 26 and 13 MiB, gaps far above what another CPU's kernels' workspaces could move.
TEST(Recompute, BlocksAndSelectiveHoldLessActivationMemoryThanNoneCountedExactly) {
  TempDir d;
  std::map<std::string, double> activation, end;
  for (const char* policy : {"none", "blocks", "selective"}) {
    const std::string dir = d.file(policy);
    const auto r =
        run_keel({"train", "--model.name=gpt", "--model.width=128", "--model.depth=4", "--model.heads=4",
                  "--model.context=256", "--data.name=synthetic", "--data.synthetic_size=64", "--train.steps=2",
                  "--train.batch_size=4", "--train.eval_interval=0", "--run.threads=1", "--run.dir=" + dir,
                  "--run.count_tensor_memory=true", std::string("--train.activation_checkpointing=") + policy});
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const double peak = std::stod(summary_field(dir, "cpu_tensor_peak_mb")),
                 after = std::stod(summary_field(dir, "cpu_tensor_end_mb"));
    EXPECT_GT(after, 0) << policy;
    activation[policy] = peak - after, end[policy] = after;
  }
  // What is alive at the end (the model, gradients, optimizer state, data) is the same bytes
  // whatever the policy: the differences are what the steps held.
  EXPECT_EQ(end["blocks"], end["none"]);
  EXPECT_EQ(end["selective"], end["none"]);
  std::printf("activation memory (MiB): none %.3f, blocks %.3f, selective %.3f\n", activation["none"],
              activation["blocks"], activation["selective"]);
  EXPECT_LT(activation["blocks"], activation["selective"]);
  EXPECT_LT(activation["selective"], activation["none"]);
}

// train.grads_to_none (the default): before a step the gradients nothing else holds are freed, as
// PyTorch's zero_grad(set_to_none=True), so the forward runs without them. At one rank that lowers
// the counted peak of a step whose activations dominate (here about 36 MiB of activations beside
// 3.3 MiB of gradients: the peak is in the forward or early in the backward) by at most the
// gradients' bytes, and training is the same bit for bit (a fresh gradient equals zero plus it).
// Under DDP the gradients are views of the Reducer's buckets and stay: the key changes nothing.
TEST(GradsToNone, AStepHoldsNoGradientUntilItsBackwardAndTrainsBitForBitAsWithZeroedOnes) {
  TempDir d;
  for (const int ranks : {1, 2}) {
    std::map<bool, double> peak, end;
    std::map<bool, std::string> dirs;
    for (const bool none : {true, false}) {
      const std::string dir = d.file(std::to_string(ranks) + (none ? "none" : "zeroed"));
      dirs[none] = dir;
      const std::vector<std::string> args = {"train",
                                             "--model.name=gpt",
                                             "--model.width=128",
                                             "--model.depth=4",
                                             "--model.heads=4",
                                             "--model.context=256",
                                             "--data.name=synthetic",
                                             "--data.synthetic_size=64",
                                             "--train.steps=2",
                                             "--train.batch_size=4",
                                             "--train.eval_interval=0",
                                             "--run.threads=1",
                                             "--run.dir=" + dir + "/run",
                                             "--checkpoint.dir=" + dir + "/ckpt",
                                             "--checkpoint.interval=2",
                                             "--run.count_tensor_memory=true",
                                             "--dist.timeout_s=60",
                                             std::string("--train.grads_to_none=") + (none ? "true" : "false")};
      if (ranks == 1) {
        const auto r = run_keel(args);
        ASSERT_EQ(r.exit_code, 0) << r.output;
      } else {
        expect_all_ok(run_keel_ranks(ranks, args));
      }
      peak[none] = std::stod(summary_field(dir + "/run", "cpu_tensor_peak_mb"));
      end[none] = std::stod(summary_field(dir + "/run", "cpu_tensor_end_mb"));
    }
    const std::string at = std::to_string(ranks) + " rank(s)";
    for (const char* kind : {"model", "optimizer"}) EXPECT_EQ(max_diff(dirs[true], dirs[false], 2, kind), 0.0) << at;
    EXPECT_EQ(metrics_losses(dirs[true] + "/run"), metrics_losses(dirs[false] + "/run")) << at;
    const double gradients_mb = std::stod(summary_field(dirs[true] + "/run", "gradient_bytes")) / (1 << 20);
    // Over Gloo the count is not the same bytes every run: a collective's Work, holding its small
    // tensors (8-byte scalars), is released by Gloo's worker thread after the waiting thread has
    // gone on, so one may still be alive when the count is read. That is bytes against the
    // gradients' megabytes, so at 2 ranks "the same" means within a 4 KiB slack, 800 times below
    // the 3.3 MiB the gradients would move the count by.
    const double slack_mb = ranks == 1 ? 0.0 : 4096.0 / (1 << 20);
    EXPECT_LE(std::abs(end[true] - end[false]), slack_mb) << at << ": the gradients are alive at the end either way";
    ASSERT_GT(gradients_mb, 100 * slack_mb) << at;
    std::printf("%s: counted peak %.3f MiB with grads_to_none, %.3f without; gradients %.3f MiB\n", at.c_str(),
                peak[true], peak[false], gradients_mb);
    if (ranks == 1) {
      EXPECT_LT(peak[true], peak[false]) << at;
      EXPECT_LE(peak[false] - peak[true], gradients_mb + 1e-9) << at;
    } else {
      EXPECT_LE(std::abs(peak[true] - peak[false]), slack_mb) << at << ": DDP's bucket views are zeroed, not freed";
    }
  }
}
