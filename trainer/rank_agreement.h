// trainer/rank_agreement.h: every rank runs the same job, checked before the first collective.
//
// Owns: comparing the resolved config (every key but a few that may differ per rank or node:
// run.log_level, run.all_ranks_log, run.progress, run.threads, run.name, run.dir,
// dist.interface) and the keel and LibTorch versions across ranks with dist::agree, before any
// other collective runs: a rank with another bucket size would otherwise abort inside Gloo,
// and one with another learning rate would train (and checkpoint) a different model. When the
// fingerprints differ every rank gets every rank's values, so that every rank stops with the
// same message naming the first key that differs and each rank's value (InputError: exit 2
// everywhere). Cost: one 16-byte all-reduce when the ranks agree.
#pragma once

#include "keel/dist/process_group.h"
#include "keel/trainer/config/config.h"

namespace keel {

/// Collective. No-op without a process group. Throws InputError on a mismatch.
void agree_on_config(const std::shared_ptr<dist::Group>& group, const Config& cfg);

}  // namespace keel
