// Data readers: valid IDX files load; truncated, corrupt or mislabelled files give a clear
// error naming the file; text and synthetic datasets are shaped and deterministic.
#include <gtest/gtest.h>
#include <unistd.h>

#include "helpers.h"
#include "idx_fixture.h"
#include "keel/trainer/data/data.h"
#include "trainer/data/token_file.h"

using keel::InputError;
using keel::testing::TempDir;
using namespace keel::testing;

namespace {

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const InputError& e) {
    return e.what();
  }
  return "";
}

keel::models::InputSpec image_spec() { return {keel::models::InputKind::Image, {1, 28, 28}, 10}; }
keel::models::InputSpec token_spec(int64_t T) { return {keel::models::InputKind::Tokens, {T}, 256}; }

TEST(FashionMnist, LoadsSmallDataset) {
  TempDir d;
  write_small_fashion_mnist(d.path(), 100, 30);
  keel::DataConfig cfg;
  cfg.path = d.path();
  auto s = keel::data::make_fashion_mnist(cfg, image_spec());
  EXPECT_EQ(s.train->size(), 100);
  EXPECT_EQ(s.test->size(), 30);
  auto b = s.train->get({0, 5, 99});
  EXPECT_EQ(b.input.sizes(), (std::vector<int64_t>{3, 1, 28, 28}));
  EXPECT_EQ(b.input.scalar_type(), torch::kFloat);
  EXPECT_EQ(b.target.sizes(), (std::vector<int64_t>{3}));
  EXPECT_EQ(b.target.scalar_type(), torch::kLong);
  // Pixel 0 of sample 0 is 0 -> (0 - mean) / std.
  EXPECT_NEAR(b.input[0][0][0][0].item<float>(), (0.0 - 0.2860) / 0.3530, 1e-6);
}

TEST(FashionMnist, RealDatasetIfInstalled) {
  if (!exists("/usr/share/datasets/fashion-mnist/t10k-images-idx3-ubyte.gz"))
    GTEST_SKIP() << "dataset-fashion-mnist is not installed (scripts/setup.sh installs it)";
  auto images =
      keel::data::read_idx("/usr/share/datasets/fashion-mnist/t10k-images-idx3-ubyte.gz", 0x803, {-1, 28, 28});
  auto labels = keel::data::read_idx("/usr/share/datasets/fashion-mnist/t10k-labels-idx1-ubyte.gz", 0x801, {-1});
  EXPECT_EQ(images.size(0), 10000);
  EXPECT_EQ(labels.size(0), 10000);
  // Balanced classes: 1000 test images per class.
  auto counts = torch::bincount(labels.to(torch::kLong).flatten());
  for (int c = 0; c < 10; ++c) EXPECT_EQ(counts[c].item<int64_t>(), 1000);
}

TEST(FashionMnist, TruncatedGzip) {
  TempDir d;
  write_small_fashion_mnist(d.path());
  std::string gz = read_text(d.file("train-labels-idx1-ubyte.gz"));
  write_text(d.file("train-labels-idx1-ubyte.gz"), gz.substr(0, gz.size() - 12));
  keel::DataConfig cfg;
  cfg.path = d.path();
  auto msg = error_of([&] { keel::data::make_fashion_mnist(cfg, image_spec()); });
  EXPECT_NE(msg.find("train-labels-idx1-ubyte.gz"), std::string::npos) << msg;
}

TEST(FashionMnist, CorruptGzip) {
  TempDir d;
  write_small_fashion_mnist(d.path());
  std::string gz = read_text(d.file("t10k-images-idx3-ubyte.gz"));
  for (size_t i = 20; i < gz.size() - 10; i += 7) gz[i] = char(gz[i] ^ 0x5a);
  write_text(d.file("t10k-images-idx3-ubyte.gz"), gz);
  keel::DataConfig cfg;
  cfg.path = d.path();
  auto msg = error_of([&] { keel::data::make_fashion_mnist(cfg, image_spec()); });
  EXPECT_NE(msg.find("t10k-images-idx3-ubyte.gz"), std::string::npos) << msg;
}

TEST(FashionMnist, NotGzipAtAll) {
  TempDir d;
  write_small_fashion_mnist(d.path());
  write_text(d.file("train-images-idx3-ubyte.gz"), "hello, this is not a dataset");
  keel::DataConfig cfg;
  cfg.path = d.path();
  auto msg = error_of([&] { keel::data::make_fashion_mnist(cfg, image_spec()); });
  EXPECT_NE(msg.find("train-images-idx3-ubyte.gz"), std::string::npos) << msg;
}

// Hardening class 11: a well-formed IDX file with zero items is named, not a torch error.
TEST(FashionMnist, ZeroItemsNamesTheFile) {
  TempDir d;
  write_small_fashion_mnist(d.path());
  write_gz(d.file("train-images-idx3-ubyte.gz"), idx_bytes(0x803, {0, 28, 28}, 10));
  write_gz(d.file("train-labels-idx1-ubyte.gz"), idx_bytes(0x801, {0}, 10));
  keel::DataConfig cfg;
  cfg.path = d.path();
  auto msg = error_of([&] { keel::data::make_fashion_mnist(cfg, image_spec()); });
  EXPECT_NE(msg.find("idx3-ubyte.gz: the IDX file holds no items"), std::string::npos) << msg;
}

TEST(FashionMnist, WrongMagic) {
  TempDir d;
  write_small_fashion_mnist(d.path());
  write_gz(d.file("train-images-idx3-ubyte.gz"), idx_bytes(0x801, {256}, 10));  // a label file
  keel::DataConfig cfg;
  cfg.path = d.path();
  auto msg = error_of([&] { keel::data::make_fashion_mnist(cfg, image_spec()); });
  EXPECT_NE(msg.find("bad IDX magic number 0x00000801, expected 0x00000803"), std::string::npos) << msg;
}

TEST(FashionMnist, WrongDimensions) {
  TempDir d;
  write_small_fashion_mnist(d.path());
  write_gz(d.file("train-images-idx3-ubyte.gz"), idx_bytes(0x803, {256, 32, 32}, 251));
  keel::DataConfig cfg;
  cfg.path = d.path();
  auto msg = error_of([&] { keel::data::make_fashion_mnist(cfg, image_spec()); });
  EXPECT_NE(msg.find("dimension 1 is 32, expected 28"), std::string::npos) << msg;
}

TEST(FashionMnist, DataShorterThanHeaderSays) {
  TempDir d;
  write_small_fashion_mnist(d.path());
  auto bytes = idx_bytes(0x803, {256, 28, 28}, 251);
  bytes.resize(bytes.size() - 100);  // a valid gzip stream of a truncated IDX file
  write_gz(d.file("train-images-idx3-ubyte.gz"), bytes);
  keel::DataConfig cfg;
  cfg.path = d.path();
  auto msg = error_of([&] { keel::data::make_fashion_mnist(cfg, image_spec()); });
  EXPECT_NE(msg.find("(truncated)"), std::string::npos) << msg;
}

TEST(FashionMnist, CountMismatchBetweenImagesAndLabels) {
  TempDir d;
  write_small_fashion_mnist(d.path());
  write_gz(d.file("train-labels-idx1-ubyte.gz"), idx_bytes(0x801, {255}, 10));
  keel::DataConfig cfg;
  cfg.path = d.path();
  auto msg = error_of([&] { keel::data::make_fashion_mnist(cfg, image_spec()); });
  EXPECT_NE(msg.find("256 images but 255 labels"), std::string::npos) << msg;
}

TEST(FashionMnist, MissingDirectory) {
  keel::DataConfig cfg;
  cfg.path = "/nonexistent/dir";
  auto msg = error_of([&] { keel::data::make_fashion_mnist(cfg, image_spec()); });
  EXPECT_NE(msg.find("directory not found"), std::string::npos) << msg;
}

TEST(TextData, WindowsAreShiftedByOne) {
  TempDir d;
  std::string text;
  for (int i = 0; i < 1000; ++i) text += char('a' + i % 26);
  write_text(d.file("t.txt"), text);
  keel::DataConfig cfg;
  cfg.path = d.file("t.txt");
  cfg.test_fraction = 0.1;
  auto s = keel::data::make_text(cfg, token_spec(16));
  EXPECT_EQ(s.train->size(), (900 - 1) / 16);
  EXPECT_EQ(s.test->size(), (100 - 1) / 16);
  auto b = s.train->get({0, 2});
  EXPECT_EQ(b.input.sizes(), (std::vector<int64_t>{2, 16}));
  EXPECT_TRUE(torch::equal(b.input.narrow(1, 1, 15), b.target.narrow(1, 0, 15)));
  EXPECT_EQ(b.input[1][0].item<int64_t>(), 'a' + (32 % 26));
}

TEST(TextData, TooShortFile) {
  TempDir d;
  write_text(d.file("t.txt"), "tiny");
  keel::DataConfig cfg;
  cfg.path = d.file("t.txt");
  EXPECT_NE(error_of([&] { keel::data::make_text(cfg, token_spec(16)); }).find("too short"), std::string::npos);
}

// An llm.c file cut short (its header announces more tokens than it holds) is refused whatever
// data.token_dtype says (issue 44, item 5: with an explicit dtype it was read as raw tokens,
// the header's 1024 bytes first).
TEST(TokenFiles, ATruncatedLlmcFileIsRefusedAlsoWithAnExplicitDtype) {
  TempDir d;
  std::vector<uint32_t> tokens(1000, 7);
  write_token_file(d.file("cut.bin"), tokens, 2, true, /*count=*/2000);
  for (const auto dtype : {keel::TokenDtype::Auto, keel::TokenDtype::Uint16}) {
    keel::DataConfig cfg;
    cfg.name = "tokens";
    cfg.path = d.file("cut.bin");
    cfg.token_dtype = dtype;
    const auto msg = error_of([&] { keel::data::make_tokens(cfg, token_spec(16)); });
    EXPECT_NE(msg.find(d.file("cut.bin")), std::string::npos) << msg;
    EXPECT_NE(msg.find("header announces 2000"), std::string::npos) << msg;
  }
}

// Token files (data.name = "tokens"): llm.c's .bin with 2- and 4-byte tokens and raw files of
// either width give the same windows, T + 1 tokens from i * T, targets shifted by one.
TEST(TokenFiles, LlmcAndRawFilesGiveTheSameWindows) {
  TempDir d;
  std::vector<uint32_t> tokens;
  for (uint32_t i = 0; i < 1000; ++i) tokens.push_back((i * 7) % 250);
  write_token_file(d.file("a.bin"), tokens, 2, true);
  write_token_file(d.file("b.bin"), tokens, 4, true);
  write_token_file(d.file("c.u16"), tokens, 2, false);
  write_token_file(d.file("d.u32"), tokens, 4, false);
  std::vector<keel::data::Batch> batches;
  for (const auto& [file, dtype] : std::vector<std::pair<std::string, keel::TokenDtype>>{
           {"a.bin", keel::TokenDtype::Auto},
           {"b.bin", keel::TokenDtype::Auto},
           {"a.bin", keel::TokenDtype::Uint16},  // an explicit width that agrees with the header
           {"c.u16", keel::TokenDtype::Uint16},
           {"d.u32", keel::TokenDtype::Uint32}}) {
    keel::DataConfig cfg;
    cfg.name = "tokens";
    cfg.path = d.file(file);
    cfg.token_dtype = dtype;
    cfg.test_fraction = 0.1;
    auto s = keel::data::make_tokens(cfg, token_spec(16));
    ASSERT_EQ(s.train->size() + s.test->size(), (1000 - 1) / 16) << file;
    EXPECT_EQ(s.test->size(), 6) << file;  // the tail: 10% of 62 windows
    batches.push_back(s.train->get({0, 3}));
    auto t = s.test->get({0});
    EXPECT_EQ(t.input[0][0].item<int64_t>(), tokens[56 * 16]) << file;
  }
  for (const auto& b : batches) {
    ASSERT_EQ(b.input.sizes(), (std::vector<int64_t>{2, 16}));
    EXPECT_EQ(b.input.scalar_type(), torch::kLong);
    EXPECT_TRUE(torch::equal(b.input, batches[0].input));
    EXPECT_TRUE(torch::equal(b.target, batches[0].target));
    EXPECT_TRUE(torch::equal(b.input.narrow(1, 1, 15), b.target.narrow(1, 0, 15)));
    EXPECT_EQ(b.input[1][0].item<int64_t>(), tokens[48]);
    EXPECT_EQ(b.target[1][15].item<int64_t>(), tokens[64]);
  }
}

// A glob of shards is one corpus, in name order; windows never span two files; data.test_path
// gives the held-out split (all of data.path trains).
TEST(TokenFiles, ShardsAreOneCorpusAndATestFileIsHeldOut) {
  TempDir d;
  auto seq = [](uint32_t from, uint32_t n) {
    std::vector<uint32_t> v;
    for (uint32_t i = 0; i < n; ++i) v.push_back(from + i);
    return v;
  };
  write_token_file(d.file("train_001.bin"), seq(100, 50), 2, true);  // 3 windows of 17
  write_token_file(d.file("train_000.bin"), seq(0, 100), 2, true);   // 6
  write_token_file(d.file("train_002.bin"), seq(200, 10), 2, true);  // none
  write_token_file(d.file("val.bin"), seq(300, 40), 4, true);        // 2, another width
  keel::DataConfig cfg;
  cfg.name = "tokens";
  cfg.path = d.file("train_*.bin");
  cfg.test_path = d.file("val.bin");
  keel::models::InputSpec spec = token_spec(16);
  spec.num_classes = 512;
  auto s = keel::data::make_tokens(cfg, spec);
  EXPECT_EQ(s.train->size(), 9);
  EXPECT_EQ(s.test->size(), 2);
  auto b = s.train->get({5, 6, 8});
  EXPECT_EQ(b.input[0][0].item<int64_t>(), 80);   // train_000, window 5
  EXPECT_EQ(b.input[1][0].item<int64_t>(), 100);  // train_001 starts a window of its own
  EXPECT_EQ(b.target[2][15].item<int64_t>(), 100 + 2 * 16 + 16);
  EXPECT_EQ(s.test->get({1}).input[0][0].item<int64_t>(), 316);
}

// Every file is checked at start, never read whole: a bad header, a size that does not fit it,
// a token the model's vocabulary does not have, or no file at all is an InputError naming it.
TEST(TokenFiles, BadFilesAreRefusedAtStartNamingThem) {
  TempDir d;
  std::vector<uint32_t> tokens(200, 7);
  auto error = [&](const std::string& path, keel::TokenDtype dtype = keel::TokenDtype::Auto, int64_t vocab = 256) {
    keel::DataConfig cfg;
    cfg.name = "tokens";
    cfg.path = path;
    cfg.token_dtype = dtype;
    keel::models::InputSpec spec = token_spec(16);
    spec.num_classes = vocab;
    return error_of([&] { keel::data::make_tokens(cfg, spec); });
  };
  write_token_file(d.file("raw.u16"), std::vector<uint32_t>(1000, 7), 2, false);
  write_token_file(d.file("small.u16"), tokens, 2, false);
  EXPECT_NE(error(d.file("small.u16")).find("too short for llm.c's 1024-byte header (400 bytes)"), std::string::npos)
      << error(d.file("small.u16"));
  EXPECT_NE(error(d.file("raw.u16")).find(d.file("raw.u16") + ": not an llm.c token file"), std::string::npos)
      << error(d.file("raw.u16"));
  EXPECT_NE(error(d.file("raw.u16")).find("set data.token_dtype = \"uint16\" or \"uint32\""), std::string::npos);
  write_token_file(d.file("v3.bin"), tokens, 2, true, -1, 3);
  EXPECT_NE(error(d.file("v3.bin")).find("llm.c magic 20240520 with version 3, expected 1"), std::string::npos)
      << error(d.file("v3.bin"));
  write_token_file(d.file("short.bin"), tokens, 2, true, 300);
  EXPECT_NE(error(d.file("short.bin"))
                .find("announces 300 uint16 tokens (1624 bytes with the header) but the file "
                      "holds 1424 bytes (truncated)"),
            std::string::npos)
      << error(d.file("short.bin"));
  write_token_file(d.file("long.bin"), tokens, 4, true, 100);
  EXPECT_NE(error(d.file("long.bin")).find("(trailing data)"), std::string::npos) << error(d.file("long.bin"));
  write_text(d.file("odd.u16"), std::string(201, 'x'));
  EXPECT_NE(error(d.file("odd.u16"), keel::TokenDtype::Uint16).find("201 bytes is not a whole number of uint16 tokens"),
            std::string::npos);
  write_token_file(d.file("ok.bin"), tokens, 2, true);
  EXPECT_NE(error(d.file("ok.bin"), keel::TokenDtype::Uint32)
                .find("data.token_dtype = \"uint32\" but it is an llm.c file of uint16 tokens"),
            std::string::npos)
      << error(d.file("ok.bin"), keel::TokenDtype::Uint32);
  EXPECT_EQ(error(d.file("ok.bin")), "");
  tokens[123] = 300;
  write_token_file(d.file("vocab.bin"), tokens, 2, true);
  EXPECT_NE(error(d.file("vocab.bin"))
                .find(d.file("vocab.bin") + ": token 300 at position 123 is outside the model's vocabulary of 256"),
            std::string::npos)
      << error(d.file("vocab.bin"));
  EXPECT_EQ(error(d.file("vocab.bin"), keel::TokenDtype::Auto, 301), "");
  EXPECT_NE(error(d.file("nope_*.bin")).find("data.path = \"" + d.file("nope_*.bin") + "\": no file matches"),
            std::string::npos);
  EXPECT_NE(error(d.file("missing.bin")).find(d.file("missing.bin")), std::string::npos);
  EXPECT_NE(error(d.path()).find("directory"), std::string::npos) << error(d.path());
  write_token_file(d.file("tiny.bin"), std::vector<uint32_t>(16, 1), 2, true);
  EXPECT_NE(error(d.file("tiny.bin")).find("no file holds a window of 17 tokens"), std::string::npos)
      << error(d.file("tiny.bin"));
  write_token_file(d.file("empty.bin"), {}, 2, true);
  EXPECT_NE(error(d.file("empty.bin")).find("holds no tokens"), std::string::npos) << error(d.file("empty.bin"));
  EXPECT_NE(error("").find("needs data.path"), std::string::npos);
}

// A token file checked at start and truncated under the run (rewritten in place by another job)
// is a runtime_error naming the file when a window it no longer holds is read: a mapping of
// the file would have killed the process with SIGBUS.
TEST(TokenFiles, AFileTruncatedUnderTheRunIsAnErrorNamingItNotASignal) {
  TempDir d;
  std::vector<uint32_t> tokens;
  for (uint32_t i = 0; i < 5000; ++i) tokens.push_back(i % 200);
  write_token_file(d.file("t.bin"), tokens, 2, true);
  keel::DataConfig cfg;
  cfg.name = "tokens";
  cfg.path = d.file("t.bin");
  cfg.test_fraction = 0;
  auto s = keel::data::make_tokens(cfg, token_spec(16));
  ASSERT_EQ(s.train->size(), (5000 - 1) / 16);
  EXPECT_EQ(s.train->get({200}).input[0][0].item<int64_t>(), (200 * 16) % 200);
  ASSERT_EQ(::truncate(d.file("t.bin").c_str(), 1024 + 2 * 100), 0);  // 100 tokens left, in the first page
  EXPECT_EQ(s.train->get({2}).target[0][15].item<int64_t>(), 48);     // still there
  try {
    s.train->get({200});  // bytes 7424-7457: a page wholly past the new end (a mapping's SIGBUS)
    ADD_FAILURE() << "read a window the file no longer holds";
  } catch (const std::runtime_error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find(d.file("t.bin") + ": cannot read 34 bytes at offset 7424"), std::string::npos) << what;
    EXPECT_NE(what.find("the file ends at 1224 bytes (truncated or rewritten since the run checked it at start)"),
              std::string::npos)
        << what;
  }
}

TEST(SyntheticData, DeterministicFromSeedAndShapedForModel) {
  keel::DataConfig cfg;
  cfg.synthetic_size = 64;
  auto a = keel::data::make_synthetic(cfg, image_spec(), 3);
  auto b = keel::data::make_synthetic(cfg, image_spec(), 3);
  auto c = keel::data::make_synthetic(cfg, image_spec(), 4);
  auto ba = a.train->get({1, 2, 3}), bb = b.train->get({1, 2, 3}), bc = c.train->get({1, 2, 3});
  EXPECT_TRUE(torch::equal(ba.input, bb.input));
  EXPECT_TRUE(torch::equal(ba.target, bb.target));
  EXPECT_FALSE(torch::equal(ba.input, bc.input));
  EXPECT_EQ(ba.input.sizes(), (std::vector<int64_t>{3, 1, 28, 28}));
  EXPECT_EQ(a.test->size(), 16);

  auto t = keel::data::make_synthetic(cfg, token_spec(8), 3);
  auto bt = t.train->get({0, 1});
  EXPECT_EQ(bt.input.sizes(), (std::vector<int64_t>{2, 8}));
  EXPECT_TRUE(torch::equal(bt.input.narrow(1, 1, 7), bt.target.narrow(1, 0, 7)));
  EXPECT_LT(bt.input.max().item<int64_t>(), 256);
}

TEST(DatasetRegistry, UserDatasetAndKindMismatch) {
  keel::data::register_dataset("ones", [](const keel::DataConfig&, const keel::models::InputSpec&, int64_t) {
    return keel::data::Splits{nullptr, nullptr};
  });
  keel::DataConfig cfg;
  cfg.name = "ones";
  EXPECT_NE(error_of([&] { keel::data::create_dataset(cfg, image_spec(), 0); }).find("train split is empty"),
            std::string::npos);
  cfg.name = "fashion_mnist";
  EXPECT_NE(error_of([&] { keel::data::create_dataset(cfg, token_spec(8), 0); }).find("expects tokens"),
            std::string::npos);
}

}  // namespace
