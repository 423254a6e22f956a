// tests/test_hardening_outputs.cpp: what a run writes for people to read, when writing it
// fails or its values are odd (hardening classes 5, 9, 10, 11 of issue 23): TensorBoard event
// files on a full disk, a profiler trace that cannot be written, `keel plot` of a run whose
// values are all NaN, and an interface list with no name in it at any world size.
#include <dirent.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "helpers.h"
#include "multirank.h"
#include "trainer/tensorboard.h"

using keel::testing::read_text;
using keel::testing::run_keel;
using keel::testing::TempDir;
using keel::testing::write_text;

namespace {

size_t count_of(const std::string& haystack, const std::string& needle) {
  size_t n = 0;
  for (size_t p = haystack.find(needle); p != std::string::npos; p = haystack.find(needle, p + needle.size())) ++n;
  return n;
}

std::vector<std::string> entries(const std::string& dir) {
  std::vector<std::string> out;
  if (DIR* d = ::opendir(dir.c_str())) {
    while (const dirent* e = ::readdir(d)) {
      const std::string n = e->d_name;
      if (n != "." && n != "..") out.push_back(n);
    }
    ::closedir(d);
  }
  return out;
}

uint32_t le32(const std::string& s, size_t at) {
  uint32_t v = 0;
  for (int i = 3; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(s[at + i]);
  return v;
}

// The Event messages of a TFRecord file, read as TensorBoard reads them: each record is
// [uint64 length][masked CRC32C of it][data][masked CRC32C of data]. Stops at the first record
// that is not whole, describing it in `error` (TensorBoard reads nothing after such a record).
std::vector<std::string> read_records(const std::string& path, std::string& error) {
  const std::string f = read_text(path);
  std::vector<std::string> out;
  size_t at = 0;
  while (at < f.size()) {
    const std::string where = " at byte " + std::to_string(at) + " of " + std::to_string(f.size());
    if (f.size() - at < 12) {
      error = "a header cut short" + where;
      break;
    }
    uint64_t n = 0;
    for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(f[at + i]);
    if (le32(f, at + 8) != keel::masked_crc32c(f.data() + at, 8)) {
      error = "a length whose CRC does not match" + where;
      break;
    }
    if (n > f.size() - at - 12 || f.size() - at - 12 - n < 4) {
      error = "a record cut short" + where;
      break;
    }
    std::string data = f.substr(at + 12, n);
    if (le32(f, at + 12 + n) != keel::masked_crc32c(data.data(), data.size())) {
      error = "a record whose CRC does not match" + where;
      break;
    }
    out.push_back(std::move(data));
    at += 12 + n + 4;
  }
  return out;
}

// The step of an Event message (field 2, a varint); -1 when it has none (the file-version
// event), -2 when the message does not parse.
int64_t event_step(const std::string& m) {
  size_t p = 0;
  bool bad = false;
  auto varint = [&]() {
    uint64_t v = 0;
    for (int shift = 0;; shift += 7) {
      if (p >= m.size() || shift > 63) {
        bad = true;
        return v;
      }
      const auto b = static_cast<unsigned char>(m[p++]);
      v |= static_cast<uint64_t>(b & 0x7f) << shift;
      if (!(b & 0x80)) return v;
    }
  };
  int64_t step = -1;
  while (p < m.size() && !bad) {
    const uint64_t key = varint();
    const uint64_t field = key >> 3, type = key & 7;
    if (type == 0) {
      const uint64_t v = varint();
      if (field == 2) step = static_cast<int64_t>(v);
    } else if (type == 1) {
      p += 8;
    } else if (type == 2) {
      const uint64_t len = varint();
      p += len;
    } else if (type == 5) {
      p += 4;
    } else {
      bad = true;
    }
  }
  return bad || p != m.size() ? -2 : step;
}

// Hardening class 5: a temporary full disk must not tear the TensorBoard event file. A record
// cut short is rolled back (TensorBoard's reader stops at a torn record and shows nothing of
// what follows), the lost records are counted and warned about once, and once there is space
// again the later records are written as usual. RLIMIT_FSIZE cuts a write short exactly as a
// full disk does (the metrics test's seam, Metrics.AFullDiskLeavesOnlyWholeLinesAndCountsTheLostOnes):
// set in a child process, lowered to 40 bytes past the file's end for steps 21-30 (every record
// is longer: each of their writes is cut partway), then raised again.
TEST(TensorBoard, AFullDiskLeavesOnlyWholeRecordsAndLaterEventsStayReadable) {
  TempDir d;
  const std::string dir = d.file("tb"), log = d.file("child.log");
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    ::signal(SIGXFSZ, SIG_IGN);  // the write then fails with EFBIG instead of killing
    const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd >= 0) ::dup2(fd, 2);  // the writer's warning, for the parent to count
    int code = 100;
    try {
      keel::EventWriter w(dir);
      auto values = [](int64_t step) {
        return std::vector<std::pair<std::string, double>>{{"train/loss", 1.0 / static_cast<double>(step)},
                                                           {"train/lr", 0.01},
                                                           {"train/step_ms", 3.5},
                                                           {"train/samples_per_s", 1000.0 + static_cast<double>(step)}};
      };
      for (int64_t s = 1; s <= 20; ++s) {
        w.scalars(s, values(s));
        w.flush();
      }
      struct stat st {};
      struct rlimit saved {};
      if (::stat(w.path().c_str(), &st) != 0 || ::getrlimit(RLIMIT_FSIZE, &saved) != 0) std::_Exit(102);
      struct rlimit full = saved;
      full.rlim_cur = static_cast<rlim_t>(st.st_size) + 40;  // less than one record
      if (::setrlimit(RLIMIT_FSIZE, &full) != 0) std::_Exit(103);
      for (int64_t s = 21; s <= 30; ++s) {
        w.scalars(s, values(s));
        w.flush();
      }
      if (::setrlimit(RLIMIT_FSIZE, &saved) != 0) std::_Exit(104);  // space again
      for (int64_t s = 31; s <= 60; ++s) {
        w.scalars(s, values(s));
        w.flush();
      }
      code = static_cast<int>(std::min<int64_t>(w.records_lost(), 99));
    } catch (...) {
      code = 101;
    }
    std::_Exit(code);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  const std::string child_log = read_text(log);
  ASSERT_TRUE(WIFEXITED(status)) << child_log;
  EXPECT_EQ(WEXITSTATUS(status), 10) << "records_lost(), or 100+ for a failure of the child\n" << child_log;
  EXPECT_EQ(count_of(child_log, "run.tensorboard:"), 1u) << "the loss is warned about once:\n" << child_log;

  const auto files = entries(dir);
  ASSERT_EQ(files.size(), 1u);
  std::string error;
  const auto records = read_records(dir + "/" + files[0], error);
  EXPECT_EQ(error, "") << "a torn record in the event file";
  std::vector<int64_t> steps, want = {-1};  // the file-version event first
  for (const auto& r : records) steps.push_back(event_step(r));
  for (int64_t s = 1; s <= 20; ++s) want.push_back(s);
  for (int64_t s = 31; s <= 60; ++s) want.push_back(s);  // 21-30 are lost whole
  EXPECT_EQ(steps, want);
}

// Hardening class 9: Kineto's save does not report a trace it cannot write, and keel said the
// trace was written. A directory where rank 0's trace goes: a warning naming the file and why,
// never the success line; the directory and what it holds are left alone, no temporary file is
// left beside it, and the run ends normally (a trace is not worth a run).
TEST(Profiler, ATraceThatCannotBeWrittenIsWarnedAndNeverReportedWritten) {
  TempDir d;
  const std::string run = d.file("run"), trace = run + "/trace.rank0.json";
  ASSERT_EQ(::mkdir(run.c_str(), 0755), 0);
  ASSERT_EQ(::mkdir(trace.c_str(), 0755), 0);
  write_text(trace + "/keep", "mine");  // not empty: a remove() of it fails too
  auto r = run_keel({"train", "--model.name=mlp", "--model.width=16", "--model.depth=1", "--data.name=synthetic",
                     "--train.steps=3", "--train.batch_size=8", "--train.eval_interval=0", "--run.threads=1",
                     "--run.profile_steps=1-2", "--run.dir=" + run},
                    {}, 120);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("cannot write the trace " + trace), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("profiler: trace of steps"), std::string::npos) << "reported as written:\n" << r.output;
  EXPECT_EQ(read_text(trace + "/keep"), "mine");
  for (const auto& e : entries(run)) EXPECT_EQ(e.find("trace.rank0.json."), std::string::npos) << "left behind: " << e;
}

// Hardening class 10: docs/inputs.md says values that are not numbers are gaps, but a run
// whose losses were all NaN (keel writes NaN as null) made gnuplot fail ("all points y value
// undefined") and `keel plot` exit 1. Every PNG is written: a series with no number is left
// out, a panel with none is drawn empty with a note, which is also logged. Only input with no
// step line at all is an error.
TEST(KeelPlot, ARunWhoseValuesAreAllNaNStillPlots) {
  TempDir d;
  const std::string run = d.file("run");
  ASSERT_EQ(::mkdir(run.c_str(), 0755), 0);
  std::string text;
  for (int s = 1; s <= 6; ++s) {
    nlohmann::json j = {{"step", s},
                        {"loss", NAN},
                        {"lr", 0.01},
                        {"step_ms", 3.0},
                        {"samples_per_s", 1000.0 + s},
                        {"loss_scale", NAN},
                        {"rank_compute_ms", nlohmann::json::array({2.0 + s, NAN})}};
    if (s == 6) {
      j["test_loss"] = NAN;
      j["test_accuracy"] = NAN;
    }
    text += j.dump() + "\n";  // as JsonlWriter writes it
  }
  ASSERT_NE(text.find("\"loss\":null"), std::string::npos) << text;
  write_text(run + "/metrics.jsonl", text);
  auto p = run_keel({"plot", run}, {}, 60);
  EXPECT_EQ(p.exit_code, 0) << p.output;
  for (const char* f : {"loss.png", "throughput.png", "loss_scale.png", "rank_compute.png"}) {
    const std::string png = read_text(run + "/plots/" + f);
    EXPECT_GT(png.size(), 2000u) << f << "\n" << p.output;
    EXPECT_EQ(png.substr(0, 8), std::string("\x89PNG\r\n\x1a\n", 8)) << f;  // the PNG signature
  }
  EXPECT_NE(p.output.find("no loss value to plot"), std::string::npos) << p.output;
  EXPECT_NE(p.output.find("no positive loss scale to plot"), std::string::npos) << p.output;
  // Input with nothing to plot at all is still an error, naming the file.
  const std::string empty = d.file("empty");
  ASSERT_EQ(::mkdir(empty.c_str(), 0755), 0);
  write_text(empty + "/metrics.jsonl", "{}\n");
  auto e = run_keel({"plot", empty}, {}, 60);
  EXPECT_EQ(e.exit_code, 2) << e.output;
  EXPECT_NE(e.output.find("no step lines to plot"), std::string::npos) << e.output;
}

// Hardening class 11: an interface list with no name in it was refused at 2 ranks (before the
// rendezvous) but ignored at 1 rank, where no process group is made. It is checked with the
// config now: refused alike at every world size, exit 2 naming dist.interface.
TEST(Interface, AListWithNoNameInItIsRefusedAtOneRankAsAtTwo) {
  TempDir d;
  const std::string config = keel::testing::source_path("configs/synthetic_smoke.toml");
  for (const std::string value : {",", " , "}) {
    auto r = run_keel({"train", "--config", config, "--dist.interface=" + value, "--train.steps=1", "--run.threads=1",
                       "--run.dir=" + d.file("one")},
                      {}, 60);
    EXPECT_FALSE(r.signaled) << r.output;
    EXPECT_EQ(r.exit_code, 2) << "dist.interface = \"" << value << "\" at 1 rank\n" << r.output;
    EXPECT_NE(r.output.find("dist.interface = \""), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("no interface name in it"), std::string::npos) << r.output;
  }
  const auto ranks =
      keel::testing::run_keel_ranks(2,
                                    {"train", "--config", config, "--dist.interface=,", "--train.steps=1",
                                     "--run.threads=1", "--dist.timeout_s=30", "--run.dir=" + d.file("two")},
                                    60);
  ASSERT_EQ(ranks.size(), 2u);
  for (const auto& r : ranks) {
    EXPECT_FALSE(r.timed_out) << r.output;
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_NE(r.output.find("dist.interface = \",\": no interface name in it"), std::string::npos) << r.output;
  }
}

}  // namespace

// `keel tokenize` (trainer/data/tokenize.py) and the paths it writes: --out, --val-out and the
// tokenizer.json --train-bpe saves (--save-tokenizer, by default beside --out). A path that would
// lose the user's data or cannot be written is refused before any work: exit 2 naming the flag
// (and the other flag or input), nothing written, no temporary file left.
namespace {

// `n` small text files doc0.txt ... in `d`, one document each; their paths.
std::vector<std::string> tokenize_docs(const TempDir& d, int n) {
  const std::vector<std::string> words = {"the", "ranks", "agree", "on", "every", "step", "and", "checkpoint"};
  std::vector<std::string> docs;
  for (int k = 0; k < n; ++k) {
    std::string text;
    for (int i = 0; i < 1500; ++i) text += words[(i * (k + 3) + i / 7) % words.size()] + (i % 11 ? " " : ".\n");
    docs.push_back(d.file("doc" + std::to_string(k) + ".txt"));
    write_text(docs.back(), text);
  }
  return docs;
}

std::vector<std::string> sorted_entries(const std::string& dir) {
  std::vector<std::string> e = entries(dir);
  std::sort(e.begin(), e.end());
  return e;
}

}  // namespace

// Output = another output (training tokens overwritten by the held-out ones; the tokenizer by the
// tokens) or = an input (the text replaced by tokens) was exit 0: refused now, exit 2 naming both.
TEST(Tokenize, AnOutputThatIsAnInputOrAnotherOutputIsRefusedAndNothingIsWritten) {
  TempDir d;
  const auto docs = tokenize_docs(d, 2);
  const std::string text0 = read_text(docs[0]);
  const auto before = sorted_entries(d.path());

  auto r = run_keel(
      {"tokenize", "--train-bpe", "300", "--out", d.file("x.bin"), "--val-out", d.file("x.bin"), docs[0], docs[1]}, {},
      120);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("--out and --val-out are the same file"), std::string::npos) << r.output;

  r = run_keel({"tokenize", "--train-bpe", "300", "--out", docs[0], docs[0]}, {}, 120);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("--out " + docs[0] + " is the input file " + docs[0]), std::string::npos) << r.output;

  r = run_keel(
      {"tokenize", "--train-bpe", "300", "--save-tokenizer", d.file("y.bin"), "--out", d.file("y.bin"), docs[0]}, {},
      120);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("--out and --save-tokenizer are the same file"), std::string::npos) << r.output;

  // The tokenizer --train-bpe saves by default (x.tokenizer.json beside --out x.bin) is an output too.
  r = run_keel({"tokenize", "--train-bpe", "300", "--out", d.file("x.bin"), "--val-out", d.file("x.tokenizer.json"),
                docs[0], docs[1]},
               {}, 120);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("--val-out and --save-tokenizer"), std::string::npos) << r.output;

  EXPECT_EQ(read_text(docs[0]), text0);
  EXPECT_EQ(sorted_entries(d.path()), before);  // no token file, tokenizer.json or temporary file
}

// An existing file keel tokenize did not write (--save-tokenizer onto a text file, --out onto a
// tokenizer.json) was overwritten silently: refused now. Its own previous outputs (a token file,
// a tokenizer.json) are still overwritten, as a rerun of the same command needs.
TEST(Tokenize, AnExistingFileItDidNotWriteIsNeverOverwrittenButItsOwnOutputsAre) {
  TempDir d;
  const auto docs = tokenize_docs(d, 2);
  const std::string other = d.file("notes.txt");
  write_text(other, "an unrelated file\n");
  const std::vector<std::string> run = {"tokenize",  "--train-bpe",         "300",   "--out", d.file("out/train.bin"),
                                        "--val-out", d.file("out/val.bin"), docs[0], docs[1]};
  auto r = run_keel(run, {}, 120);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::string train = read_text(d.file("out/train.bin"));
  const std::string tokenizer = read_text(d.file("out/train.tokenizer.json"));
  r = run_keel(run, {}, 120);  // the rerun replaces its own token files and tokenizer.json
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(read_text(d.file("out/train.bin")), train);
  EXPECT_EQ(read_text(d.file("out/train.tokenizer.json")), tokenizer);

  const std::string json_copy = d.file("copy.json");
  write_text(json_copy, tokenizer);
  const auto before = sorted_entries(d.path());
  r = run_keel({"tokenize", "--train-bpe", "300", "--save-tokenizer", other, "--out", d.file("z.bin"), docs[0]}, {},
               120);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("--save-tokenizer " + other + ": exists and is not a tokenizer.json"), std::string::npos)
      << r.output;
  r = run_keel({"tokenize", "--tokenizer", d.file("out/train.tokenizer.json"), "--out", other, docs[0]}, {}, 120);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("--out " + other + ": exists and is not a token file"), std::string::npos) << r.output;
  r = run_keel({"tokenize", "--tokenizer", d.file("out/train.tokenizer.json"), "--out", json_copy, docs[0]}, {}, 120);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("--out " + json_copy + ": exists and is not a token file"), std::string::npos) << r.output;
  EXPECT_EQ(read_text(other), "an unrelated file\n");
  EXPECT_EQ(read_text(json_copy), tokenizer);
  EXPECT_EQ(sorted_entries(d.path()), before);
}

// --out DIR for an existing directory was exit 1 (IsADirectoryError), leaving DIR.tmp.PID and a
// DIR.tokenizer.json behind: exit 2 naming the flag now, with nothing written.
TEST(Tokenize, AnOutputThatIsADirectoryIsRefusedLeavingNoStrayFile) {
  TempDir d;
  const auto docs = tokenize_docs(d, 2);
  const std::string dir = d.file("DIR");
  ASSERT_EQ(::mkdir(dir.c_str(), 0755), 0);
  const auto before = sorted_entries(d.path());
  for (const auto& [flag, args] : std::vector<std::pair<std::string, std::vector<std::string>>>{
           {"--out", {"--out", dir, docs[0]}},
           {"--val-out", {"--out", d.file("x.bin"), "--val-out", dir, docs[0], docs[1]}},
           {"--save-tokenizer", {"--save-tokenizer", dir, "--out", d.file("x.bin"), docs[0]}}}) {
    std::vector<std::string> argv = {"tokenize", "--train-bpe", "300"};
    argv.insert(argv.end(), args.begin(), args.end());
    auto r = run_keel(argv, {}, 120);
    EXPECT_EQ(r.exit_code, 2) << flag << "\n" << r.output;
    EXPECT_NE(r.output.find(flag + " " + dir + ": is a directory"), std::string::npos) << r.output;
    EXPECT_EQ(sorted_entries(d.path()), before) << flag;
    EXPECT_TRUE(entries(dir).empty()) << flag;
  }
}

// An end-of-text token asked for by name that the tokenizer does not have is exit 2 naming
// --eot (issue 44, item 5: documents were silently left unseparated); the default one missing is
// said on stderr; one the vocabulary has separates every document.
TEST(Tokenize, AnEndOfTextTokenTheVocabularyLacksIsRefusedWhenNamedAndSaidWhenDefault) {
  TempDir d;
  const auto docs = tokenize_docs(d, 2);
  auto trained = run_keel(
      {"tokenize", "--train-bpe", "300", "--eot", "<|sep|>", "--out", d.file("a.bin"), docs[0], docs[1]}, {}, 120);
  ASSERT_EQ(trained.exit_code, 0) << trained.output;
  const std::string tokenizer = d.file("a.tokenizer.json");
  auto named = run_keel({"tokenize", "--tokenizer", tokenizer, "--eot", "<|other|>", "--out", d.file("b.bin"), docs[0]},
                        {}, 120);
  EXPECT_EQ(named.exit_code, 2) << named.output;
  EXPECT_NE(named.output.find("--eot '<|other|>': not a token of the tokenizer's vocabulary"), std::string::npos)
      << named.output;
  EXPECT_FALSE(keel::testing::exists(d.file("b.bin")));
  auto dflt = run_keel({"tokenize", "--tokenizer", tokenizer, "--out", d.file("c.bin"), docs[0], docs[1]}, {}, 120);
  EXPECT_EQ(dflt.exit_code, 0) << dflt.output;
  EXPECT_NE(dflt.output.find("the vocabulary has no '<|endoftext|>': documents are not separated"), std::string::npos)
      << dflt.output;
  auto own = run_keel(
      {"tokenize", "--tokenizer", tokenizer, "--eot", "<|sep|>", "--out", d.file("e.bin"), docs[0], docs[1]}, {}, 120);
  EXPECT_EQ(own.exit_code, 0) << own.output;
  // Two separators more than the default run's tokens: one before each document.
  const auto size = [](const std::string& f) { return static_cast<int64_t>(std::filesystem::file_size(f)); };
  EXPECT_EQ(size(d.file("e.bin")) - size(d.file("c.bin")), 2 * 2) << "two uint16 separators";
}
