// checkpoint/checkpointer.h: the Checkpointer's internals (the class, the State it saves and the
// layout: keel/checkpoint/checkpoint.h): file names, the shard plan, and the protocol of a save
// and a load. It knows no component by name: what a component's values mean, and what makes its
// tensors usable beyond their recorded dtype and shape, is the component's (Stateful::check).
//
// Protocol of a save (every rank calls save() at the same step):
//   1. plan: replicated tensors (of every component) are assigned to ranks largest first to
//      the least-loaded rank, so bytes are balanced; every rank computes the same plan and its
//      fingerprint is checked across ranks (dist/collectives.h); the names, dtypes and shapes
//      of every rank's owned tensors are all-gathered (one collective) for the indexes;
//   2. write: each rank writes its shard files (temp name, fsync, rename, fsync the directory),
//      computing SHA-256 on the way; with async the state is first copied to CPU memory and a
//      background thread writes while training continues;
//   3. commit (collective, on the training thread): every rank's result is all-gathered; if any
//      rank failed, every rank throws SaveError naming the rank, file and error, and nothing is
//      committed; otherwise rank 0 writes each component's index and then meta.json (temp, fsync, rename,
//      fsync the directory), tells every rank the outcome, and removes old steps beyond `keep`
//      and uncommitted directories. A directory without meta.json is never loaded.
// Async saves are committed at the first step boundary at which every rank's writer is done
// (the trainer learns it from the per-step consensus), or by the next save / finish().
//
// Loading (collective): the newest committed step (or checkpoint.resume_from) whose files
// verify on every rank; a file whose checksum or format is wrong is named in a warning and
// the previous committed step is tried. Each rank reads and verifies its own rank file and,
// of each component, only the files that hold a tensor it wants (Options::wants; through the
// component's index), so a checkpoint saved at any world size and dist.zero re-partitions on
// load. Every tensor read must be where the index places it with the dtype and shape
// meta.json records, and the index must list exactly the tensors meta.json records.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <string>
#include <vector>

#include "checkpoint/safetensors.h"
#include "keel/checkpoint/checkpoint.h"

namespace keel::checkpoint {

/// Rank `rank`'s file of component `component` ("model-00001-of-00002.safetensors"), the
/// component's index ("model.safetensors.index.json"), rank `rank`'s own file.
std::string component_file(const std::string& component, int64_t rank, int64_t world);
std::string index_file(const std::string& component);
std::string rank_file(int64_t rank);

/// Owner rank of each tensor of `sizes` (bytes), balanced: largest first to the least-loaded
/// rank (ties: the lower rank), deterministic.
std::vector<int64_t> assign_shards(const std::vector<uint64_t>& sizes, int64_t world);

}  // namespace keel::checkpoint
