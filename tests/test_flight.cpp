// The flight recorder (dist/flight.h), the phase (dist/phase.h) and `keel doctor`
// (trainer/app/doctor.h), issue 67: the ring and its dump, the doctor's diagnosis of dumps made by
// hand (each cause), and real runs of 2 ranks stopped by each fault type at several phases, each
// diagnosed by `keel doctor --json` naming the rank, the collective and the phase.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <csignal>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "dist/flight.h"
#include "dist/phase.h"
#include "helpers.h"
#include "multirank.h"
#include "trainer/app/doctor.h"
#include "trainer/fault/fault.h"

using namespace keel::testing;
using keel::dist::OpRecord;
using keel::dist::Phase;
using keel::dist::PhaseScope;
using keel::dist::PhaseState;
using nlohmann::json;

namespace {

TEST(Phase, PacksDescribesAndPutsBackThePhaseBefore) {
  PhaseState s;
  s.phase = Phase::Backward;
  s.block = 7;
  s.stage = 1;
  s.micro = 2;
  s.bucket = 3;
  const PhaseState u = PhaseState::unpack(s.pack(), 12);
  EXPECT_EQ(u.phase, Phase::Backward);
  EXPECT_EQ(u.block, 7);
  EXPECT_EQ(u.stage, 1);
  EXPECT_EQ(u.micro, 2);
  EXPECT_EQ(u.bucket, 3);
  EXPECT_EQ(u.step, 12);
  EXPECT_EQ(u.describe(), "backward of block 7, gradient bucket 3 (stage 1, micro-batch 2)");
  EXPECT_EQ(keel::dist::phase_of("checkpoint_commit"), Phase::CheckpointCommit);
  EXPECT_EQ(keel::dist::phase_of("meteor"), Phase::Idle);

  std::vector<Phase> entered;
  keel::dist::set_phase_hook([&](const PhaseState& p) { entered.push_back(p.phase); });
  {
    PhaseScope eval(Phase::Eval);
    keel::dist::set_block(4);
    EXPECT_EQ(keel::dist::current_phase().describe(), "eval of block 4");
    {
      PhaseScope fwd(Phase::Forward, -1, 0);
      EXPECT_EQ(keel::dist::current_phase().phase, Phase::Forward);
      EXPECT_EQ(keel::dist::current_phase().block, -1);  // a new phase starts without a block
    }
    EXPECT_EQ(keel::dist::current_phase().describe(), "eval of block 4");
  }
  keel::dist::set_phase_hook(nullptr);
  EXPECT_EQ(keel::dist::current_phase().phase, Phase::Idle);
  EXPECT_EQ(entered, (std::vector<Phase>{Phase::Eval, Phase::Forward}));
  // An exception leaves the phase it was thrown in (what the dump after it says).
  try {
    PhaseScope commit(Phase::CheckpointCommit);
    throw std::runtime_error("x");
  } catch (const std::runtime_error&) {
  }
  EXPECT_EQ(keel::dist::current_phase().phase, Phase::CheckpointCommit);
  { PhaseScope reset(Phase::Idle); }
}

OpRecord record(uint64_t seq, const char* op, std::vector<int64_t> shape, OpRecord::Lane lane = OpRecord::Lane::Calls) {
  OpRecord r;
  r.lane = lane;
  r.kind = lane == OpRecord::Lane::Bucket ? OpRecord::Kind::Bucket : OpRecord::Kind::Collective;
  r.group = "world";
  r.seq = seq;
  r.op = op;
  r.what = "test";
  r.shape = std::move(shape);
  r.dtype = c10::ScalarType::Float;
  r.step = 3;
  r.phase = keel::dist::current_phase().pack();  // as the door stamps it
  r.enqueue = r.start = r.end = std::chrono::steady_clock::now();
  return r;
}

json read_json(const std::string& path) {
  std::ifstream in(path);
  return json::parse(in);
}

// The ring keeps the last `capacity` operations, each ended where it started (an end matched by
// group, lane and number), a failure marks its operation and dumps at once, atomically; a new
// recorder sets an earlier run's dump aside.
TEST(FlightRecorder, TheRingKeepsTheLastOperationsAndAFailureDumpsThem) {
  TempDir d;
  keel::dist::FlightOptions o;
  o.capacity = 4;
  o.dir = d.file("flight");
  o.rank = 1;
  o.world_size = 2;
  {
    keel::dist::FlightRecorder fr(o);
    PhaseScope phase(Phase::Backward, -1, 0);
    for (uint64_t i = 0; i < 5; ++i) {
      fr.on_start(record(i, "all_reduce", {4}));
      fr.on_end(record(i, "all_reduce", {4}));
    }
    fr.on_start(record(0, "all_reduce", {8}, OpRecord::Lane::Bucket));  // open, then failed
    fr.on_start(record(5, "broadcast", {2}));                           // open: still issued
    OpRecord failed = record(0, "all_reduce", {8}, OpRecord::Lane::Bucket);
    failed.outcome = OpRecord::Outcome::TimedOut;
    fr.on_failure(failed, "Timed out waiting 6000ms");
    EXPECT_EQ(fr.recorded(), 7u);
    const json j = read_json(fr.path());
    EXPECT_EQ(j["rank"], 1);
    ASSERT_EQ(j["ops"].size(), 4u);  // the last four of seven
    EXPECT_EQ(j["ops"][0]["seq"], 3);
    EXPECT_EQ(j["ops"][0]["state"], "completed");
    EXPECT_EQ(j["ops"][2]["lane"], "bucket");
    EXPECT_EQ(j["ops"][2]["state"], "timed out");
    EXPECT_EQ(j["ops"][2]["error"], "Timed out waiting 6000ms");
    EXPECT_EQ(j["ops"][3]["state"], "issued");
    EXPECT_EQ(j["ops"][3]["phase"], "backward");
    EXPECT_EQ(j["ops"][3]["micro_batch"], 0);
    EXPECT_EQ(j["events"].back()["reason"], "collective timed out (world all_reduce #0)");
    for (const auto& e : std::filesystem::directory_iterator(o.dir))  // no temporary file left
      EXPECT_EQ(e.path().filename().string().find(".tmp"), std::string::npos) << e.path();
  }
  keel::dist::FlightRecorder again(o);
  EXPECT_FALSE(std::filesystem::exists(again.path()));
  EXPECT_TRUE(std::filesystem::exists(o.dir + "/previous/rank1.json"));
}

// ---- the doctor on dumps made by hand: each cause ------------------------------------------

json op(const std::string& group, const std::string& lane, uint64_t seq, const std::string& name,
        std::vector<int64_t> shape, const std::string& state, double enqueue_ms, const std::string& phase = "forward") {
  return {{"group", group},
          {"lane", lane},
          {"seq", seq},
          {"op", name},
          {"what", "w"},
          {"dtype", "Float"},
          {"shape", shape},
          {"phase", phase},
          {"where", phase},
          {"step", 5},
          {"state", state},
          {"enqueue_ms", enqueue_ms},
          {"start_ms", enqueue_ms},
          {"kind", "collective"}};
}

// An operation the device finishes (NCCL: the host only enqueued it) stays "enqueued" until its
// work's result comes: completed then, with its own end; a result of TIMEOUT or COMM_ERROR marks
// it and dumps; one the watchdog finds open past the stall bound is dumped as stuck on the
// device; a result that comes after the recorder is gone is ignored.
c10::intrusive_ptr<c10::ivalue::Future> work_result() {
  return c10::make_intrusive<c10::ivalue::Future>(c10::IntType::get());
}
TEST(FlightRecorder, AnOperationTheDeviceFinishesEndsWithItsWorksResult) {
  TempDir d;
  keel::dist::FlightOptions o;
  o.dir = d.file("flight");
  o.stall = std::chrono::milliseconds(300);
  auto ok = work_result(), late = work_result(), lost = work_result(), done = work_result();
  done->markCompleted(c10::IValue(int64_t{0}));  // finished before the host was done with it
  {
    keel::dist::FlightRecorder fr(o);
    OpRecord a = record(0, "all_reduce", {4}, OpRecord::Lane::Bucket), b = record(1, "all_gather", {8});
    OpRecord c = record(2, "all_reduce", {2}), e = record(0, "reduce_scatter", {2});
    e.group = "dp/0";  // (another group: its end says nothing of world's)
    for (OpRecord* r : {&a, &b, &c, &e}) fr.on_start(*r);
    a.device = ok, b.device = late, c.device = lost, e.device = done;
    for (OpRecord* r : {&a, &b, &c, &e}) fr.on_end(*r);
    ASSERT_TRUE(fr.dump("now"));
    json j = read_json(fr.path());
    ASSERT_EQ(j["ops"].size(), 4u);
    for (int i = 0; i < 3; ++i) {
      EXPECT_EQ(j["ops"][i]["state"], "enqueued") << j["ops"][i];
      EXPECT_EQ(j["ops"][i]["completion"], "device");
      EXPECT_TRUE(j["ops"][i].contains("host_end_ms"));
      EXPECT_FALSE(j["ops"][i].contains("end_ms"));
    }
    EXPECT_EQ(j["ops"][3]["state"], "completed");
    EXPECT_EQ(j["ops"][3]["completion"], "device");
    ok->markCompleted(c10::IValue(int64_t{0}));    // c10d::WorkResult::SUCCESS
    late->markCompleted(c10::IValue(int64_t{1}));  // TIMEOUT: dumped at once
    j = read_json(fr.path());
    EXPECT_EQ(j["ops"][0]["state"], "completed");
    EXPECT_GE(j["ops"][0]["end_ms"].get<double>(), j["ops"][0]["host_end_ms"].get<double>());
    EXPECT_EQ(j["ops"][1]["state"], "timed out");
    EXPECT_EQ(j["events"].back()["reason"], "collective timed out on the device (world all_gather #1)");
    // #2 is never finished: the watchdog dumps it once it is open past the stall bound.
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    for (;;) {
      j = read_json(fr.path());
      if (j["events"].back()["reason"].get<std::string>().rfind("stuck", 0) == 0) break;
      ASSERT_LT(std::chrono::steady_clock::now(), deadline) << j["events"];
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    EXPECT_NE(j["events"].back()["reason"].get<std::string>().find("world all_reduce #2"), std::string::npos);
    EXPECT_NE(j["events"].back()["reason"].get<std::string>().find("enqueued: the device has not finished it"),
              std::string::npos)
        << j["events"].back();
    EXPECT_EQ(j["ops"][2]["state"], "enqueued");
  }
  lost->markCompleted(c10::IValue(int64_t{2}));  // after the recorder: nothing to mark, no crash
}

// One communicator runs its group's collectives in order: a later one that completed settles the
// ones still enqueued before it (not another group's, nor a pair's messages); of several device
// results of failure (a communicator's error fails each pending work), the first is dumped.
TEST(FlightRecorder, ALaterCompletionSettlesTheOperationsEnqueuedBeforeItOnItsGroup) {
  TempDir d;
  keel::dist::FlightOptions o;
  o.dir = d.file("flight");
  keel::dist::FlightRecorder fr(o);
  OpRecord a = record(0, "all_reduce", {4}), p = record(0, "send", {4}, OpRecord::Lane::P2P);
  OpRecord t = record(0, "all_gather", {4}), u = record(1, "all_gather", {4});
  t.group = u.group = "tp/0";
  auto ra = work_result(), rp = work_result(), rt = work_result(), ru = work_result();
  a.device = ra, p.device = rp, t.device = rt, u.device = ru;
  for (OpRecord* r : {&a, &p, &t, &u}) fr.on_start(*r), fr.on_end(*r);
  const OpRecord later = record(1, "all_reduce", {1});  // on the host, in world
  fr.on_start(later);
  fr.on_end(later);
  ASSERT_TRUE(fr.dump("now"));
  json j = read_json(fr.path());
  ASSERT_EQ(j["ops"].size(), 5u);
  EXPECT_EQ(j["ops"][0]["state"], "completed");  // world #0, settled by world #1
  EXPECT_TRUE(j["ops"][0].contains("end_ms"));
  EXPECT_EQ(j["ops"][1]["state"], "enqueued");  // the message
  EXPECT_EQ(j["ops"][2]["state"], "enqueued");  // tp/0's
  EXPECT_EQ(j["ops"][3]["state"], "enqueued");
  rt->markCompleted(c10::IValue(int64_t{2}));  // COMM_ERROR
  ru->markCompleted(c10::IValue(int64_t{2}));
  ra->markCompleted(c10::IValue(int64_t{0}));  // after it was settled: nothing changes
  ASSERT_TRUE(fr.dump("again"));
  j = read_json(fr.path());
  EXPECT_EQ(j["ops"][2]["state"], "failed");
  EXPECT_EQ(j["ops"][3]["state"], "failed");  // marked, not dumped for itself
  ASSERT_EQ(j["events"].size(), 3u) << j["events"];
  EXPECT_EQ(j["events"][1]["reason"], "collective failed on the device (tp/0 all_gather #0)");
  EXPECT_EQ(j["ops"][0]["state"], "completed");
}

json dump(int64_t rank, int64_t world, std::vector<json> ops, const std::string& where = "forward") {
  return {{"rank", rank},
          {"world_size", world},
          {"host", "h" + std::to_string(rank)},
          {"pid", 1},
          {"where", where},
          {"phase", where},
          {"step", 5},
          {"events", {{{"reason", "the run failed"}, {"error", ""}}}},
          {"ops", ops},
          {"dumped_ms", 1.0}};
}

std::vector<json> healthy_prefix(int64_t rank) {
  return {op("world", "calls", 0, "all_reduce", {4}, "completed", 10),
          op("world", "calls", 1, "all_reduce", {4}, "completed", 20)};
}

std::vector<json> with(std::vector<json> ops, const json& more) {
  ops.push_back(more);
  return ops;
}

TEST(Doctor, NamesADeadRankAHungRankAndAStraggler) {
  // Rank 1 left no dump; rank 0 is stuck in collective #2.
  auto r = keel::doctor::diagnose(
      {dump(0, 2, with(healthy_prefix(0), op("world", "calls", 2, "all_gather", {9}, "failed", 30)))});
  EXPECT_EQ(r.json["cause"]["kind"], "dead_rank") << r.text;
  EXPECT_EQ(r.json["cause"]["ranks"], json({1}));
  EXPECT_EQ(r.json["divergence"]["seq"], 2);
  EXPECT_NE(r.text.find("rank 1: left no flight record"), std::string::npos) << r.text;
  // Rank 1 dumped, never entered #2, and did nothing after: hung where its dump says.
  r = keel::doctor::diagnose(
      {dump(0, 2, with(healthy_prefix(0), op("world", "calls", 2, "all_gather", {9}, "timed out", 30))),
       dump(1, 2, healthy_prefix(1), "backward of block 3")});
  EXPECT_EQ(r.json["cause"]["kind"], "hang") << r.text;
  EXPECT_NE(r.json["cause"]["text"].get<std::string>().find("stopped in backward of block 3 at step 5"),
            std::string::npos)
      << r.text;
  // Rank 1 entered #2 9 s after rank 0.
  r = keel::doctor::diagnose(
      {dump(0, 2, with(healthy_prefix(0), op("world", "calls", 2, "all_gather", {9}, "timed out", 30))),
       dump(1, 2, with(healthy_prefix(1), op("world", "calls", 2, "all_gather", {9}, "failed", 9030)))});
  EXPECT_EQ(r.json["cause"]["kind"], "straggler") << r.text;
  EXPECT_EQ(r.json["cause"]["ranks"], json({1}));
  // Every rank agrees: nothing diverged.
  r = keel::doctor::diagnose({dump(0, 2, healthy_prefix(0)), dump(1, 2, healthy_prefix(1))});
  EXPECT_EQ(r.json["cause"]["kind"], "none") << r.text;
}

// NCCL: rank 0 enqueued #2 and its device never finished it; rank 1 never entered it.
TEST(Doctor, AnOperationTheDeviceHasNotFinishedIsShownEnqueued) {
  json stuck = op("world", "calls", 2, "all_reduce", {9}, "enqueued", 30);
  stuck["completion"] = "device";
  const auto r = keel::doctor::diagnose(
      {dump(0, 2, with(healthy_prefix(0), stuck)), dump(1, 2, healthy_prefix(1), "backward of block 3")});
  EXPECT_EQ(r.json["cause"]["kind"], "hang") << r.text;
  EXPECT_EQ(r.json["divergence"]["seq"], 2);
  EXPECT_NE(r.text.find("rank 0: enqueued it; the device has not finished it"), std::string::npos) << r.text;
}

// Records asked for with SIGUSR1 while the run went on: an operation open on the ranks that
// entered it for less than dist.timeout_s is in flight, not a hang; past it, or after a failure,
// the same records read as before.
TEST(Doctor, ASnapshotOfALiveRunIsInFlightNotAHang) {
  auto snapshot = [](int64_t rank, std::vector<json> ops, double dumped_ms, const std::string& reason) {
    json j = dump(rank, 2, std::move(ops), "backward");
    j["events"] = {{{"reason", reason}, {"error", ""}}};
    j["timeout_ms"] = 30000;
    j["dumped_ms"] = dumped_ms;
    return j;
  };
  const json open = op("world", "calls", 2, "all_reduce", {4}, "enqueued", 30);
  const std::string usr1 = "SIGUSR1 (asked where the run is; it goes on)";
  auto r = keel::doctor::diagnose(
      {snapshot(0, with(healthy_prefix(0), open), 2030, usr1), snapshot(1, with(healthy_prefix(1), open), 2040, usr1)});
  EXPECT_EQ(r.json["cause"]["kind"], "in_flight") << r.text;
  EXPECT_NE(r.text.find("open for 2.0 s, under dist.timeout_s = 30.0 s"), std::string::npos) << r.text;
  r = keel::doctor::diagnose(
      {snapshot(0, with(healthy_prefix(0), open), 2030, usr1), snapshot(1, healthy_prefix(1), 2040, usr1)});
  EXPECT_EQ(r.json["cause"]["kind"], "in_flight") << r.text;
  EXPECT_NE(r.text.find("rank(s) 1 not there yet"), std::string::npos) << r.text;
  // Rank 1's device finished #2 sooner (its result came before its snapshot): still in flight.
  r = keel::doctor::diagnose(
      {snapshot(0, with(healthy_prefix(0), open), 2030, usr1),
       snapshot(1, with(healthy_prefix(1), op("world", "calls", 2, "all_reduce", {4}, "completed", 30)), 2040, usr1)});
  EXPECT_EQ(r.json["cause"]["kind"], "in_flight") << r.text;
  // Rank 1 not there for 10 s: a hang, said with how long it has been open (it may still move).
  r = keel::doctor::diagnose(
      {snapshot(0, with(healthy_prefix(0), open), 10030, usr1), snapshot(1, healthy_prefix(1), 10040, usr1)});
  EXPECT_EQ(r.json["cause"]["kind"], "hang") << r.text;
  EXPECT_EQ(r.json["cause"]["open_for_ms"], 10000.0) << r.text;
  EXPECT_NE(r.text.find("open for 10.0 s, under dist.timeout_s = 30.0 s: ask again"), std::string::npos) << r.text;
  // Open past dist.timeout_s: a hang (rank 1 never entered it and waits in nothing).
  r = keel::doctor::diagnose(
      {snapshot(0, with(healthy_prefix(0), open), 40030, usr1), snapshot(1, healthy_prefix(1), 40040, usr1)});
  EXPECT_EQ(r.json["cause"]["kind"], "hang") << r.text;
  // Every rank in it past the timeout: the network; a failure event in a record: not a snapshot.
  r = keel::doctor::diagnose({snapshot(0, with(healthy_prefix(0), open), 40030, usr1),
                              snapshot(1, with(healthy_prefix(1), open), 40040, usr1)});
  EXPECT_EQ(r.json["cause"]["kind"], "network") << r.text;
  r = keel::doctor::diagnose({snapshot(0, with(healthy_prefix(0), open), 2030, "stuck: world all_reduce #2"),
                              snapshot(1, with(healthy_prefix(1), open), 2040, usr1)});
  EXPECT_EQ(r.json["cause"]["kind"], "network") << r.text;
  // Rank 1 answered a SIGUSR1 at 25 ms, before rank 0 entered #2 (30 ms), and wrote nothing after;
  // rank 0's record says #2 timed out: rank 1 died after its snapshot.
  r = keel::doctor::diagnose(
      {snapshot(0, with(healthy_prefix(0), op("world", "calls", 2, "all_reduce", {4}, "timed out", 30)), 40030,
                "collective timed out (world all_reduce #2)"),
       snapshot(1, healthy_prefix(1), 25, usr1)});
  EXPECT_EQ(r.json["cause"]["kind"], "dead_rank") << r.text;
  EXPECT_EQ(r.json["cause"]["ranks"], json({1}));
  EXPECT_NE(r.text.find("only a SIGUSR1 snapshot from 1"), std::string::npos) << r.text;
}

TEST(Doctor, ShowsBothSidesOfAMismatchAnExtraEvaluationAndASkippedCollective) {
  auto r = keel::doctor::diagnose(
      {dump(0, 2, with(healthy_prefix(0), op("world", "calls", 2, "all_reduce", {4}, "mismatch", 30))),
       dump(1, 2, with(healthy_prefix(1), op("world", "calls", 2, "all_reduce", {5}, "mismatch", 30)))});
  EXPECT_EQ(r.json["cause"]["kind"], "shape_mismatch") << r.text;
  EXPECT_NE(r.text.find("[4]"), std::string::npos);
  EXPECT_NE(r.text.find("[5]"), std::string::npos);
  // Rank 0 still evaluates (an all-reduce of totals) where rank 1 is at the next step's consensus.
  r = keel::doctor::diagnose(
      {dump(0, 2, with(healthy_prefix(0), op("world", "calls", 2, "all_reduce", {4}, "mismatch", 30, "eval"))),
       dump(1, 2, with(healthy_prefix(1), op("world", "calls", 2, "step_sync", {9}, "mismatch", 30, "consensus")))});
  EXPECT_EQ(r.json["cause"]["kind"], "extra_evaluation") << r.text;
  EXPECT_NE(r.json["cause"]["text"].get<std::string>().find("Rank 0 was still evaluating"), std::string::npos);
  // Rank 1 never made bucket #0 but went on to the consensus after rank 0 entered it.
  r = keel::doctor::diagnose(
      {dump(0, 2, with(healthy_prefix(0), op("world", "bucket", 0, "all_reduce", {100}, "timed out", 30, "backward"))),
       dump(1, 2, with(healthy_prefix(1), op("world", "calls", 2, "step_sync", {9}, "failed", 40, "consensus")))});
  EXPECT_EQ(r.json["cause"]["kind"], "skipped") << r.text;
  EXPECT_EQ(r.json["cause"]["ranks"], json({1}));
}

// Dumps from two hosts, copied into one folder in sub-folders of their own (and an earlier run's,
// set aside under previous/, ignored).
TEST(Doctor, ReadsDumpsOfSeveralHostsCopiedIntoOneFolder) {
  TempDir d;
  std::filesystem::create_directories(d.file("host-a/flight/previous"));
  std::filesystem::create_directories(d.file("host-b/flight"));
  std::ofstream(d.file("host-a/flight/rank0.json"))
      << dump(0, 2, with(healthy_prefix(0), op("world", "calls", 2, "all_gather", {9}, "timed out", 30))).dump();
  std::ofstream(d.file("host-b/flight/rank1.json")) << dump(1, 2, healthy_prefix(1), "optimizer").dump();
  std::ofstream(d.file("host-a/flight/previous/rank1.json")) << dump(1, 2, {}).dump();
  const auto r = keel::doctor::diagnose_dir(d.path());
  EXPECT_EQ(r.json["records"], json({0, 1}));
  EXPECT_EQ(r.json["cause"]["kind"], "hang") << r.text;
  EXPECT_THROW(keel::doctor::diagnose_dir(d.file("host-b/flight/previous")), keel::InputError);
  const ProcResult none = run_keel({"doctor", d.file("nothing-here")});
  EXPECT_EQ(none.exit_code, 2) << none.output;
}

// A record cut short or of another shape (keys missing, ops not objects) is read, not a crash.
TEST(Doctor, ADumpWithoutItsKeysIsReadWithoutCrashing) {
  json partial = {{"rank", 1}, {"world_size", 2}, {"ops", {42, {{"seq", 0}}}}, {"groups", 7}};
  const auto r = keel::doctor::diagnose({json{{"rank", 0}, {"world_size", 2}}, partial});
  EXPECT_EQ(r.json["records"], json({0, 1})) << r.text;
  EXPECT_TRUE(r.json.contains("cause")) << r.text;
}

TEST(FaultPlan, AtNamesAPhaseForHangCrashAndStragglerOnly) {
  keel::FaultPlan p({"collective_hang@step=3,rank=1,at=checkpoint_commit", "crash@step=2,rank=0"}, 2);
  EXPECT_EQ(p.entries()[0].at, Phase::CheckpointCommit);
  EXPECT_TRUE(p.strikes_at_phases());
  EXPECT_EQ(p.find(keel::FaultType::CollectiveHang, 3, 1, 0), nullptr);  // not before the consensus
  EXPECT_NE(p.at_phase(keel::FaultType::CollectiveHang, Phase::CheckpointCommit, 3, 1, 0), nullptr);
  EXPECT_NE(p.find(keel::FaultType::Crash, 2, 0, 0), nullptr);
  EXPECT_THROW(keel::FaultPlan({"oom@step=3,rank=1,at=forward"}, 2), keel::InputError);
  EXPECT_THROW(keel::FaultPlan({"crash@step=3,rank=1,at=lunch"}, 2), keel::InputError);
}

// ---- real runs: each fault type at several phases, read by `keel doctor --json` -------------

std::vector<std::string> flight_args(const std::string& dir, std::vector<std::string> extra) {
  std::vector<std::string> a = {"train",
                                "--model.name=mlp",
                                "--data.name=synthetic",
                                "--train.steps=8",
                                "--train.batch_size=16",
                                "--run.threads=1",
                                "--run.dir=" + dir + "/run",
                                "--dist.timeout_s=5"};
  a.insert(a.end(), extra.begin(), extra.end());
  return a;
}

json doctor_of(const std::string& run_dir) {
  const ProcResult r = run_keel({"doctor", run_dir, "--json"});
  EXPECT_EQ(r.exit_code, 0) << r.output;
  const auto brace = r.output.find('{');
  return brace == std::string::npos ? json() : json::parse(r.output.substr(brace));
}

// The divergence's row for `rank`.
json row_of(const json& diag, int64_t rank) {
  for (const auto& row : diag["divergence"]["ranks"])
    if (row["rank"] == rank) return row;
  return json();
}

struct Case {
  std::vector<std::string> args;
  std::string cause;  // cause.kind
  int64_t rank;       // the rank the cause names
  std::string op;     // the collective (op text) the waiting rank 0 was in
  std::string where;  // ... in which phase (a prefix of its `where`)
};

void diagnose_case(const Case& c) {
  TempDir d;
  const auto ranks = run_keel_ranks(2, flight_args(d.path(), c.args), 120);
  for (const auto& r : ranks) EXPECT_FALSE(r.timed_out) << r.output;
  EXPECT_NE(ranks[0].exit_code, 0) << ranks[0].output;
  const json diag = doctor_of(d.file("run"));
  ASSERT_TRUE(diag.contains("cause")) << diag.dump(2);
  EXPECT_EQ(diag["cause"]["kind"], c.cause) << diag.dump(2);
  EXPECT_EQ(diag["cause"]["ranks"], json({c.rank})) << diag.dump(2);
  const json waiting = row_of(diag, 0);
  EXPECT_NE(waiting.value("op", std::string()).find(c.op), std::string::npos) << diag.dump(2);
  EXPECT_EQ(waiting.value("where", std::string()).rfind(c.where, 0), 0u) << diag.dump(2);
}

TEST(FlightDoctor, CollectiveHangInTheBackwardIsNamedAtItsGradientBucket) {
  diagnose_case({{"--fault.inject=collective_hang@step=3,rank=1,at=backward"},
                 "hang",
                 1,
                 "(DDP gradient bucket)",
                 "backward, gradient bucket 0"});
}

TEST(FlightDoctor, CollectiveHangInTheForwardUnderZero3IsNamedAtItsSchedule) {
  diagnose_case(
      {{"--dist.zero=3", "--fault.inject=collective_hang@step=3,rank=1,at=forward"}, "hang", 1, "ZeRO", "forward"});
}

TEST(FlightDoctor, AStragglerInATensorParallelForwardIsNamedAtItsRegion) {
  diagnose_case(
      {{"--model.name=gpt", "--model.width=32", "--model.depth=2", "--model.heads=4", "--model.context=16",
        "--train.batch_size=4", "--parallel.tp=2", "--fault.inject=straggler@step=3,rank=1,at=forward,ms=8000"},
       "straggler",
       1,
       "(tp: row-parallel partial sums)",
       "forward"});
}

// A pipeline stage that stops in its backward: its neighbour waits for the gradient message.
TEST(FlightDoctor, AHungPipelineStageIsNamedAtTheMessageItsNeighbourWaitedFor) {
  diagnose_case({{"--model.name=gpt", "--model.width=32", "--model.depth=4", "--model.heads=4", "--model.context=16",
                  "--train.batch_size=4", "--train.grad_accum=4", "--parallel.pp=2",
                  "--fault.inject=collective_hang@step=3,rank=1,at=backward"},
                 "hang",
                 1,
                 "(pipeline gradient)",
                 "backward (stage 0"});
}

TEST(FlightDoctor, CollectiveHangAtEvaluationAndAtACheckpointCommit) {
  diagnose_case({{"--train.eval_interval=3", "--fault.inject=collective_hang@step=3,rank=1,at=eval"},
                 "hang",
                 1,
                 "(evaluation totals)",
                 "eval"});
  TempDir ck;
  diagnose_case({{"--checkpoint.dir=" + ck.path(), "--checkpoint.interval=3",
                  "--fault.inject=collective_hang@step=3,rank=1,at=checkpoint_commit"},
                 "hang",
                 1,
                 "(checkpoint commit)",
                 "checkpoint commit"});
}

TEST(FlightDoctor, ACrashedRankIsNamedDeadAndAShapeMismatchShowsBothShapes) {
  diagnose_case({{"--fault.inject=crash@step=3,rank=1,at=forward"}, "dead_rank", 1, "", ""});
  TempDir d;
  const auto ranks = run_keel_ranks(2, flight_args(d.path(), {"--fault.inject=shape_mismatch@step=3,rank=1"}), 120);
  for (const auto& r : ranks) EXPECT_EQ(r.exit_code, 1) << r.output;
  const json diag = doctor_of(d.file("run"));
  EXPECT_EQ(diag["cause"]["kind"], "shape_mismatch") << diag.dump(2);
  EXPECT_NE(row_of(diag, 0).value("op", std::string()).find("[4]"), std::string::npos) << diag.dump(2);
  EXPECT_NE(row_of(diag, 1).value("op", std::string()).find("[5]"), std::string::npos) << diag.dump(2);
}

TEST(FlightDoctor, AStragglerPastTheTimeoutIsNamedWithItsLateness) {
  diagnose_case({{"--fault.inject=straggler@step=3,rank=1,at=forward,ms=8000"},
                 "straggler",
                 1,
                 "(DDP gradient bucket)",
                 "backward"});
}

// SIGUSR1 on a live run: rank 1 writes where it is and the run goes on, every rank exiting 0
// with the losses of the same run without it, bit for bit.
TEST(FlightDoctor, Sigusr1DumpsALiveRunWhichFinishesWithUnchangedLosses) {
  TempDir d, plain;
  expect_all_ok(run_keel_ranks(2, flight_args(d.path(), {"--fault.inject=signal@step=3,rank=1,sig=10"}), 120));
  expect_all_ok(run_keel_ranks(2, flight_args(plain.path(), {}), 120));
  EXPECT_EQ(metrics_losses(d.file("run")), metrics_losses(plain.file("run")));
  ASSERT_TRUE(std::filesystem::exists(d.file("run/flight/rank1.json")));
  EXPECT_FALSE(std::filesystem::exists(d.file("run/flight/rank0.json")));  // a healthy rank writes nothing
  EXPECT_FALSE(std::filesystem::exists(plain.file("run/flight")));
  const json j = read_json(d.file("run/flight/rank1.json"));
  EXPECT_EQ(j["events"][0]["reason"].get<std::string>().rfind("SIGUSR1", 0), 0u) << j["events"].dump();
  ASSERT_FALSE(j["ops"].empty());
  EXPECT_EQ(j["ops"][0]["state"], "completed");  // (the last may be in flight as it is written)
  EXPECT_EQ(j["world_size"], 2);
}

}  // namespace
