// Pipeline schedules as values (issue 66 item 3, dist/pipeline/schedule.h): each generator's
// schedule is valid and runs to its end in the simulator, without a model, at pp 2, 3 and 4; the
// lowering places the sends and receives as PyTorch's does; what 1F1B is for (at most pp
// micro-batches' activations on a rank) holds; a schedule that would hang, or whose receives come in
// another order than their sends, is found naming the ranks; what does not fit is refused by name.
#include <gtest/gtest.h>

#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "dist/pipeline/schedule.h"

namespace pl = keel::dist::pipeline;

namespace {

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

int virtual_stages_of(const std::string& name) { return name == "gpipe" || name == "1f1b" ? 1 : 2; }

}  // namespace

TEST(PipelineSchedule, EveryScheduleIsValidAndRunsToItsEndAtPp2To4) {
  for (const std::string& name : pl::schedule_names())
    for (int pp : {2, 3, 4})
      for (int mult : {1, 2, 3}) {
        const int M = pp * mult + (name == "dualpipev" && mult == 1 ? pp : 0), V = virtual_stages_of(name);
        const std::string what = name + " at pp " + std::to_string(pp) + ", " + std::to_string(M) + " micro-batches";
        const pl::Schedule s = pl::make_schedule(name, pp, M, V);
        ASSERT_EQ(s.stages, pp * V) << what;
        EXPECT_NO_THROW(pl::validate(s)) << what;
        const pl::SimResult r = pl::simulate(s);
        EXPECT_FALSE(r.deadlock) << what << ": " << r.blocked << "\n" << s.table();
        // Every rank runs its V stages' M forwards and M backwards (or M input and M weight gradients).
        for (int rank = 0; rank < pp; ++rank) {
          int forwards = 0, backwards = 0, sends = 0, receives = 0;
          for (const auto& a : s.lowered[static_cast<size_t>(rank)]) {
            forwards += a.op == pl::Op::F;
            backwards += a.op == pl::Op::B || a.op == pl::Op::I;
            sends += a.op == pl::Op::SendF || a.op == pl::Op::SendB;
            receives += a.op == pl::Op::RecvF || a.op == pl::Op::RecvB;
          }
          EXPECT_EQ(forwards, M * V) << what << ", rank " << rank;
          EXPECT_EQ(backwards, M * V) << what << ", rank " << rank;
          // Each stage on another rank than its neighbours receives what it sends back: an
          // activation in and its gradient out, or out and in.
          EXPECT_EQ(sends, receives) << what << ", rank " << rank;
        }
        EXPECT_GT(r.ticks, 2 * M * V) << what << ": a rank cannot finish in fewer ticks than its computes";
      }
}

namespace {

// Each rank's compute order as PyTorch 2.11 gives it (see below).
struct Golden {
  std::string name;
  int pp, M, V;
  std::vector<std::string> ranks;
};
const std::vector<Golden> kPyTorchOrders = {
    {"interleaved",
     2,
     4,
     2,
     {"0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3",
      "1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3"}},
    {"interleaved-zb",
     2,
     4,
     2,
     {"0F0 0F1 2F0 2F1 2I0 2W0 0F2 2I1 2W1 0F3 0I0 0W0 2F2 0I1 0W1 2F3 2I2 2W2 2I3 2W3 0I2 0W2 0I3 0W3",
      "1F0 1F1 3F0 3I0 3F1 3I1 3W0 1F2 1I0 3W1 1F3 1I1 1W0 3F2 3I2 1W1 3F3 3I3 3W2 1I2 3W3 1I3 1W2 1W3"}},
    {"looped-bfs",
     2,
     4,
     2,
     {"0F0 0F1 0F2 0F3 2F0 2F1 2F2 2F3 2B3 2B2 2B1 2B0 0B3 0B2 0B1 0B0",
      "1F0 1F1 1F2 1F3 3F0 3F1 3F2 3F3 3B3 3B2 3B1 3B0 1B3 1B2 1B1 1B0"}},
    {"interleaved",
     3,
     6,
     2,
     {"0F0 0F1 0F2 3F0 3F1 3F2 0F3 0F4 3B0 0F5 3B1 3F3 3B2 3F4 0B0 3F5 0B1 0B2 3B3 3B4 3B5 0B3 0B4 0B5",
      "1F0 1F1 1F2 4F0 4F1 4F2 4B0 1F3 4B1 1F4 4B2 1F5 1B0 4F3 1B1 4F4 1B2 4F5 4B3 4B4 4B5 1B3 1B4 1B5",
      "2F0 2F1 2F2 5F0 5B0 5F1 5B1 5F2 5B2 2F3 2B0 2F4 2B1 2F5 2B2 5F3 5B3 5F4 5B4 5F5 5B5 2B3 2B4 2B5"}},
    {"interleaved-zb",
     4,
     8,
     2,
     {"0F0 0F1 0F2 0F3 4F0 4F1 4F2 4F3 4I0 4W0 0F4 4I1 4W1 0F5 4I2 4W2 0F6 4I3 4W3 0F7 0I0 0W0 4F4 0I1 0W1 4F5 0I2 "
      "0W2 4F6 0I3 0W3 4F7 4I4 4W4 4I5 4W5 4I6 4W6 4I7 4W7 0I4 0W4 0I5 0W5 0I6 0W6 0I7 0W7",
      "1F0 1F1 1F2 1F3 5F0 5F1 5F2 5I0 5F3 5I1 5W0 1F4 5I2 5W1 1F5 5I3 5W2 1F6 1I0 5W3 1F7 1I1 1W0 5F4 1I2 1W1 5F5 "
      "1I3 1W2 5F6 5I4 1W3 5F7 5I5 5W4 5I6 5W5 5I7 5W6 1I4 5W7 1I5 1W4 1I6 1W5 1I7 1W6 1W7",
      "2F0 2F1 2F2 2F3 6F0 6F1 6I0 6F2 6I1 6F3 6I2 6W0 2F4 6I3 6W1 2F5 2I0 6W2 2F6 2I1 6W3 2F7 2I2 2W0 6F4 2I3 2W1 "
      "6F5 6I4 2W2 6F6 6I5 2W3 6F7 6I6 6W4 6I7 6W5 2I4 6W6 2I5 6W7 2I6 2W4 2I7 2W5 2W6 2W7",
      "3F0 3F1 3F2 3F3 7F0 7I0 7F1 7I1 7F2 7I2 7F3 7I3 7W0 3F4 3I0 7W1 3F5 3I1 7W2 3F6 3I2 7W3 3F7 3I3 3W0 7F4 7I4 "
      "3W1 7F5 7I5 3W2 7F6 7I6 3W3 7F7 7I7 7W4 3I4 7W5 3I5 7W6 3I6 7W7 3I7 3W4 3W5 3W6 3W7"}},
    {"interleaved",
     2,
     6,
     3,
     {"0F0 0F1 2F0 2F1 4F0 4F1 0F2 4B0 0F3 4B1 2F2 2B0 2F3 2B1 4F2 0B0 4F3 0B1 0F4 4B2 0F5 4B3 2F4 2B2 2F5 2B3 4F4 "
      "0B2 4F5 0B3 4B4 4B5 2B4 2B5 0B4 0B5",
      "1F0 1F1 3F0 3F1 5F0 5B0 5F1 5B1 1F2 3B0 1F3 3B1 3F2 1B0 3F3 1B1 5F2 5B2 5F3 5B3 1F4 3B2 1F5 3B3 3F4 1B2 3F5 "
      "1B3 5F4 5B4 5F5 5B5 3B4 3B5 1B4 1B5"}},
    {"zbv",
     2,
     4,
     2,
     {"0F0 0F1 0F2 3F0 3I0 3W0 3F1 3I1 3W1 0F3 0I0 0W0 3F2 3I2 3W2 0I1 0W1 3F3 3I3 3W3 0I2 0W2 0I3 0W3",
      "1F0 2F0 1F1 2F1 2I0 2W0 1F2 1I0 1W0 2F2 2I1 2W1 1F3 1I1 1W1 2F3 2I2 2W2 1I2 2I3 1I3 1W2 2W3 1W3"}},
    {"zbv",
     3,
     6,
     2,
     {"0F0 0F1 0F2 0F3 0F4 5F0 5I0 5W0 5F1 5I1 5W1 5F2 5I2 5W2 0F5 0I0 0W0 5F3 5I3 5W3 0I1 0W1 5F4 5I4 5W4 0I2 0W2 "
      "5F5 5I5 5W5 0I3 0W3 0I4 0W4 0I5 0W5",
      "1F0 1F1 1F2 4F0 1F3 4F1 4I0 4W0 4F2 4I1 4W1 1F4 1I0 1W0 4F3 4I2 4W2 1F5 1I1 1W1 4F4 4I3 4W3 1I2 1W2 4F5 4I4 "
      "4W4 1I3 4I5 1I4 1W3 1I5 1W4 4W5 1W5",
      "2F0 3F0 2F1 3F1 2F2 3F2 3I0 3W0 2F3 2I0 2W0 3F3 3I1 3W1 2F4 2I1 2W1 3F4 3I2 3W2 2F5 2I2 2W2 3F5 3I3 3W3 2I3 "
      "3I4 2I4 3I5 2I5 2W3 3W4 3W5 2W4 2W5"}},
    {"zbv",
     2,
     2,
     2,
     {"0F0 0F1 3F0 3I0 3W0 3F1 3I1 3W1 0I0 0W0 0I1 0W1", "1F0 2F0 1F1 2F1 2I0 2W0 1I0 1W0 2I1 2W1 1I1 1W1"}},
    {"zbv",
     4,
     8,
     2,
     {"0F0 0F1 0F2 0F3 0F4 0F5 0F6 7F0 7I0 7W0 7F1 7I1 7W1 7F2 7I2 7W2 7F3 7I3 7W3 0F7 0I0 0W0 7F4 7I4 7W4 0I1 0W1 "
      "7F5 7I5 7W5 0I2 0W2 7F6 7I6 7W6 0I3 0W3 7F7 7I7 7W7 0I4 0W4 0I5 0W5 0I6 0W6 0I7 0W7",
      "1F0 1F1 1F2 1F3 1F4 6F0 1F5 6F1 6I0 6W0 6F2 6I1 6W1 6F3 6I2 6W2 1F6 1I0 1W0 6F4 6I3 6W3 1F7 1I1 1W1 6F5 6I4 "
      "6W4 1I2 1W2 6F6 6I5 6W5 1I3 1W3 6F7 6I6 6W6 1I4 6I7 1I5 1W4 1I6 1W5 1I7 1W6 6W7 1W7",
      "2F0 2F1 2F2 5F0 2F3 5F1 2F4 5F2 5I0 5W0 5F3 5I1 5W1 2F5 2I0 2W0 5F4 5I2 5W2 2F6 2I1 2W1 5F5 5I3 5W3 2F7 2I2 "
      "2W2 5F6 5I4 5W4 2I3 2W3 5F7 5I5 5W5 2I4 5I6 2I5 5I7 2I6 2W4 2I7 2W5 5W6 5W7 2W6 2W7",
      "3F0 4F0 3F1 4F1 3F2 4F2 3F3 4F3 4I0 4W0 3F4 3I0 3W0 4F4 4I1 4W1 3F5 3I1 3W1 4F5 4I2 4W2 3F6 3I2 3W2 4F6 4I3 "
      "4W3 3F7 3I3 3W3 4F7 4I4 4W4 3I4 4I5 3I5 4I6 3I6 4I7 3I7 3W4 4W5 4W6 4W7 3W5 3W6 3W7"}},
    {"dualpipev",
     2,
     4,
     2,
     {"0F0 0F1 0F2 3F0 3I0 3W0 3F1 0F3 3B1 3F2 0B0 3B2 3F3 0B1 3B3 0I2 0W2 0I3 0W3",
      "1F0 2F0 1F1 2F1 1F2 2B0 2F2 1B0 1F3 2B1 2F3 1B1 2B2 1B2 2I3 1I3 2W3 1W3"}},
    {"dualpipev",
     3,
     6,
     2,
     {"0F0 0F1 0F2 0F3 0F4 5F0 5I0 5W0 5F1 5I1 5W1 5F2 0F5 5B2 5F3 0B0 5B3 5F4 0B1 5B4 5F5 0B2 5B5 0I3 0W3 0I4 0W4 "
      "0I5 0W5",
      "1F0 1F1 1F2 4F0 1F3 4F1 4I0 4W0 4F2 1F4 4B1 4F3 1B0 1F5 4B2 4F4 1B1 4B3 4F5 1B2 4B4 1B3 4I5 1I4 4W5 1I5 1W4 "
      "1W5",
      "2F0 3F0 2F1 3F1 2F2 3F2 2F3 3B0 3F3 2B0 2F4 3B1 3F4 2B1 2F5 3B2 3F5 2B2 3B3 2B3 3B4 2I4 3I5 2I5 2W4 3W5 2W5"}},
    {"dualpipev",
     2,
     6,
     2,
     {"0F0 0F1 0F2 3F0 3I0 3W0 3F1 0F3 3B1 3F2 0B0 0F4 3B2 3F3 0B1 0F5 3B3 3F4 0B2 3B4 3F5 0B3 3B5 0I4 0W4 0I5 0W5",
      "1F0 2F0 1F1 2F1 1F2 2B0 2F2 1B0 1F3 2B1 2F3 1B1 1F4 2B2 2F4 1B2 1F5 2B3 2F5 1B3 2B4 1B4 2I5 1I5 2W5 1W5"}},
    {"dualpipev",
     4,
     10,
     2,
     {"0F0 0F1 0F2 0F3 0F4 0F5 0F6 7F0 7I0 7W0 7F1 7I1 7W1 7F2 7I2 7W2 7F3 0F7 7B3 7F4 0B0 0F8 7B4 7F5 0B1 0F9 7B5 "
      "7F6 0B2 7B6 7F7 0B3 7B7 7F8 0B4 7B8 7F9 0B5 7B9 0I6 0W6 0I7 0W7 0I8 0W8 0I9 0W9",
      "1F0 1F1 1F2 1F3 1F4 6F0 1F5 6F1 6I0 6W0 6F2 6I1 6W1 6F3 1F6 6B2 6F4 1B0 1F7 6B3 6F5 1B1 1F8 6B4 6F6 1B2 1F9 "
      "6B5 6F7 1B3 6B6 6F8 1B4 6B7 6F9 1B5 6B8 1B6 6I9 1I7 6W9 1I8 1W7 1I9 1W8 1W9",
      "2F0 2F1 2F2 5F0 2F3 5F1 2F4 5F2 5I0 5W0 5F3 2F5 5B1 5F4 2B0 2F6 5B2 5F5 2B1 2F7 5B3 5F6 2B2 2F8 5B4 5F7 2B3 "
      "2F9 5B5 5F8 2B4 5B6 5F9 2B5 5B7 2B6 5B8 2I7 5I9 2I8 2W7 2I9 5W9 2W8 2W9",
      "3F0 4F0 3F1 4F1 3F2 4F2 3F3 4F3 3F4 4B0 4F4 3B0 3F5 4B1 4F5 3B1 3F6 4B2 4F6 3B2 3F7 4B3 4F7 3B3 3F8 4B4 4F8 "
      "3B4 3F9 4B5 4F9 3B5 4B6 3B6 4B7 3B7 4I8 3I8 4I9 3I9 4W8 3W8 4W9 3W9"}},
};

}  // namespace

// The generators are PyTorch 2.11's: each rank's compute order equals what
// torch.distributed.pipelining's schedule classes compute for the same pp, micro-batches and
// virtual stages (their pipeline_order, printed by the venv's torch 2.11 with stand-in stages; zbv at
// 2 micro-batches for pp 2 drops the third it counts to, as PyTorch does; dualpipev's overlapped
// pairs printed as their forward, then their backward).
TEST(PipelineSchedule, TheComputeOrdersArePyTorchsOwn) {
  for (const auto& g : kPyTorchOrders) {
    const pl::Schedule s = pl::make_schedule(g.name, g.pp, g.M, g.V);
    for (int r = 0; r < g.pp; ++r) {
      std::ostringstream got;
      for (const auto& a : s.compute[static_cast<size_t>(r)]) got << (got.tellp() > 0 ? " " : "") << a.str();
      EXPECT_EQ(got.str(), g.ranks[static_cast<size_t>(r)])
          << g.name << " at pp " << g.pp << ", " << g.M << " micro-batches, " << g.V << " stages per rank, rank " << r;
    }
  }
}

// The lowering as PyTorch's _add_send_recv places it: each send right after its compute, each
// receive where its sender placed it, so both ends of a pair agree on one order.
TEST(PipelineSchedule, TheSendsAndReceivesArePlacedAsPyTorchPlacesThem) {
  const pl::Schedule s = pl::make_schedule("gpipe", 2, 2);
  EXPECT_EQ(s.table(),
            "gpipe: pp 2, 2 stages, 2 micro-batches\n"
            "rank 0: 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1\n"
            "rank 1: 1RECV_F0 1F0 1RECV_F1 1F1 1B0 1SEND_B0 1B1 1SEND_B1\n");
  const pl::Schedule zb = pl::make_schedule("interleaved-zb", 2, 4, 2);
  for (const auto& rank : zb.compute)
    for (size_t i = 0; i < rank.size(); ++i)
      if (rank[i].op == pl::Op::W) {
        bool input_before = false;
        for (size_t j = 0; j < i; ++j) input_before |= rank[j] == pl::Action{rank[i].stage, pl::Op::I, rank[i].mb};
        EXPECT_TRUE(input_before) << rank[i].str() << "\n" << zb.table();
      }
}

// 1F1B's point: a rank holds at most pp - rank micro-batches' activations (GPipe: all of them).
TEST(PipelineSchedule, OneFOneBHoldsAtMostPpMinusRankMicroBatchesAndGPipeAll) {
  for (int pp : {2, 4}) {
    const int M = 3 * pp;
    const pl::SimResult one = pl::simulate(pl::make_schedule("1f1b", pp, M));
    const pl::SimResult all = pl::simulate(pl::make_schedule("gpipe", pp, M));
    for (int r = 0; r < pp; ++r) {
      EXPECT_EQ(one.peak_in_flight[static_cast<size_t>(r)], pp - r) << "1f1b, pp " << pp << ", rank " << r;
      EXPECT_EQ(all.peak_in_flight[static_cast<size_t>(r)], M) << "gpipe, pp " << pp << ", rank " << r;
    }
  }
}

// A receive whose peer sends another micro-batch first waits behind it; when both ranks wait, the
// simulator says which ranks wait at which action for what.
TEST(PipelineSchedule, AReceiveOutOfOrderAndACycleAreFoundNamingTheRanks) {
  pl::Schedule s = pl::make_schedule("gpipe", 2, 2);
  auto& r1 = s.lowered[1];  // 1RECV_F0 1F0 1RECV_F1 1F1 ...: receive micro-batch 1 first
  std::swap(r1[0], r1[2]);
  std::swap(r1[1], r1[3]);
  const pl::SimResult out_of_order = pl::simulate(s);
  EXPECT_TRUE(out_of_order.deadlock);
  EXPECT_TRUE(contains(out_of_order.blocked, "rank 1 at 1RECV_F1 waits for rank 0's 0SEND_F1, behind its 0SEND_F0"))
      << out_of_order.blocked;

  pl::Schedule cycle = pl::make_schedule("gpipe", 2, 1);
  // rank 0 waits for the gradient of micro-batch 0 before it sends its activation
  cycle.lowered[0] = {{0, pl::Op::RecvB, 0}, {0, pl::Op::F, 0}, {0, pl::Op::SendF, 0}, {0, pl::Op::B, 0}};
  const pl::SimResult hang = pl::simulate(cycle);
  EXPECT_TRUE(hang.deadlock);
  EXPECT_TRUE(contains(hang.blocked, "rank 0 at 0RECV_B0 waits for rank 1's 1SEND_B0")) << hang.blocked;
  EXPECT_TRUE(contains(hang.blocked, "rank 1 at 1RECV_F0 waits for rank 0's 0SEND_F0")) << hang.blocked;
}

TEST(PipelineSchedule, WhatDoesNotFitIsRefusedByName) {
  auto refusal = [](const std::string& name, int pp, int M, int V) -> std::string {
    try {
      pl::make_schedule(name, pp, M, V);
    } catch (const std::invalid_argument& e) {
      return e.what();
    }
    return "";
  };
  EXPECT_TRUE(
      contains(refusal("1f1b", 4, 2, 1), "at least as many micro-batches as pp ranks: 2 micro-batches for pp 4"));
  EXPECT_TRUE(contains(refusal("zigzag", 2, 2, 1), "unknown schedule \"zigzag\" (known: gpipe, 1f1b,"));
  EXPECT_TRUE(contains(refusal("gpipe", 2, 2, 2), "runs one stage per rank, not 2"));
  EXPECT_TRUE(contains(refusal("zbv", 2, 4, 3), "runs two stages per rank (a V), not 3"));
  EXPECT_TRUE(contains(refusal("dualpipev", 2, 3, 2), "at least as many micro-batches as stages (2 x pp): 3"));
  EXPECT_TRUE(contains(refusal("interleaved", 2, 5, 2), "5 micro-batches do not split into 2 rounds at pp 2"));

  pl::Schedule s = pl::make_schedule("1f1b", 2, 2);
  std::swap(s.compute[1][0], s.compute[1][1]);  // rank 1: 1B0 before 1F0
  try {
    pl::validate(s);
    ADD_FAILURE() << "a backward before its forward passed";
  } catch (const std::logic_error& e) {
    EXPECT_TRUE(contains(e.what(), "rank 1, 1B0: the backward before its forward")) << e.what();
  }
}
