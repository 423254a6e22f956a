// trainer/compile/compile_cache.h: the persistent compile cache (compile.cache_dir).
//
// Owns: the cache key (SHA-256 over everything that determines a traced graph: the model's
// identity with its config, or a TorchScript file's bytes; the input shape and dtype; the
// device; the LibTorch and keel versions; the compile options and autocast dtype), and the
// entries: the graph serialized as a TorchScript module (torch::jit::Module::save) with a
// metadata file inside it, published atomically (temp name, fsync, rename) so that concurrent
// ranks and nodes sharing the directory never read half an entry. A corrupt or mismatched
// entry is reported, removed and rebuilt by the caller.
#pragma once

#include <torch/torch.h>

#include <memory>
#include <string>

#include "common/sha256.h"
#include "keel/trainer/config/config.h"

namespace torch::jit {
struct Graph;
}

namespace keel {

/// The cache key for tracing the model described by `model_identity` from `example`: also
/// keel's and LibTorch's versions, the compile options, and the SHA-256 of the running
/// executable (the code of every model, built-in or registered). "" when the executable
/// cannot be read: then nothing is cached.
std::string compile_cache_key(const std::string& model_identity, const CompileConfig& cfg, const torch::Tensor& example,
                              const std::string& amp_dtype);

class CompileCache {
 public:
  explicit CompileCache(std::string dir);
  /// The graph stored under `key`, or nullptr (a miss). A corrupt entry is logged, removed
  /// and reported as a miss.
  std::shared_ptr<torch::jit::Graph> load(const std::string& key) const;
  /// Publishes `graph` under `key` atomically. Failures are logged, not thrown: a cache that
  /// cannot be written costs time, not correctness.
  void store(const std::string& key, torch::jit::Graph& graph, const std::string& meta_json) const;
  std::string entry_path(const std::string& key) const { return dir_ + "/" + key + ".pt"; }

 private:
  std::string dir_;
};

}  // namespace keel
