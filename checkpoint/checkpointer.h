// checkpoint/checkpointer.h: the Checkpointer's internals (the class, the State it saves and the
// layout: keel/checkpoint/checkpoint.h): file names, the shard plan, the optimizer state checks,
// and the protocol of a save and a load.
//
// Protocol of a save (every rank calls save() at the same step):
//   1. plan: tensors replicated on every rank (model, optimizer) are assigned to ranks largest
//      first to the least-loaded rank, so bytes are balanced; every rank computes the same plan
//      and its fingerprint is checked across ranks (dist/collectives.h);
//   2. write: each rank writes its shard files (temp name, fsync, rename, fsync the directory),
//      computing SHA-256 on the way; with async the state is first copied to CPU memory and a
//      background thread writes while training continues;
//   3. commit (collective, on the training thread): every rank's result is all-gathered; if any
//      rank failed, every rank throws SaveError naming the rank, file and error, and nothing is
//      committed; otherwise rank 0 writes the index and then meta.json (temp, fsync, rename,
//      fsync the directory), tells every rank the outcome, and removes old steps beyond `keep`
//      and uncommitted directories. A directory without meta.json is never loaded.
// Async saves are committed at the first step boundary at which every rank's writer is done
// (the trainer learns it from the per-step consensus), or by the next save / finish().
//
// Loading (collective): the newest committed step (or checkpoint.resume_from) whose files
// verify on every rank; a file whose checksum or format is wrong is named in a warning and
// the previous committed step is tried. Each rank reads and verifies the model and extra
// shards, its own rank file, and only the optimizer files that hold state it wants
// (Options::wants_optimizer_tensor; through the optimizer index), so a checkpoint saved at
// any world size and dist.zero re-partitions on load.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <string>
#include <vector>

#include "checkpoint/safetensors.h"
#include "keel/checkpoint/checkpoint.h"

namespace keel::checkpoint {

/// "model-00001-of-00002.safetensors" etc.
std::string model_file(int64_t rank, int64_t world);
std::string optimizer_file(int64_t rank, int64_t world);
std::string extra_file(int64_t rank, int64_t world);
std::string rank_file(int64_t rank);

/// Owner rank of each tensor of `sizes` (bytes), balanced: largest first to the least-loaded
/// rank (ties: the lower rank), deterministic.
std::vector<int64_t> assign_shards(const std::vector<uint64_t>& sizes, int64_t world);

/// What is wrong with the optimizer state tensor `name` ("<parameter>.<field>") of a step
/// saved after `step` optimizer steps, or "": a step count (`step_count`) is one integer in
/// [0, step]; any other field has the shape and dtype of its parameter `param`.
std::string optimizer_tensor_problem(const std::string& name, const torch::Tensor& t, bool step_count,
                                     const torch::Tensor& param, int64_t step);

}  // namespace keel::checkpoint
