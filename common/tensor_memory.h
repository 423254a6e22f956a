// common/tensor_memory.h: an exact count of the bytes of live CPU tensors (run.count_tensor_memory),
// for measurements the resident set cannot make: glibc keeps freed memory (keel's allocator
// tuning) and fragments it, so peak RSS mixes what was live with where it was put
// (docs/performance.md's activation figures).
//
// Owns: a CPU allocator in place of LibTorch's default one (c10::SetCPUAllocator) that takes
// memory from the same aligned allocation (c10::alloc_cpu) and counts each block's bytes while it
// lives, and the counts. Tensors allocated before it is installed are not counted. Thread-safe.
#pragma once

#include <cstdint>
#include <optional>

namespace keel {

/// Installs the counting allocator (once; later calls do nothing). Call before the tensors to
/// count are made.
void count_tensor_memory();

struct TensorMemory {
  int64_t live = 0;  // bytes of CPU tensor storage allocated since count_tensor_memory() and not freed
  int64_t peak = 0;  // the most `live` has been
};
/// The counts, or nullopt when count_tensor_memory() was not called.
std::optional<TensorMemory> tensor_memory();

}  // namespace keel
