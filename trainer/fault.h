// trainer/fault.h: the fault injector (fault.inject).
//
// Owns: parsing `TYPE@step=S,rank=R[,always]` entries into a plan and answering "does a fault
// of this type fire on this rank at this step?". A fault fires once per job: not again after a
// torchrun restart (TORCHELASTIC_RESTART_COUNT > 0) unless the entry says `always`. With no
// entries every query is a false on an empty vector: nothing to pay when off.
// Implemented types: nonfinite_grad (inf in this rank's gradients after backward), crash
// (SIGKILL after backward, before the step's consensus), checkpoint_write_failure (ENOSPC while
// this rank writes its model shard of the checkpoint saved at that step). The other
// types of the fault issue are parsed and refused with a clear message until they land.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace keel {

struct FaultEntry {
  std::string type;
  int64_t step = -1;   // optimizer step (1-based) at which it fires
  int64_t rank = -1;   // the rank it fires on
  bool always = false; // fire again after a restart
};

class FaultPlan {
 public:
  /// Throws InputError naming the entry for a malformed or unknown entry.
  FaultPlan(const std::vector<std::string>& entries, int64_t world_size);
  bool fires(const std::string& type, int64_t step, int64_t rank, int64_t restart_count) const;
  const std::vector<FaultEntry>& entries() const { return entries_; }

 private:
  std::vector<FaultEntry> entries_;
};

}  // namespace keel
