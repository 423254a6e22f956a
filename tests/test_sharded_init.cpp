// Sharded initialisation (model.sharded_init, issue 45 item 7; models/deferred_init.h): at
// parallel.tp > 1 and dist.zero = 3 the transformer families are built as each rank's shards,
// and at dist.zero = 3 the image models too; what they train from is the unsharded build's, bit
// for bit.
//
// In one process: a deferred build holds one element per parameter, moves the CPU generator
// exactly as the whole build does (so every later draw of the run is unchanged), and makes each
// parameter, and each tensor-parallel slice of one, equal to the whole build's to the last bit
// (mlp and cnn: LibTorch's own layer initialisation, replayed from the generator's state).
// Through `keel train`: runs with model.sharded_init on and off at the same mesh (tp 2, dp 2 with
// ZeRO-3, both at 4 ranks; from model.init_from too; mlp and cnn at dp 2 with ZeRO-3) write bit-identical steps and
// losses: the same kernels then run on the same values, so there is no tolerance to derive.
#include <gtest/gtest.h>

#include <ATen/CPUGeneratorImpl.h>

#include <cstring>
#include <string>
#include <vector>

#include "helpers.h"
#include "keel/models/model.h"
#include "models/deferred_init.h"
#include "models/transformer.h"
#include "multirank.h"
#include "step_files.h"

using namespace keel::testing;
using keel::models::DeferredInit;

namespace {

bool bit_equal(const torch::Tensor& a, const torch::Tensor& b) {
  if (a.sizes() != b.sizes() || a.scalar_type() != b.scalar_type()) return false;
  const auto x = a.contiguous(), y = b.contiguous();
  return std::memcmp(x.data_ptr(), y.data_ptr(), x.numel() * x.element_size()) == 0;
}

torch::Tensor generator_state() { return at::detail::getDefaultCPUGenerator().get_state(); }

keel::ModelConfig model_config(const std::string& name) {
  keel::ModelConfig c;
  c.name = name;
  c.width = 32;
  c.depth = 2;
  c.heads = 4;
  c.context = 16;
  if (name == "llama") c.kv_heads = 2, c.ffn_width = 64;
  if (name != "gpt") c.tie_embeddings = false;  // an lm_head of its own, split by vocabulary too
  return c;
}

void expect_deferred_build_equals_whole(const std::string& name) {
  const keel::ModelConfig cfg = model_config(name);
  torch::manual_seed(11);
  const auto whole = keel::models::create_model(cfg);
  const torch::Tensor after_whole = generator_state();
  torch::manual_seed(11);
  DeferredInit d;
  std::shared_ptr<keel::models::Model> lazy;
  {
    DeferredInit::Use use(&d);
    lazy = keel::models::create_model(cfg);
  }
  EXPECT_TRUE(torch::equal(generator_state(), after_whole)) << name << ": the generator did not move as the build's";
  const torch::Tensor after_build = generator_state();
  const auto W = whole->named_parameters(), L = lazy->named_parameters();
  ASSERT_EQ(W.size(), L.size()) << name;
  ASSERT_EQ(d.size(), L.size()) << name;
  int64_t held = 0, largest = 0;
  for (size_t i = 0; i < W.size(); ++i) {
    ASSERT_EQ(L[i].first, W[i].first) << name;
    EXPECT_EQ(L[i].second.sizes(), W[i].second.sizes()) << name << " " << L[i].first;
    held += static_cast<int64_t>(L[i].second.storage().nbytes());
    largest = std::max<int64_t>(largest, W[i].second.numel() * W[i].second.element_size());
    EXPECT_TRUE(bit_equal(d.value(L[i].second), W[i].second)) << name << " " << L[i].first;
  }
  EXPECT_LE(held, static_cast<int64_t>(L.size()) * 8) << name << ": the deferred model holds its parameters";
  EXPECT_EQ(d.largest_transient_bytes(), largest) << name;

  // Each tensor-parallel slice (rank 1 of 2) of a deferred parameter is the whole build's slice
  // (the image models have no tensor-parallel plan).
  if (const auto* family = keel::models::transformer_family(name)) {
    int sliced = 0;
    for (size_t i = 0; i < W.size(); ++i)
      if (const keel::models::TpRule* rule = keel::models::tp_rule(family->tp_plan, L[i].first)) {
        keel::models::keep_tp_slice(L[i].second, *rule, 1, 2, &d);
        const torch::Tensor want = keel::models::tp_slice(W[i].second.detach(), *rule, 1, 2);
        EXPECT_EQ(L[i].second.sizes(), want.sizes()) << name << " " << L[i].first;
        EXPECT_TRUE(bit_equal(d.value(L[i].second), want)) << name << " " << L[i].first;
        ++sliced;
      }
    EXPECT_GE(sliced, 2 * 6) << name;  // every block's projections at least
  }
  d.make_all(L);
  EXPECT_TRUE(d.empty());
  // Making values (replayed draws; LibTorch's layers built again from recorded states) leaves the
  // generator be.
  EXPECT_TRUE(torch::equal(generator_state(), after_build)) << name << ": making the values moved the generator";
}

std::vector<std::string> run_args(const std::vector<std::string>& model, const std::string& dir,
                                  std::vector<std::string> extra) {
  std::vector<std::string> a = {"train",
                                "--data.name=synthetic",
                                "--train.steps=2",
                                "--train.batch_size=8",
                                "--train.eval_interval=0",
                                "--run.threads=1",
                                "--run.dir=" + dir + "/run",
                                "--checkpoint.dir=" + dir + "/ckpt",
                                "--checkpoint.interval=2",
                                "--dist.timeout_s=60"};
  a.insert(a.begin() + 1, model.begin(), model.end());
  a.insert(a.end(), extra.begin(), extra.end());
  return a;
}

// `ranks` ranks at `mesh`, with sharded initialisation and without: bit-identical steps.
void expect_same_as_whole_build(const std::vector<std::string>& model, int ranks, std::vector<std::string> mesh,
                                const std::string& label) {
  TempDir d;
  const std::string sharded = d.file("sharded"), whole = d.file("whole");
  const auto a = run_keel_ranks(ranks, run_args(model, sharded, mesh));
  expect_all_ok(a);
  mesh.push_back("--model.sharded_init=false");
  const auto b = run_keel_ranks(ranks, run_args(model, whole, mesh));
  expect_all_ok(b);
  EXPECT_NE(a[0].output.find("built as this rank's shards"), std::string::npos) << label << a[0].output;
  EXPECT_EQ(b[0].output.find("built as this rank's shards"), std::string::npos) << label;
  for (const char* kind : {"model", "optimizer"})
    EXPECT_EQ(max_diff(sharded, whole, 2, kind), 0.0) << label << " " << kind;
  const auto la = metrics_losses(sharded + "/run"), lb = metrics_losses(whole + "/run");
  EXPECT_EQ(la.size(), 2u) << label;
  EXPECT_EQ(la, lb) << label;
}

const std::vector<std::string> kGpt = {"--model.name=gpt", "--model.width=32", "--model.depth=2", "--model.heads=4",
                                       "--model.context=16"};
const std::vector<std::string> kLlama = {
    "--model.name=llama", "--model.width=32",   "--model.depth=2",      "--model.heads=4",
    "--model.context=16", "--model.kv_heads=2", "--model.ffn_width=64", "--model.tie_embeddings=false"};
const std::vector<std::string> kGpt2 = {"--model.name=gpt2",  "--model.width=32",   "--model.depth=2",
                                        "--model.heads=4",    "--model.context=16", "--model.tie_embeddings=false",
                                        "--model.dropout=0.1"};

}  // namespace

TEST(ShardedInit, ADeferredBuildHoldsNothingAndMakesTheWholeBuildsParametersAndSlicesBitForBit) {
  for (const char* name : {"gpt", "gpt2", "llama", "mlp", "cnn"}) expect_deferred_build_equals_whole(name);
}

TEST(ShardedInit, GptAtTp2AndAtZero3TrainsBitForBitAsTheWholeBuild) {
  expect_same_as_whole_build(kGpt, 2, {"--parallel.tp=2"}, "gpt tp 2");
  expect_same_as_whole_build(kGpt, 2, {"--dist.zero=3"}, "gpt (dp 2, zero 3)");
}

TEST(ShardedInit, LlamaWithGqaAtDp2Tp2Zero3TrainsBitForBitAsTheWholeBuild) {
  expect_same_as_whole_build(kLlama, 4, {"--parallel.tp=2", "--dist.zero=3", "--parallel.sequence_parallel=true"},
                             "llama (dp 2, tp 2, zero 3, sp)");
}

// LibTorch's own layers (Linear, Conv2d) built part by part and made from the generator state each
// part's build started from: this rank's flat-shard elements only.
TEST(ShardedInit, MlpAndCnnAtZero3TrainBitForBitAsTheWholeBuild) {
  expect_same_as_whole_build({"--model.name=mlp", "--model.width=32", "--model.depth=3"}, 2, {"--dist.zero=3"},
                             "mlp (dp 2, zero 3)");
  expect_same_as_whole_build({"--model.name=cnn"}, 2, {"--dist.zero=3"}, "cnn (dp 2, zero 3)");
}

// model.init_from into a sharded build: each rank's slices from the file's mapping, the same
// values as the whole build loads; with dropout, whose masks come from the generator the build
// leaves behind.
TEST(ShardedInit, Gpt2FromInitFromAtTp2AndAtZero3TrainsBitForBitAsTheWholeBuild) {
  TempDir d;
  const auto one = run_keel(run_args(kGpt2, d.file("one"), {}));
  ASSERT_EQ(one.exit_code, 0) << one.output;
  const std::string init = "--model.init_from=" + d.file("one") + "/ckpt/step_2";
  expect_same_as_whole_build(kGpt2, 2, {"--parallel.tp=2", init}, "gpt2 tp 2 from model.init_from");
  expect_same_as_whole_build(kGpt2, 2, {"--dist.zero=3", init}, "gpt2 (dp 2, zero 3) from model.init_from");
}
