#include "trainer/data/token_file.h"

#include <glob.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <limits>
#include <stdexcept>

#include <ATen/Parallel.h>

#include "common/file.h"
#include "common/log.h"

namespace keel::data {
namespace {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "token files are little-endian");

constexpr int32_t kMagicUint16 = 20240520;  // llm.c, GPT-2 tokens: version 1
constexpr int32_t kMagicUint32 = 20240801;  // llm.c, Llama 3 tokens: version 7
constexpr size_t kHeaderBytes = 256 * sizeof(int32_t);

int width_of(TokenDtype d) { return d == TokenDtype::Uint32 ? 4 : 2; }
std::string dtype_name(int width) { return width == 4 ? "uint32" : "uint16"; }

// What an llm.c header says: the token width and count, or why it is not one keel reads.
struct Header {
  int width = 0;
  int64_t count = 0;
  std::string problem;  // "" when the header is consistent with the file's size
};

Header parse_header(const int32_t* h, uint64_t file_bytes) {
  Header r;
  const int32_t want_version = h[0] == kMagicUint16 ? 1 : 7;
  r.width = h[0] == kMagicUint16 ? 2 : 4;
  if (h[1] != want_version) {
    r.problem = "llm.c magic " + std::to_string(h[0]) + " with version " + std::to_string(h[1]) + ", expected " +
                std::to_string(want_version);
    return r;
  }
  r.count = h[2];
  const uint64_t want = kHeaderBytes + static_cast<uint64_t>(std::max<int32_t>(h[2], 0)) * r.width;
  if (h[2] < 0 || want != file_bytes)
    r.problem = "its header announces " + std::to_string(h[2]) + " " + dtype_name(r.width) + " tokens (" +
                std::to_string(want) + " bytes with the header) but the file holds " + std::to_string(file_bytes) +
                " bytes" + (file_bytes < want ? " (truncated)" : " (trailing data)");
  return r;
}

// Reads exactly `n` bytes at `offset`, or throws naming the file: a token file that shrinks
// under a run (truncated or rewritten in place) is an error, never a SIGBUS as a mapping gives.
void read_exactly(int fd, const std::string& path, uint64_t offset, size_t n, uint8_t* out) {
  size_t got = 0;
  while (got < n) {
    const ssize_t r = ::pread(fd, out + got, n - got, static_cast<off_t>(offset + got));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0)
      throw std::runtime_error(path + ": cannot read " + std::to_string(n) + " bytes at offset " +
                               std::to_string(offset) + ": " + std::strerror(errno));
    if (r == 0) {
      struct stat st {};
      const std::string now = ::fstat(fd, &st) == 0 ? "the file ends at " + std::to_string(st.st_size) + " bytes"
                                                    : "the file ends before them";
      throw std::runtime_error(path + ": cannot read " + std::to_string(n) + " bytes at offset " +
                               std::to_string(offset) + ": " + now +
                               " (truncated or rewritten since the run checked it at start)");
    }
    got += static_cast<size_t>(r);
  }
}

// The first token >= vocab among `count` tokens of `width` bytes from byte `begin` of `fd`: a
// parallel scan in 1 MiB chunks, or -1.
template <class T>
int64_t first_at_or_above_in(int fd, const std::string& path, uint64_t begin, int64_t count, int64_t vocab) {
  constexpr int64_t kChunk = (int64_t{1} << 20) / static_cast<int64_t>(sizeof(T));
  std::atomic<int64_t> first{std::numeric_limits<int64_t>::max()};
  at::parallel_for(0, (count + kChunk - 1) / kChunk, 1, [&](int64_t cb, int64_t ce) {
    std::vector<T> buf(static_cast<size_t>(kChunk));
    for (int64_t c = cb; c < ce; ++c) {
      const int64_t b = c * kChunk, n = std::min(kChunk, count - b);
      if (b >= first.load(std::memory_order_relaxed)) return;
      read_exactly(fd, path, begin + static_cast<uint64_t>(b) * sizeof(T), static_cast<size_t>(n) * sizeof(T),
                   reinterpret_cast<uint8_t*>(buf.data()));
      for (int64_t i = 0; i < n; ++i)
        if (static_cast<int64_t>(buf[static_cast<size_t>(i)]) >= vocab) {
          int64_t seen = first.load();
          while (b + i < seen && !first.compare_exchange_weak(seen, b + i)) {
          }
          return;
        }
    }
  });
  const int64_t f = first.load();
  return f == std::numeric_limits<int64_t>::max() ? -1 : f;
}

// T-token windows over a list of token files, global window indices [begin, end): file f holds
// windows offsets[f] .. offsets[f + 1] - 1, window i of a file its tokens [i * T, i * T + T].
class TokenCorpus : public Dataset {
 public:
  TokenCorpus(std::vector<std::shared_ptr<TokenFile>> files, std::vector<int64_t> offsets, int64_t T, int64_t begin,
              int64_t end)
      : files_(std::move(files)), offsets_(std::move(offsets)), T_(T), begin_(begin), end_(end) {}
  int64_t size() const override { return end_ - begin_; }
  Batch get(const std::vector<int64_t>& indices) const override {
    auto w = torch::empty({static_cast<int64_t>(indices.size()), T_ + 1}, torch::kLong);
    int64_t* out = w.data_ptr<int64_t>();
    for (size_t k = 0; k < indices.size(); ++k) {
      const int64_t g = begin_ + indices[k];
      const auto f = static_cast<size_t>(std::upper_bound(offsets_.begin(), offsets_.end(), g) - offsets_.begin() - 1);
      files_[f]->read((g - offsets_[f]) * T_, T_ + 1, out + static_cast<int64_t>(k) * (T_ + 1));
    }
    return {w.narrow(1, 0, T_).contiguous(), w.narrow(1, 1, T_).contiguous()};
  }

 private:
  std::vector<std::shared_ptr<TokenFile>> files_;
  std::vector<int64_t> offsets_;  // files_.size() + 1 entries
  int64_t T_, begin_, end_;
};

// Every file `pattern` names, opened and checked against the model's vocabulary; `offsets`
// gets the global window index each file starts at (and the total last).
std::vector<std::shared_ptr<TokenFile>> open_corpus(const std::string& pattern, const std::string& key,
                                                    const DataConfig& cfg, const models::InputSpec& spec,
                                                    std::vector<int64_t>& offsets) {
  const int64_t T = spec.sample_shape.at(0);
  std::vector<std::shared_ptr<TokenFile>> files;
  offsets = {0};
  // Every file stays open for the run (read with pread): a corpus of many shards may need more
  // descriptors than the default soft limit of 1024, so take what the hard limit allows.
  // (An unlimited hard limit is not a valid soft one: 2^20, the kernel's usual nr_open, then.
  // Failing to raise it is not an error; the open of a file past the limit names the file.)
  if (rlimit l{}; ::getrlimit(RLIMIT_NOFILE, &l) == 0 && l.rlim_cur < l.rlim_max) {
    l.rlim_cur = l.rlim_max == RLIM_INFINITY ? std::max<rlim_t>(l.rlim_cur, rlim_t{1} << 20) : l.rlim_max;
    if (::setrlimit(RLIMIT_NOFILE, &l) != 0)
      logging::debug("token files: open-file limit not raised: {}", std::strerror(errno));
  }
  std::string sizes;
  for (const auto& path : token_paths(pattern, key)) {
    auto f = std::make_shared<TokenFile>(path, cfg.token_dtype);
    if (const auto [at, token] = f->first_at_or_above(spec.num_classes); at >= 0)
      throw InputError(path + ": token " + std::to_string(token) + " at position " + std::to_string(at) +
                       " is outside the model's vocabulary of " + std::to_string(spec.num_classes) +
                       " tokens (model.vocab); the file was tokenized for another vocabulary");
    offsets.push_back(offsets.back() + (f->size() > T ? (f->size() - 1) / T : 0));
    sizes += (sizes.empty() ? "" : ", ") + path + ": " + std::to_string(f->size());
    files.push_back(std::move(f));
  }
  if (offsets.back() == 0)
    throw InputError(key + " = \"" + pattern + "\": no file holds a window of " + std::to_string(T + 1) +
                     " tokens (the model's sequence length + 1); tokens per file: " + sizes);
  return files;
}

}  // namespace

TokenFile::TokenFile(const std::string& path, TokenDtype dtype) : path_(path) {
  uint64_t bytes = 0;
  int fd = -1;
  try {
    fd = open_regular_file(path, bytes);
  } catch (const std::runtime_error& e) {
    throw InputError(e.what());
  }
  int32_t h[256] = {0};
  const bool magic = bytes >= kHeaderBytes && ::pread(fd, h, kHeaderBytes, 0) == static_cast<ssize_t>(kHeaderBytes) &&
                     (h[0] == kMagicUint16 || h[0] == kMagicUint32);
  const Header header = magic ? parse_header(h, bytes) : Header{};
  std::string problem;
  // A file that starts with llm.c's magic number is read as llm.c's, whatever data.token_dtype
  // says: one whose header does not fit its size (a truncated copy) is refused, never read as
  // raw tokens from its header bytes on.
  if (magic) {
    problem = header.problem;
    if (problem.empty() && dtype != TokenDtype::Auto && width_of(dtype) != header.width)
      problem = "data.token_dtype = \"" + dtype_name(width_of(dtype)) + "\" but it is an llm.c file of " +
                dtype_name(header.width) + " tokens";
    header_ = kHeaderBytes;
    width_ = header.width;
    count_ = header.count;
  } else if (dtype == TokenDtype::Auto) {
    problem = bytes < kHeaderBytes ? "too short for llm.c's 1024-byte header (" + std::to_string(bytes) + " bytes)"
                                   : "not an llm.c token file (it starts with " + std::to_string(h[0]) +
                                         ", not the magic number 20240520 or 20240801)";
    problem += "; for raw tokens without a header set data.token_dtype = \"uint16\" or \"uint32\"";
  } else {
    width_ = width_of(dtype);
    count_ = static_cast<int64_t>(bytes / width_);
    if (bytes % width_)
      problem = std::to_string(bytes) + " bytes is not a whole number of " + dtype_name(width_) + " tokens";
  }
  if (problem.empty() && count_ == 0) problem = "holds no tokens";
  if (!problem.empty()) {
    ::close(fd);
    throw InputError(path + ": " + problem);
  }
  fd_ = fd;
}

TokenFile::~TokenFile() {
  if (fd_ >= 0) ::close(fd_);
}

void TokenFile::read(int64_t start, int64_t n, int64_t* out) const {
  if (start < 0 || n < 0 || start + n > count_)
    throw std::out_of_range(path_ + ": tokens [" + std::to_string(start) + ", " + std::to_string(start + n) +
                            ") are outside its " + std::to_string(count_));
  std::vector<uint8_t> bytes(static_cast<size_t>(n) * static_cast<size_t>(width_));
  read_exactly(fd_, path_, header_ + static_cast<uint64_t>(start) * static_cast<uint64_t>(width_), bytes.size(),
               bytes.data());
  const uint8_t* p = bytes.data();
  if (width_ == 2) {
    for (int64_t i = 0; i < n; ++i) {
      uint16_t v;
      std::memcpy(&v, p + 2 * i, 2);
      out[i] = v;
    }
  } else {
    for (int64_t i = 0; i < n; ++i) {
      uint32_t v;
      std::memcpy(&v, p + 4 * i, 4);
      out[i] = v;
    }
  }
}

std::pair<int64_t, int64_t> TokenFile::first_at_or_above(int64_t vocab) const {
  const int64_t at = width_ == 2 ? first_at_or_above_in<uint16_t>(fd_, path_, header_, count_, vocab)
                                 : first_at_or_above_in<uint32_t>(fd_, path_, header_, count_, vocab);
  int64_t token = -1;
  if (at >= 0) read(at, 1, &token);
  return {at, token};
}

std::vector<std::string> token_paths(const std::string& pattern, const std::string& key) {
  if (pattern.find_first_of("*?[") == std::string::npos) return {pattern};
  glob_t g{};
  const int rc = ::glob(pattern.c_str(), GLOB_ERR, nullptr, &g);
  std::vector<std::string> out(g.gl_pathv, g.gl_pathv + g.gl_pathc);
  ::globfree(&g);
  if (rc != 0 || out.empty()) throw InputError(key + " = \"" + pattern + "\": no file matches");
  std::sort(out.begin(), out.end());
  return out;
}

Splits make_tokens(const DataConfig& cfg, const models::InputSpec& spec) {
  if (cfg.path.empty()) throw InputError("data.name = \"tokens\" needs data.path (a token file, or a glob of shards)");
  const int64_t T = spec.sample_shape.at(0);
  std::vector<int64_t> offsets;
  auto files = open_corpus(cfg.path, "data.path", cfg, spec, offsets);
  const int64_t n = offsets.back();
  Splits s;
  if (!cfg.test_path.empty()) {
    std::vector<int64_t> test_offsets;
    auto test = open_corpus(cfg.test_path, "data.test_path", cfg, spec, test_offsets);
    const int64_t n_test = test_offsets.back();
    s.test = std::make_shared<TokenCorpus>(std::move(test), std::move(test_offsets), T, 0, n_test);
    s.train = std::make_shared<TokenCorpus>(std::move(files), std::move(offsets), T, 0, n);
    return s;
  }
  const int64_t n_test = cfg.test_fraction > 0
                             ? std::max<int64_t>(1, static_cast<int64_t>(static_cast<double>(n) * cfg.test_fraction))
                             : 0;
  if (n - n_test < 1)
    throw InputError("data.path = \"" + cfg.path + "\": " + std::to_string(n) + " window(s) of " +
                     std::to_string(T + 1) + " tokens leave none to train on after data.test_fraction = " +
                     std::to_string(cfg.test_fraction) + " held out; give data.test_path or more tokens");
  if (n_test > 0) s.test = std::make_shared<TokenCorpus>(files, offsets, T, n - n_test, n);
  s.train = std::make_shared<TokenCorpus>(std::move(files), std::move(offsets), T, 0, n - n_test);
  return s;
}

}  // namespace keel::data
