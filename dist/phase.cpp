#include "dist/phase.h"

#include <algorithm>
#include <atomic>
#include <exception>
#include <memory>
#include <mutex>

namespace keel::dist {
namespace {

std::atomic<uint64_t> g_phase{0};
std::atomic<int64_t> g_step{0};
// The hook: set before the run's phases start and cleared after; read on the driving thread.
std::mutex g_hook_mu;
std::shared_ptr<const std::function<void(const PhaseState&)>> g_hook;
std::atomic<bool> g_has_hook{false};

// A field of the word: value + 1 in `bits` bits (0: none), saturating.
uint64_t field(int32_t v, int bits) {
  const uint64_t max = (uint64_t{1} << bits) - 1;
  return v < 0 ? 0 : std::min<uint64_t>(static_cast<uint64_t>(v) + 1, max);
}
int32_t unfield(uint64_t word, int shift, int bits) {
  return static_cast<int32_t>((word >> shift) & ((uint64_t{1} << bits) - 1)) - 1;
}

constexpr const char* kNames[] = {"idle",      "setup", "forward",         "backward",          "consensus",
                                  "optimizer", "eval",  "checkpoint save", "checkpoint commit", "finish"};

}  // namespace

const char* phase_name(Phase p) {
  const auto i = static_cast<size_t>(p);
  return i < std::size(kNames) ? kNames[i] : "?";
}

Phase phase_of(const std::string& name) {
  for (size_t i = 0; i < std::size(kNames); ++i) {
    std::string n = kNames[i];
    std::replace(n.begin(), n.end(), ' ', '_');
    if (n == name || kNames[i] == name) return static_cast<Phase>(i);
  }
  return Phase::Idle;
}

uint64_t PhaseState::pack() const {
  return static_cast<uint64_t>(phase) | field(block, 16) << 8 | field(stage, 8) << 24 | field(micro, 16) << 32 |
         field(bucket, 16) << 48;
}

PhaseState PhaseState::unpack(uint64_t w, int64_t step) {
  PhaseState s;
  s.phase = static_cast<Phase>(w & 0xff);
  s.block = unfield(w, 8, 16);
  s.stage = unfield(w, 24, 8);
  s.micro = unfield(w, 32, 16);
  s.bucket = unfield(w, 48, 16);
  s.step = step;
  return s;
}

std::string PhaseState::describe() const {
  std::string s = phase_name(phase);
  if (block >= 0) s += " of block " + std::to_string(block);
  if (bucket >= 0) s += ", gradient bucket " + std::to_string(bucket);
  std::string where;
  if (stage >= 0) where = "stage " + std::to_string(stage);
  if (micro >= 0) where += (where.empty() ? "" : ", ") + std::string("micro-batch ") + std::to_string(micro);
  return where.empty() ? s : s + " (" + where + ")";
}

PhaseState current_phase() {
  return PhaseState::unpack(g_phase.load(std::memory_order_relaxed), g_step.load(std::memory_order_relaxed));
}

void set_phase_step(int64_t step) { g_step.store(step, std::memory_order_relaxed); }

void set_block(int32_t block) {
  const uint64_t w = g_phase.load(std::memory_order_relaxed);
  g_phase.store((w & ~(uint64_t{0xffff} << 8)) | field(block, 16) << 8, std::memory_order_relaxed);
}

PhaseScope::PhaseScope(Phase phase, int32_t stage, int32_t micro)
    : before_(g_phase.load(std::memory_order_relaxed)), unwinding_(std::uncaught_exceptions()) {
  PhaseState s;
  s.phase = phase;
  s.stage = stage;
  s.micro = micro;
  g_phase.store(s.pack(), std::memory_order_relaxed);
  if (!g_has_hook.load(std::memory_order_relaxed)) return;
  std::shared_ptr<const std::function<void(const PhaseState&)>> hook;
  {
    std::lock_guard<std::mutex> lock(g_hook_mu);
    hook = g_hook;
  }
  if (hook) {
    s.step = g_step.load(std::memory_order_relaxed);
    (*hook)(s);  // a throw leaves the phase as it is: the phase the run failed in
  }
}

// While an exception unwinds, the phase stays the one it was thrown in: what the flight record's
// last dump says the rank was doing.
PhaseScope::~PhaseScope() {
  if (std::uncaught_exceptions() > unwinding_) return;
  g_phase.store(before_, std::memory_order_relaxed);
}

void set_phase_hook(std::function<void(const PhaseState&)> hook) {
  std::lock_guard<std::mutex> lock(g_hook_mu);
  g_hook = hook ? std::make_shared<const std::function<void(const PhaseState&)>>(std::move(hook)) : nullptr;
  g_has_hook.store(static_cast<bool>(g_hook));
}

}  // namespace keel::dist
