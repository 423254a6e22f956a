// trainer/data/sampler.h: the order in which a rank visits the train split.
//
// Owns: PyTorch's DistributedSampler semantics, batched. Every epoch has a permutation of the
// dataset drawn from a generator seeded with (seed + epoch), exactly as
// torch.utils.data.DistributedSampler does; rank r of N takes positions r, r+N, r+2N, ... of
// it. Hence N ranks with batch B see, step for step, the same samples as one rank with batch
// N*B. Its position (epoch, batch) can be reported and restored for exact resume.
// Its checkpoint state (checkpoint::Stateful): this rank's position in its rank_values, and the
// job's position in its values (data_position, batch_size, dataset_size), from which a job of
// another world size, batch size or dataset resumes at the first global batch not fully
// consumed (a changed dataset with a warning naming both sizes).
// Does not own: loading samples (trainer/data/data.h).
#pragma once

#include <cstdint>
#include <vector>

#include "checkpoint/stateful.h"

namespace keel::data {

class DistributedSampler : public checkpoint::Stateful {
 public:
  struct Position {
    int64_t epoch = 0;  // epoch of the next batch
    int64_t batch = 0;  // index of the next batch within that epoch
    bool operator==(const Position& o) const { return epoch == o.epoch && batch == o.batch; }
  };

  /// drop_last = true: each epoch has floor(size / (world * batch)) full batches per rank and
  /// the remainder is skipped. drop_last = false: the epoch is padded by wrapping around (as
  /// PyTorch does) to a multiple of world, and the last batch of a rank may be smaller.
  DistributedSampler(int64_t dataset_size, int64_t world, int64_t rank, int64_t batch_size, bool shuffle,
                     bool drop_last, uint64_t seed);

  int64_t batches_per_epoch() const { return batches_per_epoch_; }
  /// Indices of the next batch; advances the position (into the next epoch when needed).
  std::vector<int64_t> next();
  Position position() const { return pos_; }
  /// Restores a position reported by position(); throws std::invalid_argument if out of range.
  void restore(const Position& p);
  /// All of this rank's indices for `epoch`, in visiting order (padded when !drop_last).
  std::vector<int64_t> rank_indices(int64_t epoch) const;

  void save(checkpoint::Component& mine) const override;
  /// The saved position when restores_in_place(); otherwise the samples the whole job consumed in
  /// the saved epoch, mapped to this job's global batches (docs/checkpoints.md), with a warning.
  void load(const checkpoint::Loaded& loaded, const checkpoint::LoadedComponent& mine) override;
  /// Positions are non-negative integers, a batch index at most the epoch's batches; the rank
  /// state is that of a data-parallel rank of a job of the saved data-parallel degree.
  std::string check(const checkpoint::Loaded& loaded, const checkpoint::LoadedComponent& mine) const override;

 private:
  /// Whether the saved job had this rank's state at this data-parallel degree and rank (its
  /// values' data_parallel; the world size in steps saved before tensor parallelism), batch size
  /// and dataset size: the saved position is then this rank's own.
  bool restores_in_place(const checkpoint::Loaded& loaded, const checkpoint::LoadedComponent& mine) const;
  int64_t size_, world_, rank_, batch_;
  bool shuffle_, drop_last_;
  uint64_t seed_;
  int64_t per_rank_ = 0, batches_per_epoch_ = 0;
  Position pos_;
  int64_t cached_epoch_ = -1;
  std::vector<int64_t> cache_;
};

}  // namespace keel::data
