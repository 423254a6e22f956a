// trainer/config/pipeline.h: the [parallel] pipeline keys resolved (issue 66): the schedule a run's
// parallel.pp, parallel.pp_schedule, parallel.pp_virtual_stages and train.grad_accum make, and
// parallel.pp_split's stage boundaries, each refusal an InputError naming the keys (exit 2).
//
// Owns: reading the keys into a dist::pipeline::Schedule and a split; the text of
// `keel train --print-schedule`. Does not own: the schedules themselves (dist/pipeline/schedule.h),
// the split of a model into stages (its blocks are known only once it is built: dist/stages.h).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "dist/pipeline/schedule.h"
#include "keel/trainer/config/config.h"

namespace keel {

/// parallel.pp_virtual_stages, 0 resolved: the schedule's own (1 for gpipe and 1f1b, else 2).
int64_t pipeline_virtual_stages(const ParallelConfig& p);

/// The run's schedule, lowered; throws InputError naming the keys when it cannot be made (an
/// unknown name, too few micro-batches, virtual stages the schedule does not take).
dist::pipeline::Schedule pipeline_schedule(const Config& cfg);

/// parallel.pp_split's boundaries: empty for "even", else the first block of each stage after the
/// first (pp x virtual stages - 1 of them, increasing, from 1). Throws InputError naming the key.
std::vector<int64_t> pipeline_split_points(const ParallelConfig& p);

/// `keel train --print-schedule`: the schedule's table (one line per rank) and what the simulator
/// found (ticks, the bubble against (p - 1) / (m + p - 1), peak micro-batches in flight per rank).
std::string describe_schedule(const Config& cfg);

}  // namespace keel
