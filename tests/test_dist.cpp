// dist/: collectives validated across ranks, DDP on c10d's Reducer, and launches by torchrun
// and mpirun. Multi-rank cases run as separate processes (tests/multirank.h).
#include <gtest/gtest.h>

#include <csignal>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <mutex>

#include <nlohmann/json.hpp>

#include "checkpoint/safetensors.h"
#include "dist/ddp.h"
#include "dist/mesh.h"
#include "dist/network.h"
#include "helpers.h"
#include "keel/dist/collectives.h"
#include "keel/dist/process_group.h"
#include "keel/trainer/trainer.h"
#include "multirank.h"

using keel::dist::Collectives;
using keel::dist::World;
using namespace keel::testing;

namespace {

std::shared_ptr<Collectives> make_collectives(const World& w, int64_t timeout_s = 30,
                                              keel::Validate validate = keel::Validate::Always) {
  keel::DistConfig cfg;
  cfg.timeout_s = timeout_s;
  cfg.validate = validate;
  auto g = keel::dist::Group::create(w, cfg, torch::kCPU);
  return std::make_shared<Collectives>(g, validate);
}

TEST(Collectives, AllReduceBroadcastAllGatherBarrier) {
  auto ranks = run_ranks(2, [](const World& w) {
    auto c = make_collectives(w);
    auto t = torch::full({3}, double(w.rank + 1));
    c->all_reduce(t);
    EXPECT_TRUE(torch::equal(t, torch::full({3}, 3.0)));
    auto a = torch::full({2}, double(w.rank + 1));
    c->all_reduce(a, keel::dist::ReduceOp::Avg);
    EXPECT_TRUE(torch::allclose(a, torch::full({2}, 1.5)));
    auto m = torch::tensor({double(w.rank)});
    c->all_reduce(m, keel::dist::ReduceOp::Max);
    EXPECT_EQ(m.item<double>(), 1.0);
    auto b = torch::full({4}, double(w.rank * 10));
    c->broadcast(b, /*root=*/1);
    EXPECT_TRUE(torch::equal(b, torch::full({4}, 10.0)));
    auto g = c->all_gather(torch::tensor({w.rank * 7}, torch::kLong));
    ASSERT_EQ(g.size(), 2u);
    EXPECT_EQ(g[1].item<int64_t>(), 7);
    c->barrier();
  });
  if (is_rank_process()) return;
  expect_all_ok(ranks);
}

// The mesh lays ranks out with tp innermost; every axis's group is the ranks that differ in it alone.
TEST(Mesh, CoordinatesGroupsAndNames) {
  World w;
  w.size = 8, w.rank = 5;  // pp 2 x dp 2 x tp 2: rank 5 = (1, 0, 1)
  const auto m = keel::dist::Mesh::build(w, {2, 0, 2});
  EXPECT_EQ(m.dp(), 2);
  EXPECT_EQ(m.coordinate(keel::dist::Axis::Pp), 1);
  EXPECT_EQ(m.dp_rank(), 0);
  EXPECT_EQ(m.coordinate(keel::dist::Axis::Tp), 1);
  EXPECT_EQ(m.group_ranks(keel::dist::Axis::Tp), (std::vector<int64_t>{4, 5}));
  EXPECT_EQ(m.group_ranks(keel::dist::Axis::Dp), (std::vector<int64_t>{5, 7}));
  EXPECT_EQ(m.group_ranks(keel::dist::Axis::Pp), (std::vector<int64_t>{1, 5}));
  EXPECT_EQ(m.name_of(6), "rank 6 (pp 1, dp 1, tp 0)");
  EXPECT_EQ(m.describe(), "pp 2 x dp 2 x tp 2");
  // Data parallel alone (every run today): dp is the world, ranks keep their plain names.
  w.size = 3, w.rank = 2;
  const auto d = keel::dist::Mesh::build(w);
  EXPECT_EQ(d.dp(), 3);
  EXPECT_EQ(d.dp_rank(), 2);
  EXPECT_EQ(d.name_of(1), "rank 1");
  try {
    keel::dist::Mesh::build(w, {1, 0, 2});
    ADD_FAILURE() << "a tp of 2 over 3 ranks was accepted";
  } catch (const keel::InputError& e) {
    EXPECT_NE(std::string(e.what()).find("needs 2 ranks; the world has 3"), std::string::npos) << e.what();
  }
}

// Four ranks as dp 2 x tp 2: each axis's Collectives reduces over its own group (c10d subgroups
// on the world's store), and a mismatch inside a tp group names the ranks by their coordinates.
TEST(Mesh, EachAxisReducesOverItsOwnGroupAndNamesCoordinates) {
  auto ranks = run_ranks(4, [](const World& w) {
    auto world = make_collectives(w);
    auto mesh = keel::dist::Mesh::build(w, {1, 0, 2});
    mesh.connect(world, keel::Validate::Always);
    auto t = torch::tensor({double(w.rank)});
    mesh.on(keel::dist::Axis::Tp).all_reduce(t);
    EXPECT_EQ(t.item<double>(), w.rank < 2 ? 1.0 : 5.0);  // {0, 1} and {2, 3}
    auto d = torch::tensor({double(w.rank)});
    mesh.on(keel::dist::Axis::Dp).all_reduce(d);
    EXPECT_EQ(d.item<double>(), w.rank % 2 == 0 ? 2.0 : 4.0);  // {0, 2} and {1, 3}
    EXPECT_EQ(&mesh.on(keel::dist::Axis::Pp), &mesh.on(keel::dist::Axis::Pp));
    EXPECT_EQ(mesh.on(keel::dist::Axis::Pp).size(), 1);
    auto bad = torch::zeros({w.rank == 3 ? 3 : 2});
    try {
      mesh.on(keel::dist::Axis::Tp).all_reduce(bad, keel::dist::ReduceOp::Sum, "tp probe");
      EXPECT_LT(w.rank, 2) << "rank " << w.rank << " was not told of rank 3's other shape";
    } catch (const keel::dist::CollectiveMismatch& e) {
      EXPECT_GE(w.rank, 2);
      EXPECT_NE(std::string(e.what()).find("rank 3 (pp 0, dp 1, tp 1)"), std::string::npos) << e.what();
    }
    world->barrier();
  });
  if (is_rank_process()) return;
  expect_all_ok(ranks);
}

// Every rank must fail, quickly, and name both shapes; the real collective never runs.
// dist.interface / GLOO_SOCKET_IFNAME: a named interface must exist here and be up; a list
// with no name in it is refused rather than ignored.
TEST(Interface, NamesAreCheckedBeforeTheRendezvous) {
  EXPECT_EQ(keel::dist::choose_interface("lo").names, std::vector<std::string>{"lo"});
  EXPECT_EQ(keel::dist::choose_interface("lo").source, "dist.interface");
  EXPECT_FALSE(keel::dist::interface_address("lo").empty());
  for (const auto& [value, message] : std::vector<std::pair<std::string, std::string>>{
           {"eth-none", "dist.interface = \"eth-none\": no such network interface"},
           {"lo,eth-none", "dist.interface = \"eth-none\": no such network interface"},
           {",", "dist.interface = \",\": no interface name in it"}}) {
    try {
      keel::dist::choose_interface(value);
      ADD_FAILURE() << value << " accepted";
    } catch (const keel::InputError& e) {
      EXPECT_NE(std::string(e.what()).find(message), std::string::npos) << e.what();
    }
  }
  EXPECT_EQ(keel::dist::local_address_toward("127.0.0.1"), "127.0.0.1");
}

// The control-traffic counters behind summary.json's control_per_step and bench/scaling.py:
// exact payload bytes per call, probes counted apart.
TEST(Collectives, TrafficCountersCountCallsProbesAndBytes) {
  auto ranks = run_ranks(2, [](const World& w) {
    auto c = make_collectives(w);
    const keel::dist::TrafficStats before = c->traffic();
    auto t = torch::ones({10});
    c->all_reduce(t);  // a 16-byte probe, then 40 bytes
    auto d = c->traffic() - before;
    EXPECT_EQ(d.collectives, 2);
    EXPECT_EQ(d.probes, 1);
    EXPECT_EQ(d.bytes_sent, 16 + 40);
    EXPECT_EQ(d.bytes_received, 16 + 40);
    const auto mid = c->traffic();
    c->step_sync(1, 7, 0.5, false, 1.0);  // one all-gather of 9 int64, no probe
    d = c->traffic() - mid;
    EXPECT_EQ(d.collectives, 1);
    EXPECT_EQ(d.probes, 0);
    EXPECT_EQ(d.bytes_sent, 72);
    EXPECT_EQ(d.bytes_received, 72 * 2);
    EXPECT_GE(d.wait_ms, 0.0);
  });
  if (is_rank_process()) return;
  expect_all_ok(ranks);
}

// The step consensus exchanged now and read later (dist.consensus = late): two steps in flight
// read in order give each step's mean loss and verdict; found_inf is 1 on every rank when one
// rank saw inf/NaN, and when the ranks disagree on the gradient plan, which reading the record
// then reports on every rank naming each rank's step and plan, as step_sync does.
TEST(Collectives, TheStepConsensusReadLateStillNamesDisagreeingRanks) {
  auto ranks = run_ranks(
      2,
      [](const World& w) {
        auto c = make_collectives(w, 20);
        const auto loss = [&](double v) { return torch::full({1}, v + w.rank, torch::kDouble); };
        const auto flag = [](bool b) { return torch::full({1}, b ? 1.0f : 0.0f); };
        auto a = c->exchange_step(1, 7, loss(1.0), flag(false), 2.0);
        auto b = c->exchange_step(2, 7, loss(3.0), flag(w.rank == 1), 2.0, /*flags=*/1u << w.rank);
        EXPECT_EQ(a.found_inf().item<float>(), 0.0f);
        EXPECT_EQ(b.found_inf().item<float>(), 1.0f);  // rank 1's inf holds rank 0 back too
        double mine = 0;
        const auto ca = c->resolve(a, &mine);
        EXPECT_EQ(ca.mean_loss, 1.5);
        EXPECT_EQ(mine, 1.0 + w.rank);
        EXPECT_FALSE(ca.any_nonfinite);
        const auto cb = c->resolve(b);
        EXPECT_EQ(cb.mean_loss, 3.5);
        EXPECT_TRUE(cb.any_nonfinite);
        EXPECT_EQ(cb.any_flags, 3u);
        EXPECT_EQ(cb.all_flags, 0u);
        // Rank 1 ran another number of micro-batches: another gradient plan.
        auto bad = c->exchange_step(3, w.rank == 0 ? 0xa1 : 0xb2, loss(1.0), flag(false), 2.0);
        EXPECT_EQ(bad.found_inf().item<float>(), 1.0f);  // nobody applies step 3's update
        try {
          c->resolve(bad);
          ADD_FAILURE() << "no error on rank " << w.rank;
        } catch (const keel::dist::CollectiveMismatch& e) {
          const std::string m = e.what();
          EXPECT_NE(m.find("ranks disagree at the end of step 3's backward; no update was applied"), std::string::npos)
              << m;
          EXPECT_NE(m.find("rank 0: step 3, gradient plan a1"), std::string::npos) << m;
          EXPECT_NE(m.find("rank 1: step 3, gradient plan b2"), std::string::npos) << m;
        }
      },
      /*timeout_s=*/60);
  if (is_rank_process()) return;
  expect_all_ok(ranks);
}

// The step's mean loss weighs each rank's loss by the weight it sends (Launched::weight): a rank
// that computed no loss (a pipeline stage before the last) weighs 0, and its loss, even NaN,
// counts for nothing, read now or late; with no weight anywhere the mean is NaN, not 0.
TEST(Collectives, TheStepConsensusWeighsEachRanksLoss) {
  auto ranks = run_ranks(
      2,
      [](const World& w) {
        auto c = make_collectives(w, 20);
        const double nan = std::nan("");
        const double mine = w.rank == 0 ? nan : 3.0;
        const keel::dist::StepShare share{w.rank == 0 ? 0.0 : 1.0};
        EXPECT_EQ(c->step_sync(1, 7, mine, false, 1.0, 0, share).mean_loss, 3.0);
        auto late = c->exchange_step(2, 7, torch::full({1}, mine, torch::kDouble), torch::zeros({1}), 1.0, 0, share);
        EXPECT_EQ(c->resolve(late).mean_loss, 3.0);
        EXPECT_EQ(c->step_sync(3, 7, 1.0 + w.rank, false, 1.0, 0, {1.0 + w.rank}).mean_loss, (1.0 + 2.0 * 2.0) / 3.0);
        EXPECT_TRUE(std::isnan(c->step_sync(4, 7, 2.0, false, 1.0, 0, {0.0}).mean_loss));
      },
      /*timeout_s=*/60);
  if (is_rank_process()) return;
  expect_all_ok(ranks);
}

TEST(Collectives, MismatchedShapesFailFastOnEveryRankWithBothShapes) {
  auto ranks = run_ranks(
      2,
      [](const World& w) {
        auto c = make_collectives(w, /*timeout_s=*/20);
        c->set_step(3);
        auto t = w.rank == 0 ? torch::zeros({8, 16}) : torch::zeros({8, 16, 32});
        try {
          c->all_reduce(t, keel::dist::ReduceOp::Sum, "user all_reduce");
          ADD_FAILURE() << "no error on rank " << w.rank;
        } catch (const keel::dist::CollectiveMismatch& e) {
          const std::string m = e.what();
          EXPECT_NE(m.find("rank 0: all_reduce(sum) Float [8, 16]"), std::string::npos) << m;
          EXPECT_NE(m.find("rank 1: all_reduce(sum) Float [8, 16, 32]"), std::string::npos) << m;
          EXPECT_NE(m.find("step 3"), std::string::npos) << m;
        }
      },
      /*timeout_s=*/60);
  if (is_rank_process()) return;
  expect_all_ok(ranks);
}

TEST(Collectives, MismatchedDtypeAndOrderAreCaught) {
  auto ranks = run_ranks(
      2,
      [](const World& w) {
        auto c = make_collectives(w, 20);
        auto t = w.rank == 0 ? torch::zeros({4}, torch::kFloat) : torch::zeros({4}, torch::kDouble);
        EXPECT_THROW(c->all_reduce(t), keel::dist::CollectiveMismatch);
        // One rank broadcasts while the other all-reduces.
        auto u = torch::zeros({4});
        try {
          if (w.rank == 0)
            c->broadcast(u, 0);
          else
            c->all_reduce(u);
          ADD_FAILURE() << "no error";
        } catch (const keel::dist::CollectiveMismatch& e) {
          const std::string m = e.what();
          EXPECT_NE(m.find("broadcast Float [4] root 0"), std::string::npos) << m;
          EXPECT_NE(m.find("all_reduce(sum) Float [4]"), std::string::npos) << m;
        }
      },
      60);
  if (is_rank_process()) return;
  expect_all_ok(ranks);
}

// Issue 66 item 4: a sequence of calls (tensor parallelism's in a step) is validated call by call
// the first time its key runs and recorded; each later run confirms the record with one probe and
// issues the same calls unprobed, with the same results; another key is recorded on its own.
TEST(Collectives, ASequenceIsValidatedOnceThenReplayedWithOneProbe) {
  auto ranks = run_ranks(2, [](const World& w) {
    auto c = make_collectives(w, 20);
    auto calls = [&](int64_t n) {
      auto a = torch::full({4}, static_cast<double>(w.rank + 1));
      c->all_reduce(a, keel::dist::ReduceOp::Sum, "a");
      auto b = torch::full({n}, static_cast<double>(w.rank));
      c->all_reduce(b, keel::dist::ReduceOp::Max, "b");
      const auto g = c->all_gather(torch::ones({2}), "g");
      return a[0].item<double>() + b[n - 1].item<double>() + static_cast<double>(g.size());
    };
    for (int64_t step = 1; step <= 4; ++step) {
      c->set_step(step);
      const int64_t n = step == 3 ? 5 : 3;  // step 3: another key, recorded the first time
      const keel::dist::TrafficStats before = c->traffic();
      keel::dist::Collectives::Sequence seq = c->sequence(static_cast<uint64_t>(n));
      EXPECT_EQ(calls(n), 3 + 1 + 2) << "step " << step;
      seq.end();
      const keel::dist::TrafficStats d = c->traffic() - before;
      const bool first = step == 1 || step == 3;
      EXPECT_EQ(d.probes, first ? 3 : 1) << "step " << step;
      EXPECT_EQ(d.replayed, first ? 0 : 3) << "step " << step;
      EXPECT_EQ(d.collectives - d.probes, 3) << "step " << step;
    }
  });
  if (is_rank_process()) return;
  expect_all_ok(ranks);
}

// A replayed call that is not its record's throws on its rank before anything is issued, naming
// both; its peer, which issued its own, fails within dist.timeout_s naming that rank. A rank that
// replays while another records: both name the mismatch.
TEST(Collectives, AReplayThatLeavesItsRecordFailsNamingTheCall) {
  auto ranks = run_ranks(
      2,
      [](const World& w) {
        auto c = make_collectives(w, 6);
        auto t = torch::zeros({4});
        {
          auto seq = c->sequence(1);
          c->all_reduce(t, keel::dist::ReduceOp::Sum, "tp region");
          seq.end();
        }
        c->set_step(2);
        try {  // rank 0 replays key 1; rank 1 records key 2: the probe and the first call's meet
          auto seq = c->sequence(w.rank == 0 ? 1 : 2);
          c->all_reduce(t, keel::dist::ReduceOp::Sum, "tp region");
          ADD_FAILURE() << "no mismatch on rank " << w.rank;
        } catch (const keel::dist::CollectiveMismatch& e) {
          const std::string m = e.what();
          EXPECT_NE(m.find("rank 0: sequence of 1 recorded collectives"), std::string::npos) << m;
          EXPECT_NE(m.find("rank 1: all_reduce(sum) Float [4]"), std::string::npos) << m;
        }
        c->set_step(3);
        auto seq = c->sequence(1);
        auto u = torch::zeros({w.rank == 1 ? 5 : 4});
        try {
          c->all_reduce(u, keel::dist::ReduceOp::Sum, "tp region");
          ADD_FAILURE() << "no error on rank " << w.rank;
        } catch (const keel::dist::CollectiveMismatch& e) {
          const std::string m = e.what();
          EXPECT_EQ(w.rank, 1) << m;
          EXPECT_NE(m.find("collective #0 of a replayed sequence would be all_reduce(sum) Float [5]"),
                    std::string::npos)
              << m;
          EXPECT_NE(m.find("has all_reduce(sum) Float [4]"), std::string::npos) << m;
        } catch (const keel::dist::CollectiveError& e) {
          const std::string m = e.what();
          EXPECT_EQ(w.rank, 0) << m;
          EXPECT_NE(m.find("rank(s) 1 never reached or never finished"), std::string::npos) << m;
        }
      },
      60);
  if (is_rank_process()) return;
  expect_all_ok(ranks);
}

TEST(Collectives, ValidateModes) {
  World solo;
  Collectives always(keel::dist::Group::create(solo, keel::DistConfig{}, torch::kCPU), keel::Validate::Always);
  Collectives first(keel::dist::Group::create(solo, keel::DistConfig{}, torch::kCPU), keel::Validate::FirstStep);
  Collectives off(keel::dist::Group::create(solo, keel::DistConfig{}, torch::kCPU), keel::Validate::Off);
  first.set_step(1);
  always.set_step(5);
  EXPECT_TRUE(always.validating());
  EXPECT_TRUE(first.validating());
  first.set_step(2);
  EXPECT_FALSE(first.validating());
  EXPECT_FALSE(off.validating());
  // A single process needs no group: collectives are local no-ops.
  auto t = torch::ones({2});
  always.all_reduce(t);
  EXPECT_TRUE(torch::equal(t, torch::ones({2})));
}

TEST(Ddp, ParameterShapeMismatchNamesTheParameterAndShapes) {
  auto ranks = run_ranks(
      2,
      [](const World& w) {
        auto c = make_collectives(w, 20);
        keel::ModelConfig mc;
        mc.name = "mlp";
        mc.width = w.rank == 0 ? 256 : 128;
        auto model = keel::models::create_model(mc);
        try {
          keel::dist::DataParallel ddp(model, c, keel::DistConfig{});
          ADD_FAILURE() << "no error";
        } catch (const keel::dist::CollectiveMismatch& e) {
          const std::string m = e.what();
          EXPECT_NE(m.find("'fc.0.weight'"), std::string::npos) << m;
          EXPECT_NE(m.find("rank 0 has Float [256, 784]"), std::string::npos) << m;
          EXPECT_NE(m.find("rank 1 has Float [128, 784]"), std::string::npos) << m;
        }
      },
      60);
  if (is_rank_process()) return;
  expect_all_ok(ranks);
}

TEST(Ddp, StartsFromRankZerosParameters) {
  auto ranks = run_ranks(2, [](const World& w) {
    auto c = make_collectives(w);
    torch::manual_seed(100 + w.rank);  // different init on each rank
    keel::ModelConfig mc;
    mc.name = "cnn";
    auto model = keel::models::create_model(mc);
    keel::dist::DataParallel ddp(model, c, keel::DistConfig{});
    for (auto& [name, p] : model->named_parameters()) {
      auto all = c->all_gather(p.detach().flatten());
      EXPECT_TRUE(torch::equal(all[0], all[1])) << name;
    }
  });
  if (is_rank_process()) return;
  expect_all_ok(ranks);
}

// A peer that dies before its backward leaves the other rank in the DDP Reducer's gradient
// all-reduce (not keel's own collectives): that failure too is a CollectiveError naming the
// dead rank, not Gloo's bare message.
// The one door (issue 51, item 4): an observer on the world's Collectives sees DDP's gradient
// buckets (the Reducer's comm hook), ZeRO-3's replayed gathers and reduce-scatters and the control
// collectives; each started operation ends, and the door's one counter counts the buckets.
class Recorder : public keel::dist::OpObserver {
 public:
  void on_start(const keel::dist::OpRecord& op) override {
    std::lock_guard<std::mutex> lock(mu);
    started.push_back(op);
  }
  void on_end(const keel::dist::OpRecord& op) override {
    std::lock_guard<std::mutex> lock(mu);
    ended.push_back(op);
  }
  int64_t count(const std::vector<keel::dist::OpRecord>& v, keel::dist::OpRecord::Kind k) {
    std::lock_guard<std::mutex> lock(mu);
    return std::count_if(v.begin(), v.end(), [&](const auto& r) { return r.kind == k; });
  }
  std::mutex mu;
  std::vector<keel::dist::OpRecord> started, ended;
};

TEST(Collectives, OneDoorSeesGradientBucketsReplayedScheduleAndControlOps) {
  auto ranks = run_ranks(2, [](const World& w) {
    using Kind = keel::dist::OpRecord::Kind;
    const auto world = make_collectives(w);  // one rendezvous; a fresh door over its group per stage
    for (const int64_t zero : {0, 3}) {
      auto c = std::make_shared<Collectives>(world->group(), keel::Validate::Always);
      auto rec = std::make_shared<Recorder>();
      c->set_observer(rec);
      keel::ModelConfig mc;
      mc.name = "gpt", mc.width = 16, mc.depth = 2, mc.heads = 2, mc.context = 8, mc.vocab = 32;
      auto model = keel::models::create_model(mc);
      keel::DistConfig dc;
      dc.zero = zero;
      keel::dist::DataParallel ddp(model, c, dc);
      for (int step = 1; step <= 3; ++step) {
        c->set_step(step);
        ddp.before_forward(true, true);
        ddp.backward(model->forward(torch::randint(32, {2, 8})).sum(), true);
      }
      const auto t = c->traffic();
      if (zero == 0) {
        EXPECT_EQ(rec->count(rec->ended, Kind::Bucket), 3 * ddp.num_buckets());
        EXPECT_EQ(t.gradient_buckets, 3 * ddp.num_buckets());
        int64_t params = 0;
        for (const auto& p : model->parameters()) params += p.numel();
        EXPECT_EQ(t.gradient_bytes, 3 * params * 4);
      } else {
        EXPECT_EQ(t.gradient_buckets, 0);
        EXPECT_GT(rec->count(rec->ended, Kind::Replayed), 0) << "steps 2 and 3 replay step 1's schedule";
        EXPECT_EQ(rec->count(rec->ended, Kind::Replayed), t.replayed);
      }
      EXPECT_GT(rec->count(rec->ended, Kind::Collective), 0) << "the initial broadcast at least";
      EXPECT_EQ(rec->count(rec->ended, Kind::Probe), t.probes);
      for (const Kind k : {Kind::Collective, Kind::Replayed, Kind::Bucket})
        EXPECT_EQ(rec->count(rec->started, k), rec->count(rec->ended, k)) << "zero " << zero;
      std::lock_guard<std::mutex> lock(rec->mu);
      for (const auto& r : rec->ended) {
        EXPECT_EQ(r.group, "world");
        EXPECT_LE(r.start, r.end) << r.what;
        if (r.kind == Kind::Bucket) EXPECT_EQ(r.bytes, r.shape.at(0) * 4);
      }
      c->set_observer(nullptr);
    }
  });
  if (is_rank_process()) return;
  expect_all_ok(ranks);
}

TEST(Ddp, APeerLostDuringTheGradientAllReduceIsNamed) {
  auto ranks = run_ranks(2, [](const World& w) {
    auto c = make_collectives(w, /*timeout_s=*/20);
    keel::ModelConfig mc;
    mc.name = "mlp";
    mc.width = 16;
    mc.depth = 1;
    auto model = keel::models::create_model(mc);
    keel::dist::DataParallel ddp(model, c, keel::DistConfig{});
    auto x = torch::randn({4, 1, 28, 28});
    if (w.rank == 1) std::raise(SIGKILL);  // gone before its backward
    ddp.before_forward(true);
    auto loss = model->forward(x).sum();
    try {
      ddp.backward(loss, true);
      ADD_FAILURE() << "the gradient all-reduce succeeded without rank 1";
    } catch (const keel::dist::CollectiveError& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("DDP gradient all-reduce"), std::string::npos) << what;
      EXPECT_NE(what.find("rank(s) 1 never reached"), std::string::npos) << what;
    }
  });
  if (is_rank_process()) return;
  ASSERT_EQ(ranks.size(), 2u);
  EXPECT_EQ(ranks[0].exit_code, 0) << ranks[0].output;
  EXPECT_TRUE(ranks[1].signaled);
}

// --- equivalence: N ranks x batch B == 1 rank x batch N*B -----------------------------------

keel::Config equivalence_config(const std::string& dir, int64_t batch, int64_t accum) {
  keel::Config cfg;
  cfg.run.dir = dir;
  cfg.run.threads = 1;
  cfg.run.log_level = keel::logging::Level::warn;
  cfg.model.name = "mlp";
  cfg.model.width = 64;
  cfg.model.depth = 3;
  cfg.data.name = "synthetic";
  cfg.data.synthetic_size = 1024;
  cfg.train.steps = 20;
  cfg.train.batch_size = batch;
  cfg.train.grad_accum = accum;
  cfg.train.optimizer = "sgd";
  cfg.train.lr = 0.05;
  cfg.train.schedule = "constant";
  keel::validate(cfg);
  return cfg;
}

std::vector<torch::Tensor> train_and_get_params(const keel::Config& cfg, const World& w) {
  std::vector<torch::Tensor> params;
  keel::Callbacks cb;
  cb.on_end = [&](keel::models::Model& m) {
    for (auto& p : m.parameters()) params.push_back(p.detach().clone());
  };
  keel::Trainer(cfg, w, cb).run();
  return params;
}

// Tolerance: both runs compute the same mean gradient over the same 64 samples per step, but
// in a different order (two means of 32 averaged by the all-reduce vs one mean of 64), so each
// step differs by float32 rounding (~1e-7 relative). Over 20 SGD steps that stays below 1e-5
// absolute on parameters of magnitude ~0.1; a wrong average (sum instead of mean), a missing
// all-reduce or different samples per step are off by 1e-2 or more. Measured: 2.2e-8 for the
// equal runs, 1.5e-2 when the single-rank run uses batch 32 instead of 64.
void expect_same_params(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  ASSERT_EQ(a.size(), b.size());
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) worst = std::max(worst, (a[i] - b[i]).abs().max().item<double>());
  EXPECT_LT(worst, 1e-5) << "max abs parameter difference " << worst;
  ::testing::Test::RecordProperty("max_abs_param_diff", std::to_string(worst));
}

void check_equivalence(int64_t batch, int64_t accum) {
  TempDir d;
  const std::string out = d.file("rank0_params.pt");
  auto ranks = run_ranks(2,
                         [&](const World& w) {
                           TempDir rd;
                           auto params = train_and_get_params(equivalence_config(rd.file("run"), batch, accum), w);
                           const char* path = std::getenv("KEEL_TEST_OUT");
                           if (w.rank == 0 && path) torch::save(params, path);
                         },
                         120, {"KEEL_TEST_OUT=" + out});
  if (is_rank_process()) return;
  expect_all_ok(ranks);
  auto single = train_and_get_params(equivalence_config(d.file("single"), 64, 1), World{});
  std::vector<torch::Tensor> two;
  torch::load(two, out);
  expect_same_params(two, single);
}

TEST(Ddp, TwoRanksBatch32EqualsOneRankBatch64) { check_equivalence(32, 1); }

TEST(Ddp, GradAccumulationEqualsOneLargeBatch) { check_equivalence(16, 2); }

// One hook per test: each run_ranks gets fresh processes and a fresh port (two groups created
// one after the other on the same port in one process race on the old store's teardown).
void check_hook_trains(const char* hook) {
  auto ranks = run_ranks(2, [hook](const World& w) {
    TempDir rd;
    keel::Config cfg = equivalence_config(rd.file("run"), 32, 1);
    keel::apply_override(cfg, "dist.comm_hook", hook);
    auto summary = keel::Trainer(cfg, w).run();
    EXPECT_TRUE(std::isfinite(summary.final_loss)) << hook;
  });
  if (is_rank_process()) return;
  expect_all_ok(ranks);
}

// dist.zero = 3 gathers the whole model at the end only for Callbacks::on_end, and then on
// every rank when any rank set one (the gathers are collective): here rank 0 alone, which sees
// every parameter whole, while rank 1 leaves with its shards.
TEST(Ddp, OnEndOnOneRankAtStage3SeesTheWholeModel) {
  auto ranks = run_ranks(2, [](const World& w) {
    TempDir rd;
    keel::Config cfg = equivalence_config(rd.file("run"), 32, 1);
    keel::apply_override(cfg, "dist.zero", "3");
    keel::validate(cfg);
    keel::Callbacks cb;
    int64_t seen = -1;
    if (w.rank == 0) cb.on_end = [&](keel::models::Model& m) { seen = m.num_parameters(); };
    const auto s = keel::Trainer(cfg, w, cb).run();
    EXPECT_GT(s.num_parameters, 0);
    if (w.rank == 0) EXPECT_EQ(seen, s.num_parameters);
  });
  if (is_rank_process()) return;
  expect_all_ok(ranks);
}

TEST(Ddp, Bf16CompressionHookTrains) { check_hook_trains("bf16"); }

TEST(Ddp, Fp16CompressionHookTrains) { check_hook_trains("fp16"); }

// A model with a parameter that never receives a gradient.
struct WithUnusedImpl : torch::nn::Module {
  WithUnusedImpl()
      : used(register_module("used", torch::nn::Linear(784, 10))),
        unused(register_module("unused", torch::nn::Linear(3, 3))) {}
  torch::Tensor forward(const torch::Tensor& x) { return used->forward(x.flatten(1)); }
  torch::nn::Linear used, unused;
};
TORCH_MODULE(WithUnused);

void register_with_unused() {
  keel::models::register_model("with_unused", [](const keel::ModelConfig&, std::optional<keel::models::InputKind>) {
    return std::make_shared<keel::models::ModuleModel<WithUnused>>(
        "with_unused", WithUnused(), keel::models::InputSpec{keel::models::InputKind::Image, {1, 28, 28}, 10});
  });
}

keel::Config unused_config(const std::string& dir, bool find_unused) {
  keel::Config cfg = equivalence_config(dir, 16, 1);
  cfg.model.name = "with_unused";
  cfg.train.steps = 4;
  cfg.dist.find_unused_parameters = find_unused;
  cfg.dist.timeout_s = 30;
  return cfg;
}

TEST(Ddp, FindUnusedParametersTrainsAModelWithAnUnusedParameter) {
  auto ranks = run_ranks(2, [](const World& w) {
    register_with_unused();
    TempDir rd;
    EXPECT_NO_THROW(keel::Trainer(unused_config(rd.file("run"), true), w).run());
  });
  if (is_rank_process()) return;
  expect_all_ok(ranks);
}

TEST(Ddp, UnusedParameterWithoutFindUnusedIsAnError) {
  auto ranks = run_ranks(
      2,
      [](const World& w) {
        register_with_unused();
        TempDir rd;
        try {
          keel::Trainer(unused_config(rd.file("run"), false), w).run();
          ADD_FAILURE() << "expected the Reducer to refuse an unused parameter";
        } catch (const std::exception& e) {
          // c10d's Reducer names the option and the parameter.
          EXPECT_NE(std::string(e.what()).find("find_unused_parameters"), std::string::npos) << e.what();
        }
      },
      90);
  if (is_rank_process()) return;
  expect_all_ok(ranks);
}

// The same when the parameter goes unused only from the third step on: the Reducer's check that
// the previous reduction finished runs before every synced forward (its rebuild_buckets), not only
// before the second (the flight recorder's record of the rebuild must not skip it: found in review).
struct LaterUnusedImpl : torch::nn::Module {
  LaterUnusedImpl()
      : used(register_module("used", torch::nn::Linear(784, 10))),
        later(register_module("later", torch::nn::Linear(3, 3))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    torch::Tensor y = used->forward(x.flatten(1));
    if (is_training() && calls_++ < 2) y = y + 0.0 * later->forward(torch::ones({1, 3})).sum();
    return y;
  }
  torch::nn::Linear used, later;
  int calls_ = 0;
};
TORCH_MODULE(LaterUnused);

TEST(Ddp, AParameterUnusedFromTheThirdStepWithoutFindUnusedIsAnError) {
  auto ranks = run_ranks(
      2,
      [](const World& w) {
        keel::models::register_model("later_unused", [](const keel::ModelConfig&,
                                                        std::optional<keel::models::InputKind>) {
          return std::make_shared<keel::models::ModuleModel<LaterUnused>>(
              "later_unused", LaterUnused(), keel::models::InputSpec{keel::models::InputKind::Image, {1, 28, 28}, 10});
        });
        TempDir rd;
        keel::Config cfg = unused_config(rd.file("run"), false);
        cfg.model.name = "later_unused";
        cfg.train.steps = 6;
        try {
          keel::Trainer(cfg, w).run();
          ADD_FAILURE() << "expected the Reducer to refuse a parameter unused from step 3";
        } catch (const std::exception& e) {
          EXPECT_NE(std::string(e.what()).find("find_unused_parameters"), std::string::npos) << e.what();
        }
      },
      90);
  if (is_rank_process()) return;
  expect_all_ok(ranks);
}

// dist.broadcast_buffers (issue 13): a model with BatchNorm, two ranks seeing different data.
// With it (the default) every rank ends with rank 0's running statistics and the checkpoint
// holds them; without it each rank keeps its own.
struct WithBnImpl : torch::nn::Module {
  WithBnImpl()
      : fc(register_module("fc", torch::nn::Linear(784, 32))),
        bn(register_module("bn", torch::nn::BatchNorm1d(32))),
        out(register_module("out", torch::nn::Linear(32, 10))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    return out->forward(torch::relu(bn->forward(fc->forward(x.flatten(1)))));
  }
  torch::nn::Linear fc;
  torch::nn::BatchNorm1d bn;
  torch::nn::Linear out;
};
TORCH_MODULE(WithBn);

// Each rank's BatchNorm running mean after training, as rank r printed it ("bn_mean <r> <sum>").
std::vector<std::string> bn_means(bool broadcast, const std::string& ckpt_dir) {
  auto ranks = run_ranks(
      2,
      [broadcast](const World& w) {
        keel::models::register_model("with_bn", [](const keel::ModelConfig&, std::optional<keel::models::InputKind>) {
          return std::make_shared<keel::models::ModuleModel<WithBn>>(
              "with_bn", WithBn(), keel::models::InputSpec{keel::models::InputKind::Image, {1, 28, 28}, 10});
        });
        TempDir rd;
        keel::Config cfg = equivalence_config(rd.file("run"), 16, 1);
        cfg.model.name = "with_bn";
        cfg.train.steps = 6;
        cfg.dist.broadcast_buffers = broadcast;
        if (broadcast) cfg.checkpoint.dir = std::getenv("KEEL_TEST_CKPT");
        keel::Callbacks cb;
        cb.on_end = [&](keel::models::Model& m) {
          for (const auto& [n, t] : m.named_buffers())
            if (n == "bn.running_mean") std::printf("bn_mean %ld %.17g\n", long(w.rank), t.sum().item<double>());
          std::fflush(stdout);
        };
        keel::Trainer(cfg, w, cb).run();
      },
      120, {"KEEL_TEST_CKPT=" + ckpt_dir});
  std::vector<std::string> means;
  if (is_rank_process()) return means;
  expect_all_ok(ranks);
  for (int r = 0; r < 2; ++r) {
    const std::string tag = "bn_mean " + std::to_string(r) + " ";
    const auto at = ranks[r].output.find(tag);
    means.push_back(at == std::string::npos
                        ? ""
                        : ranks[r].output.substr(at + tag.size(), ranks[r].output.find('\n', at) - at - tag.size()));
  }
  return means;
}

// One run_ranks per test: a rank process runs the whole test body.
TEST(Ddp, BroadcastBuffersKeepsBatchNormStatisticsEqualAcrossRanks) {
  TempDir d;
  const auto with = bn_means(true, d.file("ckpt"));
  if (is_rank_process()) return;
  ASSERT_EQ(with.size(), 2u);
  EXPECT_FALSE(with[0].empty());
  EXPECT_EQ(with[0], with[1]);  // rank 0's statistics everywhere
  // The checkpoint holds rank 0's buffers (whichever rank wrote the shard holding them).
  double saved = std::nan("");
  for (const char* shard : {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"})
    for (const auto& [n, t] : keel::checkpoint::read_safetensors(d.file("ckpt/step_6/") + shard).tensors)
      if (n == "bn.running_mean") saved = t.sum().item<double>();
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.17g", saved);
  EXPECT_EQ(std::string(buf), with[0]);
}

TEST(Ddp, WithoutBroadcastBuffersEachRankKeepsItsOwnStatistics) {
  TempDir d;
  const auto without = bn_means(false, d.file("unused"));
  if (is_rank_process()) return;
  ASSERT_EQ(without.size(), 2u);
  EXPECT_FALSE(without[0].empty());
  EXPECT_NE(without[0], without[1]);  // different data, different statistics: the test above can fail
}

// --- launchers --------------------------------------------------------------------------------

std::vector<std::string> smoke_args(const std::string& dir) {
  return {
      "train",          "--config", source_path("configs/synthetic_smoke.toml"), "--train.steps=20", "--run.dir=" + dir,
      "--run.threads=1"};
}

double final_loss(const std::string& dir) {
  return nlohmann::json::parse(read_text(dir + "/summary.json"))["final_loss"].get<double>();
}

// Hardening class 3: ranks started with different configurations (two command lines under
// mpirun, or by hand) stop before any other collective, on every rank, with exit 2 and a
// message naming the first key that differs and each rank's value. A different bucket size
// used to abort one rank inside Gloo; a different lr trained and checkpointed two models.
TEST(RankAgreement, DifferentConfigsStopEveryRankNamingTheKey) {
  TempDir d;
  auto launch = [&](const std::string& tag, const std::vector<std::string>& rank0,
                    const std::vector<std::string>& rank1) {
    const int port = free_port();
    std::vector<Child> kids;
    for (int r = 0; r < 2; ++r) {
      auto args = smoke_args(d.file(tag + std::to_string(r)));
      const auto& extra = r == 0 ? rank0 : rank1;
      args.insert(args.end(), extra.begin(), extra.end());
      kids.push_back(
          spawn_keel(args, {"RANK=" + std::to_string(r), "WORLD_SIZE=2", "LOCAL_RANK=" + std::to_string(r),
                            "LOCAL_WORLD_SIZE=2", "MASTER_ADDR=127.0.0.1", "MASTER_PORT=" + std::to_string(port)}));
    }
    std::vector<ProcResult> out;
    for (auto& k : kids) out.push_back(wait_process(k, 120));
    return out;
  };
  auto ranks = launch("lr", {"--train.lr=0.5"}, {"--train.lr=0.7"});
  for (const auto& r : ranks) {
    EXPECT_FALSE(r.signaled) << r.output;
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_NE(r.output.find("train.lr = 0.5 on rank 0, 0.7 on rank 1"), std::string::npos) << r.output;
  }
  ranks = launch("bucket", {}, {"--dist.bucket_cap_mb=1", "--dist.first_bucket_mb=2"});
  for (const auto& r : ranks) {
    EXPECT_FALSE(r.signaled) << r.output;
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_NE(r.output.find("dist.bucket_cap_mb = "), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("(1 more key(s) differ)"), std::string::npos) << r.output;
  }
  ranks = launch("zero", {"--dist.zero=1"}, {"--dist.zero=2"});  // a partition two ranks would disagree on
  for (const auto& r : ranks) {
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_NE(r.output.find("dist.zero = 1 on rank 0, 2 on rank 1"), std::string::npos) << r.output;
  }
  // The check itself does not depend on what it checks: ranks validating collectives differently
  // are still told so (an unvalidated exchange on one rank against a validated one would not be).
  ranks = launch("validate", {"--dist.validate=off"}, {"--dist.validate=always"});
  for (const auto& r : ranks) {
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_NE(r.output.find("dist.validate = \"off\" on rank 0, \"always\" on rank 1"), std::string::npos) << r.output;
  }
  // What may differ per rank does not stop the job.
  ranks = launch("ok", {"--run.log_level=debug"}, {"--run.threads=1", "--run.dir=" + d.file("elsewhere")});
  for (const auto& r : ranks) EXPECT_EQ(r.exit_code, 0) << r.output;
}

TEST(Launch, TorchrunMpirunAndSingleProcessRunTheSameConfig) {
  TempDir d;
  // torchrun's default (static) rendezvous, as users type it.
  std::vector<std::string> torchrun = {KEEL_TORCHRUN,   "--nproc_per_node",          "2",        "--no_python",
                                       "--master_port", std::to_string(free_port()), KEEL_BINARY};
  auto args = smoke_args(d.file("torchrun"));
  torchrun.insert(torchrun.end(), args.begin(), args.end());
  auto r = run_process(torchrun, {}, 180);
  ASSERT_EQ(r.exit_code, 0) << r.output;

  std::vector<std::string> mpirun = {"/usr/bin/mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2",
                                     KEEL_BINARY};
  args = smoke_args(d.file("mpirun"));
  mpirun.insert(mpirun.end(), args.begin(), args.end());
  r = run_process(mpirun, {}, 180);
  ASSERT_EQ(r.exit_code, 0) << r.output;

  r = run_keel(smoke_args(d.file("single")));
  ASSERT_EQ(r.exit_code, 0) << r.output;

  auto t = nlohmann::json::parse(read_text(d.file("torchrun/summary.json")));
  auto m = nlohmann::json::parse(read_text(d.file("mpirun/summary.json")));
  EXPECT_EQ(t["world_size"], 2);
  EXPECT_EQ(t["launcher"], "torchrun");
  EXPECT_EQ(m["world_size"], 2);
  EXPECT_EQ(m["launcher"], "mpirun");
  // Same data, same init, same reduction order: the two launchers give the same run.
  EXPECT_EQ(final_loss(d.file("torchrun")), final_loss(d.file("mpirun")));
  EXPECT_TRUE(std::isfinite(final_loss(d.file("single"))));
}

}  // namespace
