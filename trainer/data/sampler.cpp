#include "trainer/data/sampler.h"

#include <torch/torch.h>

#include <algorithm>
#include <stdexcept>
#include <string>

#include "common/log.h"

namespace keel::data {

DistributedSampler::DistributedSampler(int64_t dataset_size, int64_t world, int64_t rank, int64_t batch_size,
                                       bool shuffle, bool drop_last, uint64_t seed)
    : size_(dataset_size),
      world_(world),
      rank_(rank),
      batch_(batch_size),
      shuffle_(shuffle),
      drop_last_(drop_last),
      seed_(seed) {
  if (world < 1 || rank < 0 || rank >= world || batch_size < 1 || dataset_size < 1)
    throw std::invalid_argument("DistributedSampler: bad arguments (size " + std::to_string(dataset_size) + ", world " +
                                std::to_string(world) + ", rank " + std::to_string(rank) + ", batch " +
                                std::to_string(batch_size) + ")");
  if (drop_last) {
    batches_per_epoch_ = size_ / (world_ * batch_);
    per_rank_ = batches_per_epoch_ * batch_;
    if (batches_per_epoch_ == 0)
      throw std::invalid_argument("DistributedSampler: " + std::to_string(size_) +
                                  " samples are fewer than one global batch of " + std::to_string(world_ * batch_) +
                                  " (world " + std::to_string(world_) + " x batch " + std::to_string(batch_) +
                                  ") with drop_last");
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

void DistributedSampler::save(checkpoint::Component& mine) const {
  mine.values["data_position"] = {{"epoch", pos_.epoch}, {"batch", pos_.batch}};
  mine.values["batch_size"] = batch_;
  mine.values["dataset_size"] = size_;
  // The data-parallel degree (the world size unless tensor parallelism makes ranks share a batch).
  mine.values["data_parallel"] = world_;
  mine.rank_values["sampler"] = {{"epoch", pos_.epoch}, {"batch", pos_.batch}};
  mine.rank_values["batch_size"] = batch_;
  mine.rank_values["world_size"] = world_;
  mine.rank_values["rank"] = rank_;
}

namespace {

// The saving job's data-parallel degree: recorded since tensor parallelism (before, the world's).
int64_t saved_data_parallel(const checkpoint::Loaded& loaded, const checkpoint::LoadedComponent& mine) {
  return mine.values.value("data_parallel", loaded.saved_world_size);
}

}  // namespace

bool DistributedSampler::restores_in_place(const checkpoint::Loaded& loaded,
                                           const checkpoint::LoadedComponent& mine) const {
  const auto& rs = mine.rank_values;
  return loaded.has_rank_state && saved_data_parallel(loaded, mine) == world_ &&
         rs.value("rank", int64_t{-1}) == rank_ && rs.value("batch_size", int64_t{-1}) == batch_ &&
         mine.values.value("dataset_size", size_) == size_;  // (absent before 2026-12: assumed unchanged)
}

void DistributedSampler::load(const checkpoint::Loaded& loaded, const checkpoint::LoadedComponent& mine) {
  const auto& rs = mine.rank_values;
  const int64_t saved_world = saved_data_parallel(loaded, mine);
  const int64_t saved_size = mine.values.value("dataset_size", size_);
  if (restores_in_place(loaded, mine)) {
    restore({rs["sampler"]["epoch"].get<int64_t>(), rs["sampler"]["batch"].get<int64_t>()});
    return;
  }
  // Another world size, batch size or dataset: keep the position in the data as the number of
  // samples the whole job has consumed in the current epoch, and start every rank at the first
  // global batch not fully consumed (the end of the epoch when the dataset shrank below it).
  int64_t e = 0, b = 0;  // every rank of the saved job had this position
  if (mine.values.contains("data_position")) {
    e = mine.values["data_position"].value("epoch", int64_t{0});
    b = mine.values["data_position"].value("batch", int64_t{0});
  }
  const int64_t saved_batch = mine.values.value("batch_size", batch_);
  const int64_t consumed = b * saved_world * saved_batch;
  const int64_t per_global = world_ * batch_;
  const int64_t nb = std::min(consumed / per_global, batches_per_epoch_);
  restore({e, nb});
  if (saved_size != size_)
    logging::warn(
        "resuming a checkpoint whose run trained on {} samples, but the training split now has {} (data.path, "
        "its files or data.test_fraction changed since that step): the order of samples differs from the saved "
        "run's; data position remapped from epoch {} batch {} to batch {} ({} samples of the epoch consumed)",
        saved_size, size_, e, b, nb, consumed);
  else
    logging::warn(
        "resuming a checkpoint saved by {} ranks x batch {} on {} ranks x batch {}: data position "
        "remapped from epoch {} batch {} to batch {} ({} samples of the epoch consumed){}",
        saved_world, saved_batch, world_, batch_, e, b, nb, consumed,
        consumed % per_global ? "; the partial global batch is skipped" : "");
}

namespace {

// "" when j[key] is an integer in [lo, hi], else the problem naming `where`.
std::string int_in(const nlohmann::json& j, const char* key, int64_t lo, int64_t hi, const std::string& where) {
  const auto& v = j.is_object() ? j.value(key, nlohmann::json()) : nlohmann::json();
  if (v.is_number_integer() && v.get<int64_t>() >= lo && v.get<int64_t>() <= hi) return "";
  return where + "." + key + " = " + v.dump() + " is not an integer in [" + std::to_string(lo) + ", " +
         std::to_string(hi) + "]";
}

}  // namespace

std::string DistributedSampler::check(const checkpoint::Loaded& loaded, const checkpoint::LoadedComponent& mine) const {
  const auto& sh = mine.values;
  constexpr int64_t kBig = int64_t{1} << 40;
  if (sh.contains("data_position")) {
    for (const char* k : {"epoch", "batch"})
      if (auto p = int_in(sh["data_position"], k, 0, kBig, "values.data_position"); !p.empty()) return p;
  }
  for (const char* k : {"batch_size", "dataset_size"})
    if (sh.contains(k))
      if (auto p = int_in(sh, k, 1, kBig, "values"); !p.empty()) return p;
  if (sh.contains("data_parallel"))
    if (auto p = int_in(sh, "data_parallel", 1, loaded.saved_world_size, "values"); !p.empty()) return p;
  const int64_t saved_dp = saved_data_parallel(loaded, mine);
  if (!loaded.has_rank_state) return "";
  const auto& rs = mine.rank_values;
  const std::string where = "rank " + std::to_string(rank_) + "'s state";
  if (!rs.contains("sampler")) return "";  // saved before positions were kept per rank: remapped
  for (const char* k : {"epoch", "batch"})
    if (auto p = int_in(rs["sampler"], k, 0, kBig, where + ".sampler"); !p.empty()) return p;
  // (world_size and rank are the data-parallel ones: tensor-parallel ranks share a batch.)
  if (auto p = int_in(rs, "world_size", saved_dp, saved_dp, where); !p.empty()) return p;
  if (auto p = int_in(rs, "rank", 0, saved_dp - 1, where); !p.empty()) return p;
  if (auto p = int_in(rs, "batch_size", 1, kBig, where); !p.empty()) return p;
  if (restores_in_place(loaded, mine) && rs["sampler"]["batch"].get<int64_t>() > batches_per_epoch_)
    return where + ".sampler.batch = " + rs["sampler"]["batch"].dump() + " is past the epoch's " +
           std::to_string(batches_per_epoch_) + " batches";
  return "";
}

}  // namespace keel::data
