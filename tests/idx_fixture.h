// Writes small Fashion-MNIST-shaped datasets (gzipped IDX files) for tests.
#pragma once

#include <zlib.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace keel::testing {

inline std::vector<uint8_t> idx_bytes(uint32_t magic, const std::vector<uint32_t>& dims, uint8_t fill_mod) {
  std::vector<uint8_t> out;
  auto put32 = [&](uint32_t v) {
    for (int s = 24; s >= 0; s -= 8) out.push_back(uint8_t(v >> s));
  };
  put32(magic);
  size_t n = 1;
  for (auto d : dims) put32(d), n *= d;
  for (size_t i = 0; i < n; ++i) out.push_back(uint8_t((i * 7 + i / 13) % fill_mod));
  return out;
}

inline void write_gz(const std::string& path, const std::vector<uint8_t>& bytes) {
  gzFile f = gzopen(path.c_str(), "wb");
  if (!f) throw std::runtime_error("gzopen " + path);
  gzwrite(f, bytes.data(), unsigned(bytes.size()));
  gzclose(f);
}

/// A complete small dataset in `dir`: n_train / n_test images with labels in [0, 10).
inline void write_small_fashion_mnist(const std::string& dir, uint32_t n_train = 256, uint32_t n_test = 64) {
  write_gz(dir + "/train-images-idx3-ubyte.gz", idx_bytes(0x803, {n_train, 28, 28}, 251));
  write_gz(dir + "/train-labels-idx1-ubyte.gz", idx_bytes(0x801, {n_train}, 10));
  write_gz(dir + "/t10k-images-idx3-ubyte.gz", idx_bytes(0x803, {n_test, 28, 28}, 251));
  write_gz(dir + "/t10k-labels-idx1-ubyte.gz", idx_bytes(0x801, {n_test}, 10));
}

}  // namespace keel::testing
