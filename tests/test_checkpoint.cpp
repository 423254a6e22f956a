// checkpoint/: the safetensors reader and writer, the commit protocol, resume (bit-exact, after
// SIGKILL under torchrun, at another world size, past a corrupt step), save failures on one
// rank, SIGTERM's final save, `keel inspect`, and the Python reader written from the spec.
#include <gtest/gtest.h>

#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <thread>

#include "checkpoint/checkpointer.h"
#include "checkpoint/inspect.h"
#include "checkpoint/meta.h"
#include "helpers.h"
#include "keel/dist/collectives.h"
#include "keel/dist/process_group.h"
#include "keel/models/model.h"
#include "keel/trainer/trainer.h"
#include "multirank.h"
#include "trainer/optim.h"

#include <torch/script.h>

using namespace keel::checkpoint;
using namespace keel::testing;

namespace {

std::shared_ptr<keel::dist::Collectives> local_collectives() {
  keel::dist::World w;
  auto g = keel::dist::Group::create(w, keel::DistConfig{}, torch::kCPU);
  return std::make_shared<keel::dist::Collectives>(g, keel::Validate::Always);
}

std::string le64(uint64_t n) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return s;
}

// A file of header `json` followed by `data_bytes` zero bytes.
std::string st_file(const std::string& json, size_t data_bytes) {
  return le64(json.size()) + json + std::string(data_bytes, '\0');
}

std::string parse_error(const std::string& bytes) {
  try {
    parse_safetensors_header(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), bytes.size(), "f");
  } catch (const FormatError& e) {
    return e.what();
  }
  return "";
}

// The message of the E that `f` throws ("" when it throws none).
template <class E = std::exception, class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  }
  return "";
}

TEST(Safetensors, RoundTripsEveryDtypeBitExactly) {
  TempDir d;
  NamedTensors ts = {
      {"f32", torch::randn({3, 4})},
      {"f64", torch::randn({2}, torch::kDouble)},
      {"bf16", torch::randn({5, 1}).to(torch::kBFloat16)},
      {"f16", torch::randn({7}).to(torch::kHalf)},
      {"i64", torch::arange(10, torch::kLong)},
      {"i32", torch::arange(6, torch::kInt).reshape({2, 3})},
      {"i16", torch::arange(4, torch::kShort)},
      {"i8", torch::arange(-3, 3, torch::kChar)},
      {"u8", torch::arange(9, torch::kByte)},
      {"bool", torch::tensor({true, false, true})},
      {"scalar", torch::tensor(42, torch::kLong)},
      {"empty", torch::zeros({0, 3})},
      {"strided", torch::randn({4, 6}).t()},  // non-contiguous: written row-major
  };
  const auto written = write_safetensors(d.file("a.safetensors"), ts, {{"k", "v"}});
  EXPECT_EQ(written.sha256, sha256_file(d.file("a.safetensors")));
  auto f = read_safetensors(d.file("a.safetensors"), written.sha256);
  EXPECT_EQ(f.header.data_start % 8, 0u);
  EXPECT_EQ(f.header.metadata.at("k"), "v");
  ASSERT_EQ(f.tensors.size(), ts.size());
  std::map<std::string, torch::Tensor> got(f.tensors.begin(), f.tensors.end());
  for (const auto& [n, t] : ts) {
    ASSERT_TRUE(got.count(n)) << n;
    EXPECT_EQ(got[n].scalar_type(), t.scalar_type()) << n;
    EXPECT_EQ(got[n].sizes(), t.sizes()) << n;
    EXPECT_TRUE(torch::equal(got[n], t)) << n;
  }
}

TEST(Safetensors, ChecksumMismatchNamesTheFile) {
  TempDir d;
  auto w = write_safetensors(d.file("a.safetensors"), {{"x", torch::ones({64})}});
  flip_byte(d.file("a.safetensors"), 3);
  const std::string e = error_of<FormatError>([&] { read_safetensors(d.file("a.safetensors"), w.sha256); });
  EXPECT_NE(e.find(d.file("a.safetensors")), std::string::npos) << e;
  EXPECT_NE(e.find("checksum mismatch"), std::string::npos) << e;
}

TEST(SafetensorsHeader, RefusesEveryKindOfBadHeader) {
  const std::string ok = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  EXPECT_EQ(parse_error(st_file(ok, 8)), "");
  struct Case {
    std::string bytes, expect;
  } cases[] = {
      {"abc", "shorter than the 8-byte"},
      {le64(200ull << 20) + "{}", "exceeds the 100 MB limit"},
      {le64(50) + "{}", "runs past the end"},
      {st_file("[1,2]", 0), "does not start with '{'"},
      {st_file("{\"a\":", 0), "not valid UTF-8 JSON"},
      {st_file("{\"\xff\xfe\":1}", 0), "not valid UTF-8 JSON"},
      {st_file(R"({"a":{"dtype":"Q7","shape":[2],"data_offsets":[0,8]}})", 8), "unknown dtype"},
      {st_file(R"({"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", 8), "not a non-negative integer"},
      {st_file(R"({"a":{"dtype":"F32","shape":[2.5],"data_offsets":[0,8]}})", 8), "not a non-negative integer"},
      {st_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})", 8), "begin 8 > end 0"},
      {st_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,16]}})", 8), "out of range or truncated"},
      {st_file(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8), "offsets hold 8"},
      {st_file(R"({"a":{"dtype":"F32","shape":[4611686018427387904,4],"data_offsets":[0,8]}})", 8), "overflows"},
      {st_file(
           R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
           12),
       "overlaps"},
      {st_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", 8), "a hole"},
      {st_file(ok, 12), "trailing bytes"},
      {st_file(R"({"__metadata__":{"k":1}})", 0), "is not a string"},
      {st_file(R"({"a":{"dtype":"F32","shape":[2]}})", 8), "data_offsets"},
      {st_file(R"({"a":7})", 0), "is not an object"},
  };
  for (const auto& c : cases) {
    const std::string e = parse_error(c.bytes);
    EXPECT_NE(e.find(c.expect), std::string::npos) << "expected \"" << c.expect << "\", got \"" << e << "\"";
  }
}

// The libFuzzer corpus (tests/fuzz/corpus, grown by scripts/fuzz.sh) replayed: every input is
// either accepted or refused with FormatError; nothing crashes.
TEST(SafetensorsHeader, FuzzCorpusReplaysWithoutCrashing) {
  const std::string dir = source_path("tests/fuzz/corpus");
  int n = 0, refused = 0;
  for (const auto& name : list_dir(dir)) {
    const std::string bytes = read_text(dir + "/" + name);
    ++n;
    if (!parse_error(bytes).empty()) ++refused;
  }
  EXPECT_GE(n, 10) << "corpus missing: " << dir;
  EXPECT_GT(refused, 0);
  EXPECT_LT(refused, n);  // the corpus has valid headers too
}

// The meta.json / index fuzz corpus (scripts/fuzz.sh) replayed through the same checks: only
// FormatError, never another exception; valid and invalid seeds both present.
TEST(CheckpointMeta, FuzzCorpusReplaysWithoutCrashing) {
  const std::string dir = source_path("tests/fuzz/corpus_meta");
  int n = 0, metas = 0, indexes = 0;
  for (const auto& name : list_dir(dir)) {
    const std::string text = read_text(dir + "/" + name);
    ++n;
    try {
      parse_meta(text, name, "step_5");
      ++metas;
    } catch (const FormatError&) {
    }
    try {
      parse_index(text, name, {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"});
      ++indexes;
    } catch (const FormatError&) {
    }
  }
  EXPECT_GE(n, 8) << "corpus missing: " << dir;
  EXPECT_GE(metas, 1);
  EXPECT_GE(indexes, 1);
  EXPECT_LT(metas + indexes, n);  // refused inputs too
}

TEST(AssignShards, BalancesBytesAcrossRanks) {
  const auto owner = assign_shards({100, 60, 50, 40, 10, 10}, 2);
  uint64_t load[2] = {0, 0};
  const uint64_t sizes[] = {100, 60, 50, 40, 10, 10};
  for (size_t i = 0; i < owner.size(); ++i) load[owner[i]] += sizes[i];
  EXPECT_EQ(load[0], 140u);  // 100 + 40 (largest first to the lighter rank)
  EXPECT_EQ(load[1], 130u);  // 60 + 50 + 10 + 10
  EXPECT_EQ(assign_shards({5, 5}, 1), (std::vector<int64_t>{0, 0}));
}

State small_state(float v) {
  State s;
  s["model"].add("w", torch::full({4, 3}, v));
  s["model"].add("b", torch::arange(3, torch::kFloat));
  s["optimizer"].add("w.exp_avg", torch::full({4, 3}, v / 2));
  s["optimizer"].add("w.step", torch::tensor(7, torch::kLong));
  s["progress"].values = {{"step", 1}, {"note", "x"}};
  s["rng"].add("rng.cpu", torch::arange(5, torch::kByte), Placement::PerRank);
  s["sampler"].rank_values = {{"sampler", {{"epoch", 1}, {"batch", 2}}}};
  return s;
}

std::map<std::string, torch::Tensor> tensors_of(const Loaded& L, const std::string& component) {
  const auto t = L.component(component).tensors;
  return {t.begin(), t.end()};
}

TEST(Checkpointer, SavesCommitsAndLoadsEverything) {
  TempDir d;
  Options o;
  o.dir = d.file("ck");
  Checkpointer c(o, local_collectives());
  c.save(5, small_state(1.5f));
  EXPECT_EQ(c.last_committed(), 5);
  for (const char* f : {"meta.json", "model.safetensors.index.json", "model-00001-of-00001.safetensors",
                        "optimizer-00001-of-00001.safetensors", "rank-00000.safetensors"})
    EXPECT_TRUE(exists(d.file(std::string("ck/step_5/") + f))) << f;
  auto index = nlohmann::json::parse(read_text(d.file("ck/step_5/model.safetensors.index.json")));
  EXPECT_EQ(index["weight_map"]["w"], "model-00001-of-00001.safetensors");
  EXPECT_EQ(index["metadata"]["total_size"], 4 * 3 * 4 + 3 * 4);
  EXPECT_TRUE(verify_step(d.file("ck/step_5")).empty());

  Checkpointer c2(o, local_collectives());
  auto L = c2.load();
  ASSERT_TRUE(L.has_value());
  EXPECT_EQ(L->step, 5);
  EXPECT_EQ(L->saved_world_size, 1);
  EXPECT_EQ(L->format_version, 2);
  EXPECT_TRUE(torch::equal(tensors_of(*L, "model")["w"], torch::full({4, 3}, 1.5f)));
  EXPECT_EQ(tensors_of(*L, "optimizer")["w.step"].item<int64_t>(), 7);
  EXPECT_EQ(L->component("optimizer").index.at("w.exp_avg"), "optimizer-00001-of-00001.safetensors");
  EXPECT_EQ(L->component("optimizer").shapes.at("w.exp_avg").shape, (std::vector<int64_t>{4, 3}));
  EXPECT_EQ(L->component("progress").values["note"], "x");
  EXPECT_TRUE(L->component("progress").tensors.empty());
  const auto rng = L->component("rng");
  ASSERT_EQ(rng.rank_tensors.size(), 1u);
  EXPECT_EQ(rng.rank_tensors[0].first, "rng.cpu");  // stored as rank.0.rng.rng.cpu
  EXPECT_EQ(L->component("sampler").rank_values["sampler"]["batch"], 2);
  EXPECT_FALSE(L->component("absent").present);
  // Each component's values in meta.json; no component knows another's.
  const auto meta = nlohmann::json::parse(read_text(d.file("ck/step_5/meta.json")));
  EXPECT_EQ(meta["components"]["progress"]["values"]["note"], "x");
  EXPECT_EQ(meta["components"]["model"]["tensors"]["w"]["dtype"], "F32");
  EXPECT_FALSE(meta.contains("state"));
}

// The trainer turns ResumeError into exit 2 (the user's checkpoint.resume_from) and lets every
// other failure exit 1: a peer that dies while the checkpoint is being loaded is a
// CollectiveError, never bad input.
TEST(CheckpointResume, BadResumeFromIsInputAPeerDyingDuringLoadIsNot) {
  TempDir d;
  Options o;
  o.dir = d.file("ck");
  Checkpointer c(o, local_collectives());
  c.save(5, small_state(1.0f));
  EXPECT_THROW(c.load("7"), ResumeError);
  EXPECT_THROW(c.load("99999999999999999999"), ResumeError);  // was: "error: stoll", exit 1
  EXPECT_THROW(c.load(d.file("nowhere")), ResumeError);

  const std::string dir = d.file("ck2");
  auto ranks = run_ranks(2, [&](const keel::dist::World& w) {
    keel::DistConfig cfg;
    cfg.timeout_s = 10;
    auto coll = std::make_shared<keel::dist::Collectives>(keel::dist::Group::create(w, cfg, torch::kCPU),
                                                          keel::Validate::Always);
    Options o2;
    o2.dir = dir;
    Checkpointer ck(o2, coll);
    ck.save(5, small_state(2.0f));
    if (w.rank == 1) return;  // rank 1 is gone before the load
    try {
      ck.load();
      ADD_FAILURE() << "load() succeeded without rank 1";
    } catch (const ResumeError& e) {
      ADD_FAILURE() << "a dead peer was reported as the user's input: " << e.what();
    } catch (const keel::dist::CollectiveError& e) {
      EXPECT_NE(std::string(e.what()).find("checkpoint load verdict"), std::string::npos) << e.what();
    }
  });
  if (is_rank_process()) return;
  for (auto& r : ranks) EXPECT_EQ(r.exit_code, 0) << r.output;
}

// Owned tensors across ranks: each rank writes its own, the component's index and meta.json
// record every rank's, and a rank that wants only its own reads only its own rank's file. A
// problem that one rank's state alone has (an owned tensor safetensors cannot hold; two ranks
// owning one name) fails the save on every rank with the same message, before any file is
// written, instead of leaving the other rank in the plan's collectives until the timeout.
TEST(Checkpointer, OwnedTensorsAreWrittenByTheirOwnerAndReadWhereWanted) {
  TempDir d;  // the parent's: each rank process makes its own, so the ranks take it from the env
  auto ranks = run_ranks(
      2,
      [&](const keel::dist::World& w) {
        const std::string dir = std::string(std::getenv("KEEL_TEST_CKPT")) + "/ck";
        keel::DistConfig cfg;
        cfg.timeout_s = 60;
        auto coll = std::make_shared<keel::dist::Collectives>(keel::dist::Group::create(w, cfg, torch::kCPU),
                                                              keel::Validate::Always);
        const std::string mine = "part" + std::to_string(w.rank);
        auto state = [&](const std::string& owned_name, torch::Tensor owned) {
          State s = small_state(1.f);
          s["optimizer"].add(owned_name, owned, Placement::Owned);
          return s;
        };
        Options o;
        o.dir = dir;
        Checkpointer ck(o, coll);
        const std::string complex = error_of<SaveError>([&] {
          ck.save(4, state(mine, w.rank == 1 ? torch::zeros({2}, torch::kComplexFloat) : torch::zeros({2})));
        });
        EXPECT_NE(complex.find("rank 1: component optimizer: tensor \"part1\""), std::string::npos) << complex;
        const std::string twice = error_of<SaveError>([&] { ck.save(4, state("shared.name", torch::zeros({2}))); });
        EXPECT_NE(twice.find("\"shared.name\" is owned by rank 1 and also placed in optimizer-00001-of-00002"),
                  std::string::npos)
            << twice;
        EXPECT_FALSE(exists(dir + "/step_4"));
        ck.save(5, state(mine, torch::full({3}, float(w.rank))));
        const auto index = nlohmann::json::parse(read_text(dir + "/step_5/optimizer.safetensors.index.json"));
        EXPECT_EQ(index["weight_map"]["part1"], "optimizer-00002-of-00002.safetensors");
        const auto meta = nlohmann::json::parse(read_text(dir + "/step_5/meta.json"));
        EXPECT_EQ(meta["components"]["optimizer"]["owned"], (nlohmann::json{"part0", "part1"}));
        Options only_mine = o;
        only_mine.wants = [&](const std::string& c, const std::string& n) { return c != "optimizer" || n == mine; };
        auto L = Checkpointer(only_mine, coll).load();
        ASSERT_TRUE(L.has_value());
        const auto opt = L->component("optimizer");
        ASSERT_EQ(opt.tensors.size(), 1u);
        EXPECT_EQ(opt.tensors[0].first, mine);
        EXPECT_TRUE(torch::equal(opt.tensors[0].second, torch::full({3}, float(w.rank))));
        EXPECT_EQ(opt.index.size(), 4u);              // every rank's, and the replicated two
        EXPECT_EQ(L->files_read.at("optimizer"), 1);  // the file holding its own, not the other rank's
      },
      120, {"KEEL_TEST_CKPT=" + d.path()});
  if (is_rank_process()) return;
  for (auto& r : ranks) EXPECT_EQ(r.exit_code, 0) << r.output;
}

// Hardening class 6: a step directory that is a symbolic link is not this checkpoint's: it is
// never loaded and keep-rotation never deletes through it (it used to remove the linked
// step's meta.json).
TEST(Checkpointer, LinkedStepsAreNeitherLoadedNorRotated) {
  TempDir d;
  Options other;
  other.dir = d.file("elsewhere");
  Checkpointer(other, local_collectives()).save(99, small_state(9.f));
  Options o;
  o.dir = d.file("ck");
  o.keep = 2;
  Checkpointer c(o, local_collectives());
  c.save(1, small_state(1.f));
  ASSERT_EQ(::symlink(d.file("elsewhere/step_99").c_str(), d.file("ck/step_99").c_str()), 0);
  EXPECT_EQ(c.load()->step, 1);  // not the linked step 99
  for (int64_t s = 2; s <= 5; ++s) c.save(s, small_state(float(s)));
  EXPECT_TRUE(exists(d.file("elsewhere/step_99/meta.json")));
  EXPECT_TRUE(verify_step(d.file("elsewhere/step_99")).empty());
  EXPECT_FALSE(exists(d.file("ck/step_1")));  // rotation still removes the real old steps
  EXPECT_TRUE(exists(d.file("ck/step_5/meta.json")));
}

TEST(Checkpointer, KeepsTheNewestStepsAndRemovesUncommittedOnes) {
  TempDir d;
  Options o;
  o.dir = d.file("ck");
  o.keep = 2;
  Checkpointer c(o, local_collectives());
  ::mkdir(d.file("ck/step_3").c_str(), 0755);  // a save that died before its commit
  write_text(d.file("ck/step_3/model-00001-of-00001.safetensors"), "half");
  for (int s : {2, 4, 6}) c.save(s, small_state(float(s)));
  auto steps = list_steps(d.file("ck"));
  ASSERT_EQ(steps.size(), 2u);
  EXPECT_EQ(steps[0].step, 4);
  EXPECT_EQ(steps[1].step, 6);
}

TEST(Checkpointer, UncommittedNewerStepIsNeverLoaded) {
  TempDir d;
  Options o;
  o.dir = d.file("ck");
  {
    Checkpointer c(o, local_collectives());
    c.save(4, small_state(4.f));
    c.save(8, small_state(8.f));
  }
  std::remove(d.file("ck/step_8/meta.json").c_str());  // as if the commit never happened
  Checkpointer c(o, local_collectives());
  auto L = c.load();
  ASSERT_TRUE(L.has_value());
  EXPECT_EQ(L->step, 4);
}

TEST(Checkpointer, CorruptOrTruncatedNewestStepFallsBackToThePrevious) {
  for (bool truncate : {false, true}) {
    TempDir d;
    Options o;
    o.dir = d.file("ck");
    {
      Checkpointer c(o, local_collectives());
      c.save(4, small_state(4.f));
      c.save(8, small_state(8.f));
    }
    const std::string shard = d.file("ck/step_8/optimizer-00001-of-00001.safetensors");
    if (truncate)
      ASSERT_EQ(::truncate(shard.c_str(), 20), 0);
    else
      flip_byte(shard, 2);
    EXPECT_FALSE(verify_step(d.file("ck/step_8")).empty());
    Checkpointer c(o, local_collectives());
    auto L = c.load();
    ASSERT_TRUE(L.has_value());
    EXPECT_EQ(L->step, 4) << (truncate ? "truncated" : "flipped");
    // An explicit resume_from of the bad step is an error naming the file.
    const std::string e = error_of<std::runtime_error>([&] { c.load("8"); });
    EXPECT_NE(e.find("optimizer-00001-of-00001.safetensors"), std::string::npos) << e;
  }
}

TEST(Checkpointer, IndexEntriesOutsideTheDirectoryAreRefused) {
  TempDir d;
  Options o;
  o.dir = d.file("ck");
  {
    Checkpointer c(o, local_collectives());
    c.save(4, small_state(4.f));
  }
  // Point the index outside and re-sign it in meta.json, so only the path check can catch it.
  const std::string idx = d.file("ck/step_4/model.safetensors.index.json");
  auto index = nlohmann::json::parse(read_text(idx));
  index["weight_map"]["w"] = "../../etc/passwd";
  write_text(idx, index.dump());
  auto meta = nlohmann::json::parse(read_text(d.file("ck/step_4/meta.json")));
  meta["files"]["model.safetensors.index.json"]["sha256"] = sha256_file(idx);
  meta["files"]["model.safetensors.index.json"]["bytes"] = index.dump().size();
  write_text(d.file("ck/step_4/meta.json"), meta.dump());
  Checkpointer c(o, local_collectives());
  const std::string e = error_of<std::runtime_error>([&] { c.load("step_4"); });
  EXPECT_NE(e.find("points outside the checkpoint directory"), std::string::npos) << e;
}

TEST(Checkpointer, WriteFailureCommitsNothingAndKeepsThePrevious) {
  TempDir d;
  Options o;
  o.dir = d.file("ck");
  // The disk fills up halfway through step 8's model shard (its header is written, its data not).
  o.hooks.before_write = [](int64_t step, const std::string& file, uint64_t offset) {
    return step == 8 && file.rfind("model-", 0) == 0 && offset >= 64 ? ENOSPC : 0;
  };
  Checkpointer c(o, local_collectives());
  c.save(4, small_state(4.f));
  try {
    c.save(8, small_state(8.f));
    FAIL() << "no error";
  } catch (const SaveError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("rank 0"), std::string::npos) << m;
    EXPECT_NE(m.find("model-00001-of-00001.safetensors"), std::string::npos) << m;
    EXPECT_NE(m.find(std::strerror(ENOSPC)), std::string::npos) << m;
    EXPECT_NE(m.find("step 4, is intact"), std::string::npos) << m;
  }
  EXPECT_FALSE(exists(d.file("ck/step_8/meta.json")));
  EXPECT_FALSE(exists(d.file("ck/step_8/model-00001-of-00001.safetensors")));  // only a removed temp file
  Checkpointer c2(o, local_collectives());
  auto L = c2.load();
  ASSERT_TRUE(L.has_value());
  EXPECT_EQ(L->step, 4);
}

TEST(Checkpointer, AsyncSaveCopiesTheStateAndCommitsLater) {
  TempDir d;
  Options o;
  o.dir = d.file("ck");
  o.async = true;
  Checkpointer c(o, local_collectives());
  State s = small_state(1.f);
  c.save(3, s);
  s["model"].tensors[0].tensor.fill_(99.f);  // training goes on and changes the live tensors
  EXPECT_TRUE(c.pending());
  for (int i = 0; i < 500 && !c.write_finished(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  EXPECT_FALSE(exists(d.file("ck/step_3/meta.json")));  // written, not yet committed
  c.commit();
  EXPECT_EQ(c.last_committed(), 3);
  auto L = Checkpointer(o, local_collectives()).load();
  ASSERT_TRUE(L.has_value());
  EXPECT_TRUE(torch::equal(tensors_of(*L, "model")["w"], torch::full({4, 3}, 1.f)));  // the snapshot
}

TEST(CopyInto, ListsMissingUnexpectedAndMismatchedEntries) {
  NamedTensors model = {{"a", torch::zeros({2})}, {"b", torch::zeros({3})}, {"c", torch::zeros({1})}};
  NamedTensors ck = {{"a", torch::ones({2})}, {"b", torch::ones({4})}, {"z", torch::ones({1})}};
  try {
    copy_into(model, ck, "step_9");
    FAIL() << "no error";
  } catch (const BindError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("missing from the checkpoint:\n    c"), std::string::npos) << m;
    EXPECT_NE(m.find("unexpected (not in the model):\n    z"), std::string::npos) << m;
    EXPECT_NE(m.find("b: checkpoint Float[4], model Float[3]"), std::string::npos) << m;
  }
  EXPECT_TRUE(torch::equal(model[0].second, torch::zeros({2})));  // nothing copied on error
  NamedTensors good = {{"a", torch::ones({2})}, {"b", torch::ones({3})}, {"c", torch::ones({1})}};
  copy_into(model, good, "step_9");
  EXPECT_TRUE(torch::equal(model[1].second, torch::ones({3})));
}

// Saving and restoring the optimizer state continues the trajectory bit for bit.
TEST(OptimizerState, RoundTripContinuesBitExactly) {
  for (const std::string kind : {"adamw", "sgd"}) {
    keel::TrainConfig tc;
    tc.optimizer = kind;
    tc.momentum = 0.9;
    torch::manual_seed(1);
    auto w = torch::randn({5, 3}, torch::requires_grad());
    auto b = torch::randn({3}, torch::requires_grad());
    std::vector<std::pair<std::string, torch::Tensor>> named = {{"w", w}, {"b", b}};
    auto opt = keel::make_optimizer(tc, {w, b});
    auto step = [](torch::optim::Optimizer& o, torch::Tensor& w, torch::Tensor& b, int i) {
      o.zero_grad();
      auto x = torch::full({2, 5}, 0.1 * (i + 1));
      (x.matmul(w) + b).pow(2).sum().backward();
      o.step();
    };
    for (int i = 0; i < 3; ++i) step(*opt, w, b, i);
    auto saved = keel::optimizer_state(*opt, named);
    for (auto& [n, t] : saved) t = t.clone();
    auto w2 = w.detach().clone().requires_grad_(true), b2 = b.detach().clone().requires_grad_(true);
    auto opt2 = keel::make_optimizer(tc, {w2, b2});
    keel::load_optimizer_state(*opt2, {{"w", w2}, {"b", b2}}, saved);
    for (int i = 3; i < 6; ++i) {
      step(*opt, w, b, i);
      step(*opt2, w2, b2, i);
    }
    EXPECT_TRUE(torch::equal(w, w2)) << kind;
    EXPECT_TRUE(torch::equal(b, b2)) << kind;
  }
}

// ---- the keel binary ------------------------------------------------------------------------

std::vector<std::string> train_args(const std::string& dir, int steps, int interval) {
  return {"train",
          "--model.name=mlp",
          "--data.name=synthetic",
          "--train.steps=" + std::to_string(steps),
          "--train.batch_size=16",
          "--run.threads=1",
          "--run.dir=" + dir + "/run",
          "--checkpoint.dir=" + dir + "/ckpt",
          "--checkpoint.interval=" + std::to_string(interval),
          "--dist.timeout_s=30"};
}

nlohmann::json summary_of(const std::string& dir) {
  return nlohmann::json::parse(read_text(dir + "/run/summary.json"));
}

// The acceptance of the checkpoint and fault issues: a 2-rank torchrun job whose rank 1 is
// SIGKILLed at step 25, with checkpoints every 10 steps (async) and --max_restarts=2, resumes
// from the last step committed before the kill (20, or 10 under heavy load) and ends with the
// same parameters, optimizer state and losses as a clean run.
void sigkill_resume_case(const std::string& zero) {
  TempDir d;
  auto torchrun = [&](const std::string& sub, std::vector<std::string> extra) {
    auto args = train_args(d.file(sub), 40, 10);
    args.push_back("--dist.zero=" + zero);
    args.insert(args.end(), extra.begin(), extra.end());
    return run_torchrun_keel(2, args, d.file(sub + "/logs"), /*max_restarts=*/2);
  };
  auto clean = torchrun("clean", {});
  ASSERT_EQ(clean.exit_code, 0) << clean.output;
  auto crashed = torchrun("crash", {"--fault.inject=crash@step=25,rank=1", "--checkpoint.async=true"});
  ASSERT_EQ(crashed.exit_code, 0) << crashed.output;
  EXPECT_NE(crashed.output.find("fault injection: crash (SIGKILL) at step 25 on rank 1"), std::string::npos);
  // With async saves, step 20 is committed at the first step boundary after every rank's
  // background write has finished: normally before the kill at step 25, on a heavily loaded
  // machine possibly not, and then step 10 is the newest committed step and resuming from it is
  // right. (Which one cannot be read from the log: torchrun relays each rank's output on its
  // own, so lines of two ranks are not in order.) Either way the end must be bit-identical.
  auto s = summary_of(d.file("crash"));
  EXPECT_TRUE(s["resumed_from_step"] == 10 || s["resumed_from_step"] == 20) << s.dump();
  EXPECT_EQ(s["restart_count"], 1);
  EXPECT_EQ(s["steps"], 40);
  EXPECT_TRUE(summary_of(d.file("clean"))["resumed_from_step"].is_null());
  for (const char* f :
       {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "optimizer-00001-of-00002.safetensors",
        "optimizer-00002-of-00002.safetensors", "rank-00000.safetensors", "rank-00001.safetensors"})
    EXPECT_EQ(sha256_file(d.file(std::string("clean/ckpt/step_40/") + f)),
              sha256_file(d.file(std::string("crash/ckpt/step_40/") + f)))
        << f << " differs";
  const auto a = metrics_losses(d.file("clean/run")), b = metrics_losses(d.file("crash/run"));
  ASSERT_EQ(a.size(), 40u);
  EXPECT_EQ(a, b);  // every step's loss, to the last bit (metrics.jsonl is rewritten past step 20)
}

TEST(CheckpointResume, SigkillUnderTorchrunResumesBitIdentically) { sigkill_resume_case("0"); }
TEST(CheckpointResume, SigkillUnderTorchrunResumesBitIdenticallyWithZero1) { sigkill_resume_case("1"); }
TEST(CheckpointResume, SigkillUnderTorchrunResumesBitIdenticallyWithZero2) { sigkill_resume_case("2"); }
TEST(CheckpointResume, SigkillUnderTorchrunResumesBitIdenticallyWithZero3) { sigkill_resume_case("3"); }

// The loss scaler's state (scale and growth tracker) is part of the checkpoint: with growth
// every 4 clean steps and a skipped step 3, the scale is 32768 after step 3, grows at steps 7,
// 11 and 15; a run resumed from step 10 (tracker at 3) must grow at 11 and 15 like the clean one.
TEST(CheckpointResume, LossScalerStateIsRestored) {
  TempDir d;
  auto args = [&](const std::string& sub, int steps) {
    auto a = train_args(d.file(sub), steps, 5);
    for (const char* x :
         {"--amp.loss_scaling=dynamic", "--amp.growth_interval=4", "--fault.inject=nonfinite_grad@step=3,rank=0"})
      a.push_back(x);
    return a;
  };
  ASSERT_EQ(run_keel(args("clean", 15)).exit_code, 0);
  auto crashing = args("resumed", 15);  // same run, killed at step 12 (the schedule spans 15 steps)
  crashing.push_back("--fault.inject=crash@step=12,rank=0");
  EXPECT_TRUE(run_keel(crashing).signaled);
  auto r = run_keel(args("resumed", 15));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto clean = summary_of(d.file("clean")), resumed = summary_of(d.file("resumed"));
  EXPECT_EQ(resumed["resumed_from_step"], 10);
  EXPECT_EQ(clean["loss_scale"].get<double>(), 262144.0);  // 65536 -> 32768 (step 3) -> x2 at 7, 11, 15
  EXPECT_EQ(resumed["loss_scale"], clean["loss_scale"]);
  EXPECT_EQ(resumed["skipped_steps"], 1);  // counted before the checkpoint, carried over
  EXPECT_EQ(sha256_file(d.file("clean/ckpt/step_15/model-00001-of-00001.safetensors")),
            sha256_file(d.file("resumed/ckpt/step_15/model-00001-of-00001.safetensors")));
}

// Dropout draws from the generators the checkpoint holds (every rank's CPU state, and CUDA's on
// a GPU): a gpt with model.dropout = 0.2, killed at step 12 and resumed from step 10, ends with
// the uninterrupted run's parameters to the last bit; without the restored generator state the
// masks of steps 11-15 would differ.
TEST(CheckpointResume, DropoutResumesBitExactly) {
  TempDir d;
  auto args = [&](const std::string& sub) {
    auto a = train_args(d.file(sub), 15, 5);
    for (const char* x : {"--model.name=gpt", "--model.width=32", "--model.depth=1", "--model.context=16",
                          "--model.vocab=64", "--model.dropout=0.2", "--train.batch_size=4"})
      a.push_back(x);
    return a;
  };
  ASSERT_EQ(run_keel(args("clean")).exit_code, 0);
  auto crashing = args("resumed");
  crashing.push_back("--fault.inject=crash@step=12,rank=0");
  EXPECT_TRUE(run_keel(crashing).signaled);
  auto r = run_keel(args("resumed"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(summary_of(d.file("resumed"))["resumed_from_step"], 10);
  EXPECT_EQ(summary_of(d.file("resumed"))["final_loss"], summary_of(d.file("clean"))["final_loss"]);
  EXPECT_EQ(sha256_file(d.file("clean/ckpt/step_15/model-00001-of-00001.safetensors")),
            sha256_file(d.file("resumed/ckpt/step_15/model-00001-of-00001.safetensors")));
  // ... and the dropout is real: the same run without it ends elsewhere.
  auto plain = train_args(d.file("plain"), 15, 5);
  for (const char* x : {"--model.name=gpt", "--model.width=32", "--model.depth=1", "--model.context=16",
                        "--model.vocab=64", "--model.dropout=0", "--train.batch_size=4"})
    plain.push_back(x);
  ASSERT_EQ(run_keel(plain).exit_code, 0);
  EXPECT_NE(summary_of(d.file("plain"))["final_loss"], summary_of(d.file("clean"))["final_loss"]);
}

// Steps written by keel 0.1 (format_version 1: fixed slots model / optimizer / extra and one
// shared "state" object in meta.json) still load. tests/data/checkpoint_v1 holds two, made by
// keel at 743cfb0 (mlp of width 16, 10 steps of AdamW on the synthetic data, batch 8): one
// rank, and two ranks with dist.zero = 1 (each rank's optimizer partition in its own file).
// Each resumes at step 10 with today's keel, verifies in `keel inspect`, continues to step 15
// and ends with the loss of a run that never stopped; its new steps are format 2.
TEST(CheckpointResume, StepsOfFormatOneStillLoad) {
  struct Case {
    const char* fixture;
    int ranks;
    const char* zero;
  };
  for (const Case c : {Case{"one_rank", 1, "0"}, Case{"two_ranks_zero1", 2, "1"}}) {
    SCOPED_TRACE(c.fixture);
    TempDir d;
    std::filesystem::create_directories(d.file("old"));
    std::filesystem::copy(source_path(std::string("tests/data/checkpoint_v1/") + c.fixture), d.file("old/ckpt"),
                          std::filesystem::copy_options::recursive);
    const auto inspected = run_keel({"inspect", d.file("old/ckpt")});
    EXPECT_EQ(inspected.exit_code, 0) << inspected.output;
    EXPECT_NE(inspected.output.find("component optimizer"), std::string::npos) << inspected.output;
    auto args = [&](const std::string& dir, int steps) {
      auto a = train_args(dir, steps, 5);  // the fixture's batch and width, and its zero
      a.insert(a.end(), {"--train.batch_size=8", "--model.width=16", std::string("--dist.zero=") + c.zero});
      return a;
    };
    auto run = [&](const std::string& dir, int steps) {
      const auto out = c.ranks == 1 ? std::vector<ProcResult>{run_keel(args(dir, steps))}
                                    : run_keel_ranks(c.ranks, args(dir, steps));
      for (const auto& r : out) ASSERT_EQ(r.exit_code, 0) << dir << "\n" << r.output;
    };
    // The old step resumed to 15, against today's keel doing the same from a step of its own
    // (the schedule decays over train.steps = 10 in both first halves).
    run(d.file("old"), 15);
    run(d.file("fresh"), 10);
    run(d.file("fresh"), 15);
    const auto old = summary_of(d.file("old")), fresh = summary_of(d.file("fresh"));
    EXPECT_EQ(old["resumed_from_step"], 10);
    EXPECT_EQ(fresh["resumed_from_step"], 10);
    const double a = old["final_loss"].get<double>(), b = fresh["final_loss"].get<double>();
    EXPECT_LE(std::abs(a - b), 1e-5 * std::abs(b)) << a << " vs " << b;
    const auto meta = nlohmann::json::parse(read_text(d.file("old/ckpt/step_15/meta.json")));
    EXPECT_EQ(meta["format_version"], 2);
  }
}

// Values read back from a checkpoint are never trusted: a meta.json whose fields are out of
// range, of the wrong type or disagree with the step directory (the commit marker is not
// checksummed) is treated like a failed checksum: a warning naming the file and the field, and
// the previous committed step is used.
TEST(CheckpointResume, TamperedMetadataFallsBackNamingTheField) {
  TempDir d;
  auto args = [&](int steps) {
    auto a = train_args(d.path(), steps, 5);
    a.push_back("--amp.loss_scaling=dynamic");  // so that meta.json holds the scaler's state
    return a;
  };
  ASSERT_EQ(run_keel(args(10)).exit_code, 0);
  const std::string meta_path = d.file("ckpt/step_10/meta.json");
  const auto pristine = nlohmann::json::parse(read_text(meta_path));
  struct Case {
    const char* what;
    std::function<void(nlohmann::json&)> tamper;
    const char* says;
  };
  const std::vector<Case> cases = {
      {"negative step", [](nlohmann::json& m) { m["step"] = -5; }, "\"step\" must be an integer in [0"},
      {"step of another directory", [](nlohmann::json& m) { m["step"] = 7; }, "\"step\" is 7 in the directory step_10"},
      {"step as a string", [](nlohmann::json& m) { m["step"] = "ten"; }, "\"step\" must be an integer"},
      {"absurd world size", [](nlohmann::json& m) { m["world_size"] = 1000000000; },
       "\"world_size\" must be an integer"},
      {"another format", [](nlohmann::json& m) { m["format_version"] = 3; }, "format_version"},
      {"loss scale 0", [](nlohmann::json& m) { m["components"]["grad_scaler"]["values"]["scale"] = 0; },
       "grad_scaler: values.scale = 0"},
      {"skipped steps as a string",
       [](nlohmann::json& m) { m["components"]["progress"]["values"]["skipped_steps"] = "x"; },
       "progress: values.skipped_steps"},
      {"negative data position",
       [](nlohmann::json& m) { m["components"]["sampler"]["values"]["data_position"]["batch"] = -1; },
       "sampler: values.data_position.batch = -1"},
      {"an optimizer owner outside the saved world",
       [](nlohmann::json& m) {
         m["components"]["optimizer"]["values"]["owners"] = {{"fc.0.weight", 7}};
       },
       "optimizer: values.owners[\"fc.0.weight\"] must be a rank in [0, 1), got 7"},
      {"a component's values not an object", [](nlohmann::json& m) { m["components"]["optimizer"]["values"] = 3; },
       "components.optimizer.values is not an object"},
      {"a recorded shape not a shape",
       [](nlohmann::json& m) { m["components"]["model"]["tensors"]["fc.0.weight"]["shape"] = {-1}; },
       "components.model.tensors[\"fc.0.weight\"]"},
  };
  for (const auto& c : cases) {
    nlohmann::json m = pristine;
    c.tamper(m);
    write_text(meta_path, m.dump());
    auto a = args(10);  // the same run: resumed from step 5 it saves step 10 again, bit-identical
    const auto r = run_keel(a);
    ASSERT_EQ(r.exit_code, 0) << c.what << "\n" << r.output;
    EXPECT_NE(r.output.find("step_10/meta.json"), std::string::npos) << c.what << "\n" << r.output;
    EXPECT_NE(r.output.find(c.says), std::string::npos) << c.what << "\n" << r.output;
    EXPECT_NE(r.output.find("falling back to the previous committed step"), std::string::npos) << c.what;
    EXPECT_EQ(summary_of(d.path())["resumed_from_step"], 5) << c.what;
    // checkpoint.resume_from naming the tampered step: the user's input, exit 2. (The run
    // above saved step 10 anew: tamper with it again.)
    write_text(meta_path, m.dump());
    a.push_back("--checkpoint.resume_from=10");
    const auto named = run_keel(a);
    EXPECT_EQ(named.exit_code, 2) << c.what << "\n" << named.output;
    EXPECT_NE(named.output.find(c.says), std::string::npos) << c.what << "\n" << named.output;
  }
}

// Decided (issue 15, class 12): when no committed step can be used, they are moved to
// <checkpoint.dir>/corrupt/ (kept, never overwritten) and the run starts fresh, saying so.
TEST(CheckpointResume, AllCommittedStepsUnusableAreSetAsideAndTheRunStartsFresh) {
  TempDir d;
  ASSERT_EQ(run_keel(train_args(d.path(), 10, 5)).exit_code, 0);
  flip_byte(d.file("ckpt/step_5/model-00001-of-00001.safetensors"), 100);
  flip_byte(d.file("ckpt/step_10/model-00001-of-00001.safetensors"), 100);
  const auto r = run_keel(train_args(d.path(), 10, 5));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("none of the 2 committed step(s)"), std::string::npos) << r.output;
  EXPECT_TRUE(exists(d.file("ckpt/corrupt/step_5/meta.json")));
  EXPECT_TRUE(exists(d.file("ckpt/corrupt/step_10/meta.json")));
  EXPECT_TRUE(summary_of(d.path())["resumed_from_step"].is_null());
  EXPECT_TRUE(exists(d.file("ckpt/step_10/meta.json")));                  // the fresh run's own
  EXPECT_EQ(run_keel({"inspect", d.file("ckpt/corrupt")}).exit_code, 1);  // still there to look at
}

// Running a finished job again resumes at its last step, trains nothing and reports the same
// results (the loss comes from the checkpoint, the evaluation is repeated).
TEST(CheckpointResume, RerunningAFinishedRunReportsItsResults) {
  TempDir d;
  auto args = train_args(d.path(), 10, 5);
  args.push_back("--train.eval_interval=10");
  ASSERT_EQ(run_keel(args).exit_code, 0);
  const auto first = summary_of(d.path());
  auto again = run_keel(args);
  ASSERT_EQ(again.exit_code, 0) << again.output;
  const auto second = summary_of(d.path());
  EXPECT_EQ(second["resumed_from_step"], 10);
  EXPECT_EQ(second["steps"], 10);
  EXPECT_EQ(second["final_loss"], first["final_loss"]);
  EXPECT_EQ(second["test_accuracy"], first["test_accuracy"]);
  EXPECT_NE(again.output.find("nothing to train"), std::string::npos) << again.output;
}

// A checkpoint that does not fit the resumed run's config is the user's input, whichever
// component it does not fit: another model (the tensors do not bind) or another optimizer
// (its state does not fit): exit 2 naming what differs, and nothing is overwritten.
TEST(CheckpointResume, AnotherModelOrOptimizerOnResumeIsInputError) {
  TempDir d;
  ASSERT_EQ(run_keel(train_args(d.path(), 10, 5)).exit_code, 0);
  const std::string meta_before = read_text(d.file("ckpt/step_10/meta.json"));
  struct Case {
    const char* option;
    const char* says;
  };
  for (const Case& c : {Case{"--train.optimizer=sgd", "optimizer state does not fit"},
                        Case{"--model.name=cnn", "missing from the checkpoint"}}) {
    auto args = train_args(d.path(), 20, 5);
    args.push_back(c.option);
    const auto r = run_keel(args);
    EXPECT_EQ(r.exit_code, 2) << c.option << "\n" << r.output;
    EXPECT_NE(r.output.find(c.says), std::string::npos) << c.option << "\n" << r.output;
    EXPECT_NE(r.output.find("step_10"), std::string::npos) << c.option << "\n" << r.output;
  }
  EXPECT_EQ(read_text(d.file("ckpt/step_10/meta.json")), meta_before);
  EXPECT_FALSE(exists(d.file("ckpt/step_15")));
}

TEST(CheckpointResume, SavedAtTwoRanksLoadsAtOne) {
  TempDir d;
  for (auto& r : run_keel_ranks(2, train_args(d.path(), 10, 5))) ASSERT_EQ(r.exit_code, 0) << r.output;
  auto one = run_keel(train_args(d.path(), 20, 5));
  ASSERT_EQ(one.exit_code, 0) << one.output;
  auto s = summary_of(d.path());
  EXPECT_EQ(s["resumed_from_step"], 10);
  EXPECT_EQ(s["world_size"], 1);
  EXPECT_EQ(s["steps"], 20);
  EXPECT_NE(one.output.find("saved by 2 ranks x batch 16 on 1 ranks x batch 16"), std::string::npos) << one.output;
  // The parameters at load equal the saved ones: the 1-rank job's step-10 state is the 2-rank one.
  auto meta = nlohmann::json::parse(read_text(d.file("ckpt/step_20/meta.json")));
  EXPECT_EQ(meta["world_size"], 1);
}

// A resume on data of another size (here data.synthetic_size; for tokens, data.path's files)
// loads the newest step and keeps the samples the job consumed in the epoch, clamped to the
// epoch's end, with a warning naming both sizes: not a refusal of the step (the saved batch
// index past the smaller epoch) that falls back to an older one.
TEST(CheckpointResume, AResumeOnDataOfAnotherSizeWarnsNamingBothSizes) {
  TempDir d;
  auto first = train_args(d.path(), 10, 5);
  first.push_back("--data.synthetic_size=512");
  ASSERT_EQ(run_keel(first).exit_code, 0);
  auto again = train_args(d.path(), 12, 5);
  again.push_back("--data.synthetic_size=64");  // 4 batches of 16 per epoch; step 10 was batch 10 of 32
  const auto r = run_keel(again);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("whose run trained on 512 samples, but the training split now has 64"), std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("remapped from epoch 0 batch 10 to batch 4 (160 samples of the epoch consumed)"),
            std::string::npos)
      << r.output;
  EXPECT_EQ(summary_of(d.path())["resumed_from_step"], 10);
  EXPECT_EQ(summary_of(d.path())["steps"], 12);
  auto meta = nlohmann::json::parse(read_text(d.file("ckpt/step_10/meta.json")));
  EXPECT_EQ(meta["components"]["sampler"]["values"]["dataset_size"], 512) << meta["components"]["sampler"].dump();
}

TEST(CheckpointResume, CorruptNewestStepFallsBackWithAWarningNamingTheFile) {
  TempDir d;
  for (auto& r : run_keel_ranks(2, train_args(d.path(), 10, 5))) ASSERT_EQ(r.exit_code, 0) << r.output;
  flip_byte(d.file("ckpt/step_10/model-00002-of-00002.safetensors"), 5);
  auto ranks = run_keel_ranks(2, train_args(d.path(), 15, 5));
  for (auto& r : ranks) {
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("step_10/model-00002-of-00002.safetensors: checksum mismatch"), std::string::npos)
        << r.output;
    EXPECT_NE(r.output.find("falling back to the previous committed step"), std::string::npos) << r.output;
  }
  EXPECT_EQ(summary_of(d.path())["resumed_from_step"], 5);
}

TEST(CheckpointFault, WriteFailureOnOneRankFailsTheSaveOnEveryRank) {
  TempDir d;
  auto args = train_args(d.path(), 20, 5);
  args.push_back("--fault.inject=checkpoint_write_failure@step=10,rank=1");
  auto ranks = run_keel_ranks(2, args);
  for (auto& r : ranks) {
    EXPECT_FALSE(r.signaled) << r.output;
    EXPECT_EQ(r.exit_code, 1) << r.output;
    EXPECT_NE(r.output.find("checkpoint step 10 was not saved"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("rank 1: "), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("model-00002-of-00002.safetensors"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find(std::strerror(ENOSPC)), std::string::npos) << r.output;
  }
  EXPECT_FALSE(exists(d.file("ckpt/step_10/meta.json")));
  EXPECT_TRUE(verify_step(d.file("ckpt/step_5")).empty());
  // The next run resumes from the intact step and finishes (the fault fires once per job only
  // when restarted by torchrun; here the entry is simply left out).
  auto again = run_keel_ranks(2, train_args(d.path(), 20, 5));
  for (auto& r : again) ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(summary_of(d.path())["resumed_from_step"], 5);
  EXPECT_FALSE(exists(d.file("ckpt/step_10/model-00001-of-00002.safetensors.tmp")));
}

TEST(CheckpointStop, SigtermEndsTheRunWithAFinalCheckpoint) {
  TempDir d;
  Child c = spawn_keel(train_args(d.path(), 1000000, 0));
  const std::string metrics = d.file("run/metrics.jsonl");
  for (int i = 0; i < 3000; ++i) {  // until a few steps are logged (at most ~5 minutes)
    if (exists(metrics) && read_text(metrics).size() > 600) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  ::kill(c.pid, SIGTERM);
  auto r = wait_process(c, 120);
  ASSERT_FALSE(r.signaled) << r.output;
  EXPECT_EQ(r.exit_code, 128 + SIGTERM) << r.output;
  auto s = summary_of(d.path());
  EXPECT_FALSE(s["completed"].get<bool>());
  const int64_t steps = s["steps"].get<int64_t>();
  EXPECT_GT(steps, 0);
  EXPECT_EQ(s["checkpoint_step"], steps);
  EXPECT_TRUE(verify_step(d.file("ckpt/step_" + std::to_string(steps))).empty());
}

// The model shards and a file of every dtype, read by tests/safetensors_reader.py (numpy,
// written from the spec).
TEST(CheckpointPython, ASpecReaderReadsTheShards) {
  TempDir d;
  for (auto& r : run_keel_ranks(2, train_args(d.path(), 5, 0))) ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::string step = d.file("ckpt/step_5");
  auto py = run_process({KEEL_PYTHON, source_path("tests/safetensors_reader.py"), "index", step});
  ASSERT_EQ(py.exit_code, 0) << py.output;
  auto j = nlohmann::json::parse(py.output);
  std::map<std::string, torch::Tensor> mine;
  for (int r = 0; r < 2; ++r)
    for (auto& [n, t] : read_safetensors(step + "/" + component_file("model", r, 2)).tensors) mine[n] = t;
  ASSERT_EQ(j["tensors"].size(), mine.size());
  for (auto& [n, t] : mine) {
    ASSERT_TRUE(j["tensors"].contains(n)) << n;
    EXPECT_EQ(j["tensors"][n]["shape"].get<std::vector<int64_t>>(), t.sizes().vec()) << n;
    const double want = t.to(torch::kDouble).sum().item<double>();
    EXPECT_NEAR(j["tensors"][n]["sum"].get<double>(), want, 1e-9 * (1 + std::abs(want))) << n;
  }
  // Every dtype, with known values.
  NamedTensors ts;
  for (auto t : {torch::kFloat, torch::kDouble, torch::kBFloat16, torch::kHalf, torch::kLong, torch::kInt,
                 torch::kShort, torch::kChar, torch::kByte})
    ts.emplace_back(safetensors_dtype(t), torch::arange(6, torch::kDouble).reshape({2, 3}).to(t));
  ts.emplace_back("BOOL", torch::tensor({true, false, true}));
  write_safetensors(d.file("all.safetensors"), ts, {{"format", "pt"}});
  auto f = run_process({KEEL_PYTHON, source_path("tests/safetensors_reader.py"), "file", d.file("all.safetensors")});
  ASSERT_EQ(f.exit_code, 0) << f.output;
  auto k = nlohmann::json::parse(f.output);
  EXPECT_EQ(k["metadata"]["format"], "pt");
  for (auto& [n, t] : ts) {
    EXPECT_EQ(k["tensors"][n]["dtype"], n);
    const auto want = n == "BOOL" ? std::vector<double>{1, 0, 1} : std::vector<double>{0, 1, 2, 3, 4, 5};
    EXPECT_EQ(k["tensors"][n]["values"].get<std::vector<double>>(), want) << n;
  }
}

TEST(KeelInspect, ReportsStepsChecksumsAndTensors) {
  TempDir d;
  auto r = run_keel(train_args(d.path(), 10, 5));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto ok = run_keel({"inspect", d.file("ckpt")});
  EXPECT_EQ(ok.exit_code, 0) << ok.output;
  EXPECT_NE(ok.output.find("committed, checksums verified"), std::string::npos) << ok.output;
  EXPECT_NE(ok.output.find("fc.0.weight"), std::string::npos) << ok.output;
  EXPECT_NE(ok.output.find("[256, 784]"), std::string::npos) << ok.output;
  // A component whose tensors are each rank's own (the generators) says so, not "0 tensor(s)".
  EXPECT_NE(ok.output.find("component rng: 0 tensor(s), 1 of each rank's own (in its rank-<r>.safetensors)"),
            std::string::npos)
      << ok.output;
  flip_byte(d.file("ckpt/step_10/rank-00000.safetensors"), 1);
  auto bad = run_keel({"inspect", d.file("ckpt"), "--json"});
  EXPECT_EQ(bad.exit_code, 1) << bad.output;
  auto j = nlohmann::json::parse(bad.output);
  ASSERT_EQ(j["steps"].size(), 2u);
  EXPECT_TRUE(j["steps"][0]["verified"].get<bool>());
  EXPECT_FALSE(j["steps"][1]["verified"].get<bool>());
  EXPECT_NE(j["steps"][1]["problems"].dump().find("rank-00000.safetensors"), std::string::npos);
  auto one = run_keel({"inspect", d.file("ckpt/step_5")});
  EXPECT_EQ(one.exit_code, 0) << one.output;
  EXPECT_EQ(run_keel({"inspect", d.file("nothing-here")}).exit_code, 2);
}

// `keel inspect` calls verified exactly what training would load: steps that verify file by
// file yet do not load (a shard gone from disk and from meta.json, a world size the shards do
// not match, an index entry pointing elsewhere or naming a tensor no shard holds) are refused
// by both, with the same message.
TEST(KeelInspect, VerifiesWhatTheLoaderVerifies) {
  TempDir d;
  ASSERT_EQ(run_keel(train_args(d.path(), 5, 5)).exit_code, 0);
  const std::string step = d.file("ckpt/step_5");
  const auto meta0 = nlohmann::json::parse(read_text(step + "/meta.json"));
  const std::string index_name = "model.safetensors.index.json";
  const auto index0 = nlohmann::json::parse(read_text(step + "/" + index_name));
  const std::string opt_index_name = "optimizer.safetensors.index.json";
  const std::string opt_index_text = read_text(step + "/" + opt_index_name);
  const auto opt_index0 = nlohmann::json::parse(opt_index_text);
  auto write_file_entry = [&](const std::string& name, const std::string& text, nlohmann::json& meta) {
    write_text(step + "/" + name, text);
    meta["files"][name]["sha256"] = sha256_file(step + "/" + name);
    meta["files"][name]["bytes"] = text.size();
  };
  auto write_index = [&](const nlohmann::json& index, nlohmann::json& meta) {
    write_file_entry(index_name, index.dump(), meta);
  };
  struct Case {
    const char* what;
    std::function<void(nlohmann::json& meta)> tamper;
    const char* says;
  };
  const std::vector<Case> cases = {
      {"optimizer shard gone from disk and meta.json",
       [&](nlohmann::json& m) {
         std::rename((step + "/optimizer-00001-of-00001.safetensors").c_str(), (step + "/moved").c_str());
         m["files"].erase("optimizer-00001-of-00001.safetensors");
       },
       "optimizer-00001-of-00001.safetensors"},
      {"index entry outside the step",
       [&](nlohmann::json& m) {
         auto index = index0;
         index["weight_map"].begin().value() = "../step_5/model-00001-of-00001.safetensors";
         write_index(index, m);
       },
       "points outside the checkpoint directory"},
      {"world size the shards do not match", [&](nlohmann::json& m) { m["world_size"] = 2; },
       "model-00001-of-00002.safetensors"},
      {"index naming a tensor no shard holds",
       [&](nlohmann::json& m) {
         auto index = index0;
         index["weight_map"]["no.such.tensor"] = "model-00001-of-00001.safetensors";
         write_index(index, m);
       },
       "which meta.json does not record"},
      {"optimizer index listing state its file does not hold",
       [&](nlohmann::json& m) {
         auto index = opt_index0;
         index["weight_map"]["fc.0.weight.no_such_field"] = "optimizer-00001-of-00001.safetensors";
         write_file_entry(opt_index_name, index.dump(), m);
       },
       // meta.json's record of the component's tensors refuses it before the files are read
       "which meta.json does not record"},
      {"optimizer index naming a file of another step",
       [&](nlohmann::json& m) {
         auto index = opt_index0;
         index["weight_map"].begin().value() = "../step_0/optimizer-00001-of-00001.safetensors";
         write_file_entry(opt_index_name, index.dump(), m);
       },
       "points outside the checkpoint directory"},
      {"an owned tensor the component does not record",
       [&](nlohmann::json& m) { m["components"]["optimizer"]["owned"] = {"no.such.tensor"}; },
       "which is not one of its tensors"},
  };
  for (const auto& c : cases) {
    nlohmann::json m = meta0;
    c.tamper(m);
    write_text(step + "/meta.json", m.dump());
    const auto inspected = run_keel({"inspect", step, "--json"});
    EXPECT_EQ(inspected.exit_code, 1) << c.what << "\n" << inspected.output;
    EXPECT_NE(inspected.output.find(c.says), std::string::npos) << c.what << "\n" << inspected.output;
    auto a = train_args(d.path(), 6, 5);
    a.push_back("--checkpoint.resume_from=5");
    const auto loaded = run_keel(a);
    EXPECT_EQ(loaded.exit_code, 2) << c.what << "\n" << loaded.output;
    EXPECT_NE(loaded.output.find(c.says), std::string::npos) << c.what << "\n" << loaded.output;
    // Undo for the next case.
    std::rename((step + "/moved").c_str(), (step + "/optimizer-00001-of-00001.safetensors").c_str());
    write_text(step + "/" + index_name, index0.dump(2) + "\n");
    write_text(step + "/" + opt_index_name, opt_index_text);
    write_text(step + "/meta.json", meta0.dump(2) + "\n");
  }
  EXPECT_EQ(run_keel({"inspect", step}).exit_code, 0);  // undone: verifies again
}

// checkpoint.save_graph: the step holds the traced module, which runs without keel's model
// code and gives the same outputs as the model rebuilt from the step's tensors.
TEST(CheckpointGraph, SaveGraphStoresAServableTracedModule) {
  TempDir d;
  auto args = train_args(d.path(), 6, 3);
  args.push_back("--compile.mode=trace");
  args.push_back("--checkpoint.save_graph=true");
  auto r = run_keel(args);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::string step = d.file("ckpt/step_6");
  auto meta = nlohmann::json::parse(read_text(step + "/meta.json"));
  ASSERT_TRUE(meta["files"].contains("graph.pt"));
  EXPECT_TRUE(verify_step(step).empty());
  auto served = torch::jit::load(step + "/graph.pt");
  keel::ModelConfig mc;
  mc.name = "mlp";
  auto model = keel::models::create_model(mc, keel::models::InputKind::Image);
  NamedTensors targets;
  for (auto& [n, t] : model->named_parameters()) targets.emplace_back(n, t);
  auto tensors = read_safetensors(step + "/model-00001-of-00001.safetensors").tensors;
  copy_into(targets, tensors, step);
  torch::NoGradGuard ng;
  auto x = torch::randn({16, 1, 28, 28});
  auto want = model->forward(x);
  auto got = served.forward({x}).toTensor();
  EXPECT_TRUE(torch::allclose(got, want, 1e-5, 1e-6)) << (got - want).abs().max().item<double>();
  // A checkpoint of another model does not bind: the error lists what is wrong.
  keel::ModelConfig other;
  other.name = "cnn";
  auto cnn = keel::models::create_model(other, keel::models::InputKind::Image);
  NamedTensors cnn_targets;
  for (auto& [n, t] : cnn->named_parameters()) cnn_targets.emplace_back(n, t);
  const std::string e = error_of<BindError>([&] { copy_into(cnn_targets, tensors, step); });
  EXPECT_NE(e.find("missing from the checkpoint"), std::string::npos) << e;
  EXPECT_NE(e.find("unexpected (not in the model)"), std::string::npos) << e;
  // save_graph without a compiled graph (compile.mode = inductor or trace) is a config error.
  auto bad = run_keel({"train", "--model.name=mlp", "--data.name=synthetic", "--checkpoint.dir=" + d.file("x"),
                       "--checkpoint.save_graph=true"});
  EXPECT_EQ(bad.exit_code, 2);
  EXPECT_NE(bad.output.find("compile.mode"), std::string::npos) << bad.output;
}

// keel as a library: the Trainer's checkpoints carry your own state (Callbacks::save_state /
// load_state) and tell you when a step is committed (on_checkpoint).
TEST(TrainerCheckpoints, CallbacksSaveAndRestoreYourOwnState) {
  TempDir d;
  keel::Config cfg;
  cfg.run.dir = d.file("run");
  cfg.run.threads = 1;
  cfg.model.name = "mlp";
  cfg.data.name = "synthetic";
  cfg.data.synthetic_size = 512;
  cfg.train.steps = 6;
  cfg.train.batch_size = 16;
  cfg.checkpoint.dir = d.file("ck");
  cfg.checkpoint.interval = 3;
  keel::validate(cfg);
  std::vector<int64_t> committed;
  int saves = 0;
  keel::Callbacks cb;
  cb.on_checkpoint = [&](int64_t step, const std::string& dir) {
    committed.push_back(step);
    EXPECT_TRUE(exists(dir + "/meta.json")) << dir;
  };
  cb.save_state = [&](keel::checkpoint::Component& mine) {
    ++saves;
    mine.add("ema", torch::full({3}, float(saves)));
    mine.values["saves"] = saves;
    mine.add("noise", torch::arange(4), Placement::PerRank);
  };
  keel::Trainer(cfg, keel::dist::World{}, cb).run();
  EXPECT_EQ(committed, (std::vector<int64_t>{3, 6}));
  EXPECT_TRUE(exists(d.file("ck/step_6/user-00001-of-00001.safetensors")));

  cfg.train.steps = 9;
  bool loaded = false;
  keel::Callbacks cb2;
  cb2.load_state = [&](const keel::checkpoint::LoadedComponent& mine) {
    loaded = true;
    ASSERT_EQ(mine.tensors.size(), 1u);
    EXPECT_EQ(mine.tensors[0].first, "ema");
    EXPECT_TRUE(torch::equal(mine.tensors[0].second, torch::full({3}, 2.f)));
    EXPECT_EQ(mine.values["saves"], 2);
    ASSERT_EQ(mine.rank_tensors.size(), 1u);
    EXPECT_EQ(mine.rank_tensors[0].first, "noise");
    EXPECT_TRUE(torch::equal(mine.rank_tensors[0].second, torch::arange(4)));
  };
  auto s = keel::Trainer(cfg, keel::dist::World{}, cb2).run();
  EXPECT_TRUE(loaded);
  EXPECT_EQ(s.resumed_from_step.value_or(-1), 6);
}

}  // namespace

// --- the real clients: PyPI's safetensors and PyTorch (issue 17, item 4) -------------------

namespace {

// Runs tests/safetensors_roundtrip.py; skips the test when the safetensors package is absent.
ProcResult roundtrip(const std::vector<std::string>& args) {
  std::vector<std::string> argv = {KEEL_PYTHON, source_path("tests/safetensors_roundtrip.py")};
  argv.insert(argv.end(), args.begin(), args.end());
  return run_process(argv, {}, 300);
}

}  // namespace

// Every model shard of a 2-rank checkpoint, loaded by safetensors.torch.load_file along the
// HF index into the PyTorch reference model (tests/golden/reference_models.py), gives the
// logits keel gives from the same step, within 1e-5 (float32 of the same operations; the
// order of reductions inside a matmul may differ between the two runs).
TEST(RealClients, PyTorchLoadsKeelsShardsAndGetsKeelsLogits) {
  struct Case {
    std::string name;
    nlohmann::json args;
    std::vector<std::string> flags;
  };
  const std::vector<Case> cases = {{"mlp", {{"width", 32}, {"depth", 2}}, {"--model.width=32", "--model.depth=2"}},
                                   {"gpt",
                                    {{"width", 32}, {"depth", 1}, {"context", 16}, {"heads", 4}},
                                    {"--model.width=32", "--model.depth=1", "--model.context=16", "--model.heads=4"}}};
  for (const auto& c : cases) {
    TempDir d;
    std::vector<std::string> args = {"train",
                                     "--model.name=" + c.name,
                                     "--data.name=synthetic",
                                     "--train.steps=3",
                                     "--train.batch_size=4",
                                     "--train.eval_interval=0",
                                     "--run.threads=1",
                                     "--checkpoint.dir=" + d.file("ckpt"),
                                     "--checkpoint.interval=3",
                                     "--run.dir=" + d.file("run")};
    args.insert(args.end(), c.flags.begin(), c.flags.end());
    expect_all_ok(run_keel_ranks(2, args));
    const std::string step = d.file("ckpt/step_3");
    keel::ModelConfig mc;
    mc.name = c.name;
    mc.width = c.args["width"];
    mc.depth = c.args["depth"];
    if (c.name == "gpt") mc.context = 16;
    auto model = keel::models::create_model(mc);
    EXPECT_GT(load_weights(*model, step), 0);
    model->train(false);
    torch::Tensor input =
        c.name == "mlp" ? (torch::arange(4 * 784).remainder(29).to(torch::kFloat) / 29.0 - 0.5).view({4, 1, 28, 28})
                        : torch::arange(2 * 16).remainder(256).view({2, 16});
    torch::NoGradGuard ng;
    write_safetensors(d.file("keel.safetensors"), {{"input", input}, {"logits", model->forward(input).contiguous()}});
    auto py = roundtrip({"logits", step, d.file("keel.safetensors"), c.name, c.args.dump()});
    if (py.exit_code == 77) GTEST_SKIP() << py.output;
    EXPECT_EQ(py.exit_code, 0) << c.name << ": " << py.output;
    std::printf("%s: %s", c.name.c_str(), py.output.c_str());
  }
}

// The reverse: weights PyTorch wrote with safetensors.torch.save_file start a keel run
// (model.init_from), and keel's first loss is the loss PyTorch computes for the same weights
// on the same first batch.
TEST(RealClients, PyTorchWeightsInitialiseAKeelRun) {
  TempDir d;
  auto py = roundtrip({"init", d.file("init.safetensors"), R"({"width": 32, "depth": 2})", "16"});
  if (py.exit_code == 77) GTEST_SKIP() << py.output;
  ASSERT_EQ(py.exit_code, 0) << py.output;
  const double want = nlohmann::json::parse(py.output)["first_loss"].get<double>();
  auto r =
      run_keel({"train", "--model.name=mlp", "--model.width=32", "--model.depth=2", "--data.name=synthetic",
                "--data.shuffle=false", "--train.steps=1", "--train.batch_size=16", "--train.eval_interval=0",
                "--run.threads=1", "--model.init_from=" + d.file("init.safetensors"), "--run.dir=" + d.file("run")});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("tensors from " + d.file("init.safetensors")), std::string::npos) << r.output;
  const auto line = nlohmann::json::parse(read_text(d.file("run/metrics.jsonl")));
  EXPECT_NEAR(line["loss"].get<double>(), want, 1e-6 * want) << "keel " << line["loss"] << ", PyTorch " << want;
  // A file that does not fit the model is bad input naming the tensor and both shapes.
  auto bad =
      run_keel({"train", "--model.name=mlp", "--model.width=64", "--model.depth=2", "--data.name=synthetic",
                "--train.steps=1", "--model.init_from=" + d.file("init.safetensors"), "--run.dir=" + d.file("bad")});
  EXPECT_EQ(bad.exit_code, 2) << bad.output;
  EXPECT_NE(bad.output.find("\"fc.0.weight\" has shape [32, 784], the model's is [64, 784]"), std::string::npos)
      << bad.output;
}
