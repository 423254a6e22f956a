// The distributed sampler: disjoint shards, N x B == 1 x N*B per step, per-epoch reshuffle,
// padding without drop_last, and exact position restore.
#include <gtest/gtest.h>

#include <set>

#include "trainer/data/sampler.h"

using keel::data::DistributedSampler;

namespace {

TEST(Sampler, RanksAreDisjointAndCoverTheEpoch) {
  const int64_t n = 103, world = 3, batch = 4;
  std::set<int64_t> seen;
  int64_t total = 0;
  for (int64_t r = 0; r < world; ++r) {
    DistributedSampler s(n, world, r, batch, true, true, 7);
    EXPECT_EQ(s.batches_per_epoch(), n / (world * batch));
    for (int64_t b = 0; b < s.batches_per_epoch(); ++b)
      for (auto i : s.next()) {
        EXPECT_TRUE(seen.insert(i).second) << "index " << i << " seen twice";
        ++total;
      }
  }
  EXPECT_EQ(total, (n / (world * batch)) * world * batch);
}

TEST(Sampler, NRanksTimesBEqualsOneRankTimesNB) {
  const int64_t n = 500, world = 4, batch = 8;
  DistributedSampler single(n, 1, 0, world * batch, true, true, 11);
  std::vector<DistributedSampler> ranks;
  for (int64_t r = 0; r < world; ++r) ranks.emplace_back(n, world, r, batch, true, true, 11);
  ASSERT_EQ(single.batches_per_epoch(), ranks[0].batches_per_epoch());
  for (int step = 0; step < 2 * single.batches_per_epoch(); ++step) {  // crosses an epoch
    auto big = single.next();
    std::multiset<int64_t> a(big.begin(), big.end()), b;
    for (auto& s : ranks)
      for (auto i : s.next()) b.insert(i);
    EXPECT_EQ(a, b) << "step " << step;
  }
}

TEST(Sampler, ReshufflesEveryEpochDeterministically) {
  DistributedSampler a(64, 2, 1, 8, true, true, 5), b(64, 2, 1, 8, true, true, 5);
  EXPECT_EQ(a.rank_indices(0), b.rank_indices(0));
  EXPECT_NE(a.rank_indices(0), a.rank_indices(1));
  DistributedSampler other_seed(64, 2, 1, 8, true, true, 6);
  EXPECT_NE(a.rank_indices(0), other_seed.rank_indices(0));
}

TEST(Sampler, MatchesTorchDistributedSamplerOrder) {
  // Values printed by PyTorch 1.13 and again by 2.11 (the same):
  //   s = torch.utils.data.DistributedSampler(list(range(10)), num_replicas=2, rank=1,
  //                                           shuffle=True, seed=0, drop_last=True)
  //   s.set_epoch(0); list(s) -> [1, 5, 9, 8, 2];   s.set_epoch(3); list(s) -> [0, 7, 5, 9, 4]
  DistributedSampler s(10, 2, 1, 5, true, true, 0);
  EXPECT_EQ(s.rank_indices(0), (std::vector<int64_t>{1, 5, 9, 8, 2}));
  EXPECT_EQ(s.rank_indices(3), (std::vector<int64_t>{0, 7, 5, 9, 4}));
}

TEST(Sampler, NoShuffleIsInOrder) {
  DistributedSampler s(10, 2, 0, 2, false, true, 0);
  EXPECT_EQ(s.next(), (std::vector<int64_t>{0, 2}));
  EXPECT_EQ(s.next(), (std::vector<int64_t>{4, 6}));
}

TEST(Sampler, WithoutDropLastPadsByWrapping) {
  DistributedSampler s(10, 3, 2, 3, false, false, 0);
  // Padded to 12 = 4 per rank: rank 2 takes positions 2, 5, 8, 11 -> 11 wraps to index 1.
  // PyTorch: DistributedSampler(list(range(10)), num_replicas=3, rank=2, shuffle=False) -> [2, 5, 8, 1]
  EXPECT_EQ(s.rank_indices(0), (std::vector<int64_t>{2, 5, 8, 1}));
  EXPECT_EQ(s.batches_per_epoch(), 2);
  EXPECT_EQ(s.next().size(), 3u);
  EXPECT_EQ(s.next().size(), 1u);  // the smaller last batch
}

TEST(Sampler, PositionRestoreContinuesExactly) {
  DistributedSampler a(100, 2, 0, 8, true, true, 3);
  for (int i = 0; i < 9; ++i) a.next();  // into epoch 1 (6 batches per epoch)
  auto pos = a.position();
  EXPECT_EQ(pos.epoch, 1);
  std::vector<std::vector<int64_t>> expected;
  for (int i = 0; i < 10; ++i) expected.push_back(a.next());

  DistributedSampler b(100, 2, 0, 8, true, true, 3);
  b.restore(pos);
  for (int i = 0; i < 10; ++i) EXPECT_EQ(b.next(), expected[i]) << i;
  EXPECT_THROW(b.restore({0, 99}), std::invalid_argument);
}

// The sampler's checkpoint state carries the dataset's size: a resume on the same data continues
// at the saved position; on a dataset of another size (the corpus changed) it keeps the samples
// consumed in the epoch (clamped to the epoch's end when the data shrank) instead of restoring a
// position that means other samples, or failing on one past the end.
TEST(Sampler, ResumeOnADatasetOfAnotherSizeKeepsTheSamplesConsumed) {
  DistributedSampler a(100, 2, 0, 8, true, true, 3);
  for (int i = 0; i < 4; ++i) a.next();  // epoch 0, 4 of 6 batches: 64 samples of the job
  keel::checkpoint::Component saved;
  a.save(saved);
  EXPECT_EQ(saved.values["dataset_size"], 100);
  keel::checkpoint::Loaded loaded;
  loaded.step = 4;
  loaded.saved_world_size = 2;
  loaded.has_rank_state = true;
  keel::checkpoint::LoadedComponent mine;
  mine.present = true;
  mine.values = saved.values;
  mine.rank_values = saved.rank_values;

  DistributedSampler same(100, 2, 0, 8, true, true, 3);
  EXPECT_EQ(same.check(loaded, mine), "");
  same.load(loaded, mine);
  EXPECT_EQ(same.position(), (DistributedSampler::Position{0, 4}));
  EXPECT_EQ(same.next(), a.next());

  DistributedSampler grown(200, 2, 0, 4, true, true, 3);  // 25 batches of a global 8
  EXPECT_EQ(grown.check(loaded, mine), "");
  grown.load(loaded, mine);
  EXPECT_EQ(grown.position(), (DistributedSampler::Position{0, 8}));  // 64 samples / 8

  DistributedSampler shrunk(40, 2, 0, 4, true, true, 3);  // 5 batches: the saved batch 4 of 8 would not say 64
  EXPECT_EQ(shrunk.check(loaded, mine), "");
  shrunk.load(loaded, mine);
  EXPECT_EQ(shrunk.position(), (DistributedSampler::Position{0, 5}));  // the epoch's end: the next batch opens epoch 1

  DistributedSampler tiny(34, 2, 0, 8, true, true, 3);  // 2 batches per epoch, same world and batch
  EXPECT_EQ(tiny.check(loaded, mine), "");              // not "past the epoch's 2 batches"
  tiny.load(loaded, mine);
  EXPECT_EQ(tiny.position(), (DistributedSampler::Position{0, 2}));

  mine.values["dataset_size"] = -3;
  EXPECT_NE(same.check(loaded, mine).find("values.dataset_size = -3 is not an integer"), std::string::npos)
      << same.check(loaded, mine);
}

TEST(Sampler, TooFewSamplesForOneBatch) {
  EXPECT_THROW(DistributedSampler(10, 2, 0, 8, true, true, 0), std::invalid_argument);
}

}  // namespace
