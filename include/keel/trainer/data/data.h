// keel/trainer/data/data.h: datasets and the registry that builds one by name.
//
// Owns: the Dataset interface (random access to (input, target) samples, batched), the
// train/test split of a dataset, and the name -> factory registry (fashion_mnist, text,
// synthetic built in; users add their own with register_dataset()).
// Does not own: the order samples are visited in (trainer/data/sampler.h), devices (the trainer
// moves batches), or models (models/model.h says what input a model expects).
#pragma once

#include <torch/torch.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "keel/models/model.h"
#include "keel/trainer/config/config.h"

namespace keel::data {

/// One batch on the CPU, shaped as models::InputSpec says.
struct Batch {
  torch::Tensor input;   // (B, C, H, W) float32 or (B, T) int64
  torch::Tensor target;  // (B) int64 or (B, T) int64
};

/// A split of a dataset with random access. Implementations must be thread-compatible
/// (concurrent get() calls on a const dataset are safe).
class Dataset {
 public:
  virtual ~Dataset() = default;
  virtual int64_t size() const = 0;
  /// Gathers the samples at `indices` (each in [0, size())) into one batch.
  virtual Batch get(const std::vector<int64_t>& indices) const = 0;
};

struct Splits {
  std::shared_ptr<Dataset> train;
  std::shared_ptr<Dataset> test;
};

/// Builds a dataset's splits for a model that eats `spec`; `seed` is run.seed. Throws
/// keel::InputError for missing or malformed data (naming the file) and for a model whose
/// input the dataset cannot produce.
using DatasetFactory = std::function<Splits(const DataConfig& cfg, const models::InputSpec& spec, int64_t seed)>;

/// Registers a dataset under `name`; throws std::invalid_argument when the name is empty or
/// already taken. `native_kind` is the input kind it produces by nature
/// (images for fashion_mnist), or nullopt if it follows the model (synthetic).
void register_dataset(const std::string& name, DatasetFactory factory,
                      std::optional<models::InputKind> native_kind = std::nullopt);
std::vector<std::string> registered_datasets();
/// The native input kind of a registered dataset; throws InputError for an unknown name.
std::optional<models::InputKind> native_input_kind(const std::string& name);
Splits create_dataset(const DataConfig& cfg, const models::InputSpec& spec, int64_t seed);

// Built-ins, exposed for tests.
Splits make_fashion_mnist(const DataConfig& cfg, const models::InputSpec& spec);
Splits make_text(const DataConfig& cfg, const models::InputSpec& spec);
Splits make_synthetic(const DataConfig& cfg, const models::InputSpec& spec, int64_t seed);

/// Reads an IDX file (gzipped if the name ends in .gz) and checks its magic number and
/// dimensions: `expect_dims` = {N?, 28, 28} with -1 for "any". Returns a uint8 tensor.
torch::Tensor read_idx(const std::string& path, uint32_t expect_magic, const std::vector<int64_t>& expect_dims);

}  // namespace keel::data
