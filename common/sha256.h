// common/sha256.h: SHA-256 (OpenSSL EVP), streamed or of a whole string. The one
// implementation keel hashes with: checkpoint checksums, the config hash in meta.json, the
// compile cache's keys.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

namespace keel {

class Sha256 {
 public:
  Sha256();
  ~Sha256();
  Sha256(const Sha256&) = delete;
  Sha256& operator=(const Sha256&) = delete;
  void update(const void* data, size_t n);
  /// Lower-case hex digest; the object is finished afterwards.
  std::string hex();

 private:
  struct Ctx;
  std::unique_ptr<Ctx> ctx_;
};

/// SHA-256 of `bytes`, lower-case hex.
std::string sha256_hex(const std::string& bytes);

}  // namespace keel
