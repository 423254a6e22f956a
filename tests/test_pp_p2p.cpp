// Point-to-point through the door (issue 66 item 4): Collectives::start_p2p's messages arrive as
// sent, counted and observed like collectives; on the first step each pair swaps its messages'
// descriptors, so a receive that expects another shape fails on both ranks naming the pair and both
// shapes; after it, the per-step consensus checks one balance word per rank; a dead peer is named.
#include <gtest/gtest.h>

#include <chrono>
#include <csignal>
#include <string>
#include <vector>

#include "keel/dist/collectives.h"
#include "keel/dist/process_group.h"
#include "multirank.h"

using keel::dist::Collectives;
using keel::dist::P2POp;
using keel::dist::World;
using namespace keel::testing;

namespace {

std::shared_ptr<Collectives> make_collectives(const World& w, keel::Validate validate, int64_t timeout_s = 30) {
  keel::DistConfig cfg;
  cfg.timeout_s = timeout_s;
  cfg.validate = validate;
  return std::make_shared<Collectives>(keel::dist::Group::create(w, cfg, torch::kCPU), validate);
}

// The tags a pipeline would use: an activation (kind 0) or its gradient (kind 1) of a micro-batch.
std::string name_tag(int64_t tag) {
  return std::string(tag >= 1000 ? "the gradient" : "the activation") + " of micro-batch " + std::to_string(tag % 1000);
}

// Every rank's balance summed (mod 2^64): 0 when every message was received as sent.
uint64_t world_balance(Collectives& c) {
  auto mine = torch::tensor({static_cast<int64_t>(c.take_p2p_balance())}, torch::kLong);
  uint64_t sum = 0;
  for (const auto& t : c.all_gather(mine, "balance")) sum += static_cast<uint64_t>(t.item<int64_t>());
  return sum;
}

// Rank 0 sends an activation and receives a gradient in one batch, rank 1 the other way round;
// validated on the first step, each message's descriptor swapped first (counted as probes); the
// payloads arrive as sent, in both directions, and the balance over the ranks is 0.
TEST(PipelineP2P, MessagesArriveAsSentCountedAndBalanced) {
  auto ranks = run_ranks(2, [](const World& w) {
    auto c = make_collectives(w, keel::Validate::FirstStep);
    c->set_step(1);
    const auto act = torch::arange(6, torch::kFloat).reshape({2, 3});
    const auto grad = torch::arange(4, torch::kFloat) * 0.5;
    auto act_in = torch::zeros({2, 3}), grad_in = torch::zeros({4});
    const auto before = c->traffic();
    auto started =
        w.rank == 0
            ? c->start_p2p({{P2POp::Kind::Send, 1, act, 7}, {P2POp::Kind::Recv, 1, grad_in, 1007}}, "pp", name_tag)
            : c->start_p2p({{P2POp::Kind::Recv, 0, act_in, 7}, {P2POp::Kind::Send, 0, grad, 1007}}, "pp", name_tag);
    started.wait();
    if (w.rank == 0) EXPECT_TRUE(torch::equal(grad_in, grad));
    if (w.rank == 1) EXPECT_TRUE(torch::equal(act_in, act));
    auto d = c->traffic() - before;
    EXPECT_EQ(d.collectives - d.probes, 2);  // the two messages
    EXPECT_GE(d.probes, 1);                  // the descriptors swapped before them
    EXPECT_EQ(d.bytes_sent - 16 * d.probes, w.rank == 0 ? 24 : 16);
    EXPECT_EQ(world_balance(*c), 0u);
    // Step 2: no descriptors, the same messages.
    c->set_step(2);
    const auto mid = c->traffic();
    auto again = w.rank == 0 ? c->start_p2p({{P2POp::Kind::Send, 1, act * 2, 8}})
                             : c->start_p2p({{P2POp::Kind::Recv, 0, act_in, 8}});
    again.wait();
    if (w.rank == 1) EXPECT_TRUE(torch::equal(act_in, act * 2));
    d = c->traffic() - mid;
    EXPECT_EQ(d.probes, 0);
    EXPECT_EQ(d.collectives, 1);
    EXPECT_EQ(world_balance(*c), 0u);
  });
  if (is_rank_process()) return;
  expect_all_ok(ranks);
}

// A receive that expects another shape than its peer sends: both ranks throw before the payload
// moves, naming the sender, the receiver, the message and both shapes.
TEST(PipelineP2P, AMismatchFailsBothRanksNamingThePairTheMessageAndBothShapes) {
  auto ranks = run_ranks(2, [](const World& w) {
    auto c = make_collectives(w, keel::Validate::FirstStep);
    c->set_step(1);
    try {
      auto s = w.rank == 0 ? c->start_p2p({{P2POp::Kind::Send, 1, torch::ones({4, 8}), 3}}, "pp", name_tag)
                           : c->start_p2p({{P2POp::Kind::Recv, 0, torch::empty({4, 16}), 3}}, "pp", name_tag);
      s.wait();
      ADD_FAILURE() << "no mismatch on rank " << w.rank;
    } catch (const keel::dist::CollectiveMismatch& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find("point-to-point mismatch at step 1 (pp)"), std::string::npos) << m;
      EXPECT_NE(m.find("rank 0 sends the activation of micro-batch 3 of step 1 as Float [4, 8]; rank 1 expects "
                       "the activation of micro-batch 3 of step 1 as Float [4, 16]"),
                std::string::npos)
          << m;
    }
  });
  if (is_rank_process()) return;
  expect_all_ok(ranks);
}

// After the first step no descriptor travels: a message received with another shape of the same
// bytes (which Gloo and NCCL take silently) is caught by the step's consensus on both ranks, and
// no update follows; the same exchange at the right shape passes.
TEST(PipelineP2P, AfterTheFirstStepTheConsensusCatchesAMessageOfAnotherShape) {
  auto ranks = run_ranks(2, [](const World& w) {
    auto c = make_collectives(w, keel::Validate::FirstStep);
    for (int64_t step : {2, 3}) {
      c->set_step(step);
      const std::vector<int64_t> shape =
          step == 2 && w.rank == 1 ? std::vector<int64_t>{3, 2} : std::vector<int64_t>{2, 3};
      auto s = w.rank == 0 ? c->start_p2p({{P2POp::Kind::Send, 1, torch::ones(shape), 5}})
                           : c->start_p2p({{P2POp::Kind::Recv, 0, torch::empty(shape), 5}});
      s.wait();
      const keel::dist::StepShare share{1.0, c->take_p2p_balance()};
      if (step == 3) {
        EXPECT_EQ(c->step_sync(step, 7, 1.0, false, 1.0, 0, share).mean_loss, 1.0);
        continue;
      }
      try {
        c->step_sync(step, 7, 1.0, false, 1.0, 0, share);
        ADD_FAILURE() << "no mismatch on rank " << w.rank;
      } catch (const keel::dist::CollectiveMismatch& e) {
        EXPECT_NE(std::string(e.what()).find("point-to-point at step 2: the messages received are not the messages "
                                             "sent"),
                  std::string::npos)
            << e.what();
      }
    }
  });
  if (is_rank_process()) return;
  expect_all_ok(ranks);
}

// A stage that died: its neighbour's receive fails within dist.timeout_s naming it.
TEST(PipelineP2P, ADeadPeerIsNamedByItsNeighbourWithinTheTimeout) {
  auto ranks = run_ranks(2, [](const World& w) {
    auto c = make_collectives(w, keel::Validate::FirstStep, /*timeout_s=*/10);
    c->set_step(1);
    c->barrier("connected");
    if (w.rank == 1) std::raise(SIGKILL);
    const auto t0 = std::chrono::steady_clock::now();
    try {
      c->start_p2p({{P2POp::Kind::Recv, 1, torch::empty({4}), 1}}, "pp", name_tag).wait();
      ADD_FAILURE() << "received from a dead rank";
    } catch (const keel::dist::CollectiveError& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find("rank(s) 1 never reached"), std::string::npos) << m;
    }
    EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(12));
  });
  if (is_rank_process()) return;
  ASSERT_EQ(ranks.size(), 2u);
  EXPECT_EQ(ranks[0].exit_code, 0) << ranks[0].output;
  EXPECT_TRUE(ranks[1].signaled);
}

}  // namespace
