#include "trainer/sampler.h"

#include <torch/torch.h>

#include <stdexcept>
#include <string>

namespace keel::data {

DistributedSampler::DistributedSampler(int64_t dataset_size, int64_t world, int64_t rank,
                                       int64_t batch_size, bool shuffle, bool drop_last,
                                       uint64_t seed)
    : size_(dataset_size), world_(world), rank_(rank), batch_(batch_size), shuffle_(shuffle),
      drop_last_(drop_last), seed_(seed) {
  if (world < 1 || rank < 0 || rank >= world || batch_size < 1 || dataset_size < 1)
    throw std::invalid_argument("DistributedSampler: bad arguments (size " + std::to_string(dataset_size) +
                                ", world " + std::to_string(world) + ", rank " + std::to_string(rank) +
                                ", batch " + std::to_string(batch_size) + ")");
  if (drop_last) {
    batches_per_epoch_ = size_ / (world_ * batch_);
    per_rank_ = batches_per_epoch_ * batch_;
    if (batches_per_epoch_ == 0)
      throw std::invalid_argument("DistributedSampler: " + std::to_string(size_) + " samples are fewer than one global batch of " +
                                  std::to_string(world_ * batch_) + " (world " + std::to_string(world_) +
                                  " x batch " + std::to_string(batch_) + ") with drop_last");
  } else {
    per_rank_ = (size_ + world_ - 1) / world_;
    batches_per_epoch_ = (per_rank_ + batch_ - 1) / batch_;
  }
}

std::vector<int64_t> DistributedSampler::rank_indices(int64_t epoch) const {
  std::vector<int64_t> perm(size_);
  if (shuffle_) {
    // torch.utils.data.DistributedSampler: g.manual_seed(seed + epoch); randperm(n, generator=g)
    auto gen = at::detail::createCPUGenerator(seed_ + static_cast<uint64_t>(epoch));
    auto p = torch::randperm(size_, gen, torch::kLong);
    std::copy(p.data_ptr<int64_t>(), p.data_ptr<int64_t>() + size_, perm.begin());
  } else {
    for (int64_t i = 0; i < size_; ++i) perm[i] = i;
  }
  std::vector<int64_t> mine;
  mine.reserve(per_rank_);
  for (int64_t k = 0; k < per_rank_; ++k) mine.push_back(perm[(rank_ + k * world_) % size_]);
  return mine;
}

std::vector<int64_t> DistributedSampler::next() {
  if (pos_.batch >= batches_per_epoch_) pos_ = {pos_.epoch + 1, 0};
  if (cached_epoch_ != pos_.epoch) {
    cache_ = rank_indices(pos_.epoch);
    cached_epoch_ = pos_.epoch;
  }
  const int64_t begin = pos_.batch * batch_;
  const int64_t end = std::min<int64_t>(begin + batch_, static_cast<int64_t>(cache_.size()));
  ++pos_.batch;
  return std::vector<int64_t>(cache_.begin() + begin, cache_.begin() + end);
}

void DistributedSampler::restore(const Position& p) {
  if (p.epoch < 0 || p.batch < 0 || p.batch > batches_per_epoch_)
    throw std::invalid_argument("DistributedSampler: cannot restore position (epoch " + std::to_string(p.epoch) +
                                ", batch " + std::to_string(p.batch) + "): an epoch has " +
                                std::to_string(batches_per_epoch_) + " batches");
  pos_ = p;
}

}  // namespace keel::data
