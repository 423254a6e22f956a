// Loss targets (issue 64 item 5): keel's cross-entropy ignores targets equal to
// train.ignore_index (default -100, PyTorch's and Hugging Face's convention) in every loss path:
// eager (trainer/loss.h), vocabulary-parallel (dist/tp_ops.h; TensorParallel.RegionsAnd...), the
// compiled root loss (InductorBlocks.ThePackagedBlocksAndRoot...), and evaluation; any other
// target outside [0, classes) is refused by name before the loss reads it.
//
// Tolerances: keel's loss is PyTorch's sum over the counted targets divided by their count, which
// is what PyTorch's mean computes, so the eager values are compared bit for bit. A tp run against
// one rank differs by the reordering of float32 sums (TensorParallel's 1e-5 relative).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <string>
#include <vector>

#include "helpers.h"
#include "keel/common/error.h"
#include "keel/trainer/data/data.h"
#include "keel/trainer/trainer.h"
#include "multirank.h"
#include "trainer/loss.h"

using namespace keel::testing;
namespace F = torch::nn::functional;

namespace {

TEST(Loss, CrossEntropyIgnoresTheIgnoreIndexBitForBitAsPyTorch) {
  torch::manual_seed(3);
  const int64_t classes = 11;
  const auto logits = torch::randn({5, 7, classes}) * 2;
  for (const int64_t ignore : {int64_t{-100}, int64_t{4}}) {
    auto target = torch::randint(classes, {5, 7}, torch::kLong);
    target.reshape({-1}).index_put_({torch::arange(0, 35, 4)}, ignore);
    auto a = logits.clone().requires_grad_(), b = logits.clone().requires_grad_();
    const auto got = keel::cross_entropy(a, target, ignore);
    const auto want = F::cross_entropy(b.reshape({-1, classes}), target.reshape({-1}),
                                       F::CrossEntropyFuncOptions().ignore_index(ignore));
    got.backward();
    want.backward();
    EXPECT_EQ(got.item<float>(), want.item<float>()) << "ignore_index " << ignore;
    EXPECT_TRUE(torch::equal(a.grad(), b.grad())) << "ignore_index " << ignore;
    // The ignored positions' logits get no gradient; the others do.
    const auto ignored = target.eq(ignore).unsqueeze(-1).expand_as(logits);
    EXPECT_EQ(a.grad().masked_select(ignored).abs().max().item<float>(), 0.0f);
    EXPECT_GT(a.grad().masked_select(ignored.logical_not()).abs().max().item<float>(), 0.0f);
  }
  // Every target ignored: 0 with no gradient, where PyTorch's mean is NaN (0 / 0).
  auto a = logits.clone().requires_grad_();
  const auto all = torch::full({5, 7}, -100, torch::kLong);
  const auto zero = keel::cross_entropy(a, all, -100);
  zero.backward();
  EXPECT_EQ(zero.item<float>(), 0.0f);
  EXPECT_EQ(a.grad().abs().max().item<float>(), 0.0f);
  EXPECT_TRUE(std::isnan(F::cross_entropy(logits.reshape({-1, classes}), all.reshape({-1})).item<float>()));
}

TEST(Loss, TargetsOutsideTheClassesAndNotIgnoredAreRefusedByName) {
  auto t = torch::tensor({{0, 3, -100}, {10, 2, 1}}, torch::kLong);
  EXPECT_NO_THROW(keel::check_targets(t, 11, -100, "training batch"));
  for (const auto& [value, at] : std::vector<std::pair<int64_t, std::string>>{{11, "[1, 2]"}, {-1, "[0, 1]"}}) {
    auto bad = t.clone();
    const auto pos = at == "[1, 2]" ? std::pair{1, 2} : std::pair{0, 1};
    bad.index_put_({pos.first, pos.second}, value);
    try {
      keel::check_targets(bad, 11, -100, "training batch of step 3 (micro-batch 0) on rank 1");
      ADD_FAILURE() << "target " << value << " was taken";
    } catch (const keel::InputError& e) {
      const std::string m = e.what();
      for (const std::string& want : std::vector<std::string>{"training batch of step 3 (micro-batch 0) on rank 1",
                                                              "target " + std::to_string(value), "position " + at,
                                                              "11 classes [0, 11)", "train.ignore_index = -100"})
        EXPECT_NE(m.find(want), std::string::npos) << "'" << want << "' not in: " << m;
    }
  }
  // Another ignore index: -100 is then a target like any other, refused.
  EXPECT_THROW(keel::check_targets(t, 11, 5, "batch"), keel::InputError);
  EXPECT_THROW(keel::check_targets(t.to(torch::kFloat), 11, -100, "batch"), keel::InputError);
}

// Where a labelled dataset holds a target out of range (the vocabulary size): nowhere, in every
// third training sample, or only in what rank 1 of a 2-rank job reads (its training or its test
// samples).
enum class Bad { None, Train, TrainOnRank1, TestOnRank1 };

bool on_rank1() {
  const char* r = std::getenv("RANK");
  return r && std::string(r) == "1";
}

// A labelled dataset (Hugging Face's fine-tuning convention): each sequence's first half of
// targets is the ignore index, so only the second half is learned and evaluated; `bad` says
// where one target is the vocabulary size instead.
void register_labelled(const std::string& name, int64_t ignore, Bad bad) {
  keel::data::register_dataset(
      name, [=](const keel::DataConfig& cfg, const keel::models::InputSpec& spec, int64_t seed) {
        struct Labelled : keel::data::Dataset {
          std::shared_ptr<keel::data::Dataset> base;
          int64_t ignore, vocab;
          bool out_of_range, every;
          int64_t size() const override { return base->size(); }
          keel::data::Batch get(const std::vector<int64_t>& indices) const override {
            keel::data::Batch b = base->get(indices);
            b.target = b.target.clone();
            b.target.narrow(1, 0, b.target.size(1) / 2).fill_(ignore);
            if (out_of_range && (indices.front() % 3 == 1 || !every)) b.target.index_put_({0, -1}, vocab);
            return b;
          }
        };
        auto s = keel::data::make_synthetic(cfg, spec, seed);
        auto wrap = [&](std::shared_ptr<keel::data::Dataset> d, bool out_of_range) {
          auto l = std::make_shared<Labelled>();
          l->base = std::move(d), l->ignore = ignore, l->vocab = spec.num_classes, l->out_of_range = out_of_range;
          l->every = bad == Bad::Train;
          return l;
        };
        return keel::data::Splits{wrap(s.train, bad == Bad::Train || (bad == Bad::TrainOnRank1 && on_rank1())),
                                  wrap(s.test, bad == Bad::TestOnRank1 && on_rank1())};
      });
}

keel::Config labelled_gpt(const std::string& dir, const std::string& data, int64_t tp) {
  keel::Config cfg;
  cfg.run.dir = dir;
  cfg.run.threads = 1;
  cfg.run.tensorboard = false;
  cfg.model.name = "gpt";
  cfg.model.width = 32;
  cfg.model.depth = 2;
  cfg.model.heads = 4;
  cfg.model.context = 16;
  cfg.data.name = data;
  cfg.data.synthetic_size = 256;
  cfg.train.steps = 10;
  cfg.train.batch_size = 8;
  cfg.train.eval_interval = 10;
  cfg.train.ignore_index = -7;  // not PyTorch's default: the key is read on every path
  cfg.parallel.tp = tp;
  keel::validate(cfg);
  return cfg;
}

// The same labelled run on one rank and at tp 2 (the vocabulary-parallel loss and evaluation):
// per-step losses and the evaluation agree, and the evaluation counts only the labelled tokens.
TEST(Loss, ALabelledDatasetTrainsAtTp2AsOneRankAndEvaluatesOnlyItsLabelledTokens) {
  register_labelled("labelled", -7, Bad::None);
  TempDir d;  // (each rank process makes its own TempDir: the parent's reaches them in KEEL_TEST_OUT)
  auto ranks = run_ranks(
      2,
      [](const keel::dist::World& w) {
        keel::Callbacks cb;
        cb.on_eval = [](const keel::EvalResult& e) {
          std::fprintf(stderr, "eval count %lld loss %.9g\n", static_cast<long long>(e.count), e.loss);
        };
        keel::Trainer(labelled_gpt(std::string(std::getenv("KEEL_TEST_OUT")) + "/tp2", "labelled", 2), w, cb).run();
      },
      120, {"KEEL_TEST_OUT=" + d.path()});
  if (is_rank_process()) return;
  expect_all_ok(ranks);
  int64_t count = -1;
  double eval_loss = 0;
  keel::Callbacks cb;
  cb.on_eval = [&](const keel::EvalResult& e) { count = e.count, eval_loss = e.loss; };
  keel::Trainer(labelled_gpt(d.file("one"), "labelled", 1), keel::dist::World{}, cb).run();
  // The synthetic test split: a quarter of 256 sequences, 16 positions of which 8 are labelled.
  EXPECT_EQ(count, 64 * 8);
  EXPECT_NE(ranks[0].output.find("eval count 512 "), std::string::npos) << ranks[0].output;
  const auto one = metrics_losses(d.file("one")), two = metrics_losses(d.file("tp2"));
  ASSERT_EQ(one.size(), 10u);
  ASSERT_EQ(two.size(), one.size());
  for (size_t i = 0; i < one.size(); ++i)
    EXPECT_NEAR(two[i].second, one[i].second, 1e-5 * std::abs(one[i].second)) << "step " << one[i].first;
  EXPECT_TRUE(std::isfinite(eval_loss));
}

// A target outside the vocabulary that is not the ignore index: the run ends with InputError (exit
// 2 from the CLI) naming the batch and the value, before the loss reads it.
TEST(Loss, ATargetOutsideTheVocabularyEndsTheRunNamingIt) {
  register_labelled("labelled_bad", -7, Bad::Train);
  TempDir d;
  try {
    keel::Trainer(labelled_gpt(d.file("run"), "labelled_bad", 1), keel::dist::World{}).run();
    ADD_FAILURE() << "a target of 256 with a vocabulary of 256 was trained on";
  } catch (const keel::InputError& e) {
    const std::string m = e.what();
    for (const std::string want : std::vector<std::string>{"training batch of step", "target 256",
                                                           "256 classes [0, 256)", "train.ignore_index = -7"})
      EXPECT_NE(m.find(want), std::string::npos) << "'" << want << "' not in: " << m;
  }
}

// A bad target on one rank only (a data-parallel job whose other ranks read good batches): every
// rank ends with the same InputError naming rank 1, from the step's consensus (training) or the
// evaluation's totals, never a hang until dist.timeout_s (the adversarial review: rank 1 threw
// while rank 0 waited in the next collective, exit 1 after the timeout).
TEST(Loss, ABadTargetOnOneRankEndsEveryRankWithItsMessage) {
  register_labelled("labelled_bad_train_rank1", -7, Bad::TrainOnRank1);
  register_labelled("labelled_bad_test_rank1", -7, Bad::TestOnRank1);
  TempDir d;
  for (const char* data : {"labelled_bad_train_rank1", "labelled_bad_test_rank1"}) {
    auto ranks =
        run_ranks(2,
                  [](const keel::dist::World& w) {  // the data by name from the environment: a rank runs the first call
                    const std::string data = std::getenv("KEEL_TEST_DATA");
                    keel::Config cfg = labelled_gpt(std::string(std::getenv("KEEL_TEST_OUT")) + "/" + data, data, 1);
                    cfg.train.eval_interval = 2;
                    cfg.dist.timeout_s = 60;
                    try {
                      keel::Trainer(cfg, w).run();
                      ADD_FAILURE() << "a target of 256 with a vocabulary of 256 was trained on";
                    } catch (const keel::InputError& e) {
                      std::fprintf(stderr, "input error: %s\n", e.what());
                    }
                  },
                  120, {"KEEL_TEST_OUT=" + d.path(), std::string("KEEL_TEST_DATA=") + data});
    if (is_rank_process()) return;
    expect_all_ok(ranks);
    const std::string where =
        std::string(data) == "labelled_bad_train_rank1" ? "training batch of step 1" : "evaluation batch at step 2";
    for (const auto& r : ranks) {
      EXPECT_NE(r.output.find("input error: data: the " + where), std::string::npos) << data << ": " << r.output;
      EXPECT_NE(r.output.find("on rank 1 has target 256"), std::string::npos) << data << ": " << r.output;
    }
  }
}

}  // namespace
