// Built-in datasets: fashion_mnist (gzipped IDX files of Debian's dataset-fashion-mnist), text
// (byte-level language-model windows of any file) and synthetic (deterministic from the seed,
// shaped for whichever model is chosen, and learnable so that a falling loss means something).
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <cstring>

#include "common/file.h"
#include "keel/trainer/data/data.h"

namespace keel::data {
namespace {

bool is_dir(const std::string& p) {
  struct stat st;
  return ::stat(p.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

torch::Tensor to_index_tensor(const std::vector<int64_t>& idx) {
  return torch::from_blob(const_cast<int64_t*>(idx.data()), {static_cast<int64_t>(idx.size())}, torch::kLong).clone();
}

// Reads a whole file, gunzipping it when its name ends in .gz. zlib errors (corrupt or
// truncated stream) become InputErrors naming the file.
std::vector<uint8_t> read_maybe_gz(const std::string& path) {
  constexpr size_t kMaxBytes = size_t(1) << 31;  // refuse decompression bombs
  uint64_t size = 0;
  int fd = -1;
  try {
    fd = open_regular_file(path, size);  // a FIFO, device or directory is refused here
  } catch (const std::runtime_error& e) {
    throw InputError(e.what());
  }
  gzFile f = gzdopen(fd, "rb");
  if (!f) {
    ::close(fd);
    throw InputError(path + ": cannot open: " + std::strerror(errno));
  }
  std::vector<uint8_t> out;
  std::vector<uint8_t> chunk(1 << 20);
  for (;;) {
    int n = gzread(f, chunk.data(), static_cast<unsigned>(chunk.size()));
    if (n < 0) {
      int code = 0;
      std::string msg = gzerror(f, &code);
      gzclose(f);
      throw InputError(path + ": corrupt gzip data (zlib: " + msg + ")");
    }
    if (n == 0) break;
    out.insert(out.end(), chunk.begin(), chunk.begin() + n);
    if (out.size() > kMaxBytes) {
      gzclose(f);
      throw InputError(path + ": more than 2 GiB of data; not a dataset file keel reads");
    }
  }
  int code = 0;
  std::string msg = gzerror(f, &code);
  int rc = gzclose(f);
  if (code != Z_OK && code != Z_STREAM_END)
    throw InputError(path + ": corrupt or truncated gzip data (zlib: " + msg + ")");
  if (rc == Z_BUF_ERROR) throw InputError(path + ": truncated gzip file (zlib: unexpected end of file)");
  if (rc != Z_OK) throw InputError(path + ": gzip error on close (zlib code " + std::to_string(rc) + ")");
  return out;
}

uint32_t be32(const uint8_t* p) {
  return (uint32_t(p[0]) << 24) | (uint32_t(p[1]) << 16) | (uint32_t(p[2]) << 8) | uint32_t(p[3]);
}

std::string hex32(uint32_t v) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "0x%08x", v);
  return buf;
}

class ImageDataset : public Dataset {
 public:
  // images: (N, H, W) uint8 (normalised on the fly) or (N, C, H, W) float32 (used as is).
  ImageDataset(torch::Tensor images, torch::Tensor labels, double mean, double std)
      : images_(std::move(images)), labels_(std::move(labels)), mean_(mean), std_(std) {}
  int64_t size() const override { return images_.size(0); }
  Batch get(const std::vector<int64_t>& indices) const override {
    auto idx = to_index_tensor(indices);
    auto x = images_.index_select(0, idx);
    if (x.scalar_type() == torch::kByte)
      x = x.to(torch::kFloat).div_(255.0).sub_(mean_).div_(std_).unsqueeze(1);  // (B, 1, H, W)
    return {x, labels_.index_select(0, idx)};
  }

 private:
  torch::Tensor images_, labels_;
  double mean_, std_;
};

// Consecutive windows of T+1 tokens; sample i covers tokens [i*T, i*T + T].
class TokenWindows : public Dataset {
 public:
  TokenWindows(torch::Tensor tokens, int64_t T) : tokens_(std::move(tokens)), T_(T) {}
  int64_t size() const override { return (tokens_.size(0) - 1) / T_; }
  Batch get(const std::vector<int64_t>& indices) const override {
    std::vector<torch::Tensor> rows;
    rows.reserve(indices.size());
    for (int64_t i : indices) rows.push_back(tokens_.narrow(0, i * T_, T_ + 1));
    auto w = torch::stack(rows).to(torch::kLong);  // (B, T+1)
    return {w.narrow(1, 0, T_).contiguous(), w.narrow(1, 1, T_).contiguous()};
  }

 private:
  torch::Tensor tokens_;  // (n) uint8 or int64
  int64_t T_;
};

// Each synthetic sequence counts upwards modulo the vocabulary with its own start and stride.
class SyntheticTokens : public Dataset {
 public:
  SyntheticTokens(int64_t n, int64_t T, int64_t vocab, uint64_t seed) : T_(T), vocab_(vocab) {
    auto gen = at::detail::createCPUGenerator(seed);
    start_ = torch::randint(0, vocab, {n}, gen, torch::kLong);
    stride_ = torch::randint(1, std::min<int64_t>(8, vocab), {n}, gen, torch::kLong);
  }
  int64_t size() const override { return start_.size(0); }
  Batch get(const std::vector<int64_t>& indices) const override {
    auto idx = to_index_tensor(indices);
    auto t = torch::arange(T_ + 1, torch::kLong);
    auto w = (start_.index_select(0, idx).unsqueeze(1) + stride_.index_select(0, idx).unsqueeze(1) * t.unsqueeze(0))
                 .remainder(vocab_);
    return {w.narrow(1, 0, T_).contiguous(), w.narrow(1, 1, T_).contiguous()};
  }

 private:
  int64_t T_, vocab_;
  torch::Tensor start_, stride_;
};

}  // namespace

torch::Tensor read_idx(const std::string& path, uint32_t expect_magic, const std::vector<int64_t>& expect_dims) {
  auto bytes = read_maybe_gz(path);
  if (bytes.size() < 4) throw InputError(path + ": truncated IDX file (" + std::to_string(bytes.size()) + " bytes)");
  uint32_t magic = be32(bytes.data());
  if (magic != expect_magic)
    throw InputError(path + ": bad IDX magic number " + hex32(magic) + ", expected " + hex32(expect_magic));
  const size_t ndim = magic & 0xff;
  if (ndim != expect_dims.size() || bytes.size() < 4 + 4 * ndim) throw InputError(path + ": truncated IDX header");
  std::vector<int64_t> dims(ndim);
  int64_t count = 1;
  for (size_t i = 0; i < ndim; ++i) {
    dims[i] = be32(bytes.data() + 4 + 4 * i);
    if (expect_dims[i] >= 0 && dims[i] != expect_dims[i])
      throw InputError(path + ": IDX dimension " + std::to_string(i) + " is " + std::to_string(dims[i]) +
                       ", expected " + std::to_string(expect_dims[i]));
    count *= dims[i];
  }
  if (count == 0) throw InputError(path + ": the IDX file holds no items (a dimension is 0)");
  const size_t header = 4 + 4 * ndim;
  const size_t have = bytes.size() - header;
  if (have != static_cast<size_t>(count))
    throw InputError(path + ": IDX header announces " + std::to_string(count) + " bytes of data, file holds " +
                     std::to_string(have) + (have < static_cast<size_t>(count) ? " (truncated)" : " (trailing data)"));
  return torch::from_blob(bytes.data() + header, dims, torch::kByte).clone();
}

Splits make_fashion_mnist(const DataConfig& cfg, const models::InputSpec& spec) {
  const std::string dir = cfg.path.empty() ? "/usr/share/datasets/fashion-mnist" : cfg.path;
  if (!is_dir(dir))
    throw InputError("data.path = \"" + dir +
                     "\": directory not found (install Debian's dataset-fashion-mnist, "
                     "or point data.path at a directory with the four *-ubyte.gz files)");
  if (spec.num_classes < 10)
    throw InputError("fashion_mnist has 10 classes but the model outputs " + std::to_string(spec.num_classes));
  if (spec.sample_shape != std::vector<int64_t>{1, 28, 28})
    throw InputError("fashion_mnist gives (1, 28, 28) images; the model expects another shape");
  auto load = [&](const std::string& prefix) {
    auto images = read_idx(dir + "/" + prefix + "-images-idx3-ubyte.gz", 0x00000803, {-1, 28, 28});
    auto labels = read_idx(dir + "/" + prefix + "-labels-idx1-ubyte.gz", 0x00000801, {-1});
    if (labels.size(0) != images.size(0))
      throw InputError(dir + "/" + prefix + ": " + std::to_string(images.size(0)) + " images but " +
                       std::to_string(labels.size(0)) + " labels");
    if (labels.max().item<int64_t>() > 9) throw InputError(dir + "/" + prefix + "-labels-idx1-ubyte.gz: label above 9");
    // The Fashion-MNIST train-set mean and standard deviation of pixel values in [0, 1].
    return std::make_shared<ImageDataset>(images, labels.to(torch::kLong), 0.2860, 0.3530);
  };
  return {load("train"), load("t10k")};
}

Splits make_text(const DataConfig& cfg, const models::InputSpec& spec) {
  if (cfg.path.empty()) throw InputError("data.name = \"text\" needs data.path (any file; bytes are tokens)");
  if (spec.num_classes < 256)
    throw InputError("text data is byte-level (256 tokens) but model.vocab = " + std::to_string(spec.num_classes));
  const std::string raw = read_file(cfg.path, kMaxInputBytes);
  const int64_t T = spec.sample_shape.at(0);
  auto all = torch::from_blob(const_cast<char*>(raw.data()), {int64_t(raw.size())}, torch::kByte).clone();
  const int64_t n = all.size(0);
  const int64_t n_test = cfg.test_fraction > 0 ? std::max<int64_t>(T + 1, int64_t(n * cfg.test_fraction)) : 0;
  if (n - n_test < T + 1)
    throw InputError(cfg.path + ": " + std::to_string(n) + " bytes is too short for one train window of " +
                     std::to_string(T + 1) + " bytes" + (n_test ? " plus the held-out tail" : ""));
  Splits s;
  s.train = std::make_shared<TokenWindows>(all.narrow(0, 0, n - n_test), T);
  if (n_test) s.test = std::make_shared<TokenWindows>(all.narrow(0, n - n_test, n_test), T);
  return s;
}

Splits make_synthetic(const DataConfig& cfg, const models::InputSpec& spec, int64_t seed) {
  const int64_t n = cfg.synthetic_size;
  const int64_t n_test = std::max<int64_t>(1, n / 4);
  const uint64_t s = static_cast<uint64_t>(seed) * 1000003ull + 17;
  if (spec.kind == models::InputKind::Tokens) {
    const int64_t T = spec.sample_shape.at(0);
    return {std::make_shared<SyntheticTokens>(n, T, spec.num_classes, s),
            std::make_shared<SyntheticTokens>(n_test, T, spec.num_classes, s + 1)};
  }
  // Images: Gaussian noise labelled by a fixed random linear rule (argmax of x @ W), so a model
  // can learn it and generalise to the test split.
  std::vector<int64_t> shape = {0};
  shape.insert(shape.end(), spec.sample_shape.begin(), spec.sample_shape.end());
  int64_t features = 1;
  for (auto d : spec.sample_shape) features *= d;
  auto rule = torch::randn({features, spec.num_classes}, at::detail::createCPUGenerator(s + 2));
  auto make = [&](int64_t count, uint64_t gseed) {
    shape[0] = count;
    auto x = torch::randn(shape, at::detail::createCPUGenerator(gseed));
    auto y = torch::matmul(x.view({count, features}), rule).argmax(1);
    return std::make_shared<ImageDataset>(x, y, 0.0, 1.0);
  };
  return {make(n, s), make(n_test, s + 1)};
}

}  // namespace keel::data
