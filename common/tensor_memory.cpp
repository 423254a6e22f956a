#include "common/tensor_memory.h"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/alignment.h>
#include <c10/core/impl/alloc_cpu.h>

#include <atomic>
#include <cstring>
#include <mutex>
#include <unordered_set>

namespace keel {
namespace {

std::atomic<int64_t> live_bytes{0}, peak_bytes{0};
std::atomic<bool> installed{false};

// The blocks this allocator made: oneDNN frees through whatever allocator is current, so a block
// of LibTorch's own allocator, made before this one was installed, may come back here, and is
// handed to the default allocator's free instead of being read as one of ours.
std::mutex blocks_mutex;
std::unordered_set<void*>& own_blocks() {
  static auto* blocks = new std::unordered_set<void*>();  // never destroyed (deleters run at exit)
  return *blocks;
}

// A block: a header of one alignment unit holding its size, then the tensor's bytes (aligned as
// LibTorch's own allocator aligns them).
constexpr size_t kHeader = c10::gAlignment;

void count(int64_t delta) {
  const int64_t now = live_bytes.fetch_add(delta) + delta;
  int64_t peak = peak_bytes.load();
  while (now > peak && !peak_bytes.compare_exchange_weak(peak, now)) {
  }
}

void free_block(void* data) {
  if (!data) return;
  {
    std::lock_guard<std::mutex> lock(blocks_mutex);
    if (own_blocks().erase(data) == 0) return c10::free_cpu(data);
  }
  void* raw = static_cast<char*>(data) - kHeader;
  size_t n = 0;
  std::memcpy(&n, raw, sizeof n);
  count(-static_cast<int64_t>(n));
  c10::free_cpu(raw);
}

struct CountingCpuAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    if (n == 0) return {nullptr, nullptr, &free_block, c10::Device(c10::DeviceType::CPU)};
    void* raw = c10::alloc_cpu(n + kHeader);
    std::memcpy(raw, &n, sizeof n);
    void* data = static_cast<char*>(raw) + kHeader;
    {
      std::lock_guard<std::mutex> lock(blocks_mutex);
      own_blocks().insert(data);
    }
    count(static_cast<int64_t>(n));
    return {data, data, &free_block, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &free_block; }
  void copy_data(void* dest, const void* src, std::size_t count) const override { default_copy_data(dest, src, count); }
};

}  // namespace

void count_tensor_memory() {
  static std::once_flag once;
  std::call_once(once, [] {
    // Never destroyed: LibTorch's allocator table points at it until the process ends.
    static auto* allocator = new CountingCpuAllocator();
    c10::SetCPUAllocator(allocator, /*priority=*/100);
    installed = true;
  });
}

std::optional<TensorMemory> tensor_memory() {
  if (!installed) return std::nullopt;
  return TensorMemory{live_bytes.load(), peak_bytes.load()};
}

}  // namespace keel
