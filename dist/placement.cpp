#include "dist/placement.h"

#include <algorithm>

#include "keel/common/error.h"
#include "keel/dist/collectives.h"

namespace keel::dist {
namespace {

int64_t aligned(int64_t n) { return (n + Placement::kAlign - 1) / Placement::kAlign * Placement::kAlign; }

}  // namespace

std::vector<int64_t> owner_partition(const std::vector<uint64_t>& sizes, int64_t world) {
  uint64_t total = 0;
  for (auto b : sizes) total += b;
  std::vector<int64_t> owner(sizes.size(), 0);
  if (total == 0 || world <= 1) return owner;
  // Rank of the parameter whose bytes straddle [before, before + b): the share that holds its
  // midpoint. Monotone in model order, so each rank's parameters are one contiguous range.
  long double before = 0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    const long double mid = before + static_cast<long double>(sizes[i]) / 2;
    owner[i] = std::min<int64_t>(world - 1, static_cast<int64_t>(mid * world / static_cast<long double>(total)));
    before += static_cast<long double>(sizes[i]);
  }
  return owner;
}

Placement::Placement(int64_t stage) : stage_(stage) {
  if (stage < 0 || stage > 3) throw InputError("dist.zero must be 0, 1, 2 or 3, got " + std::to_string(stage));
}

Placement::Placement(int64_t stage, const models::NamedTensors& params, const std::vector<std::string>& block_prefixes,
                     int64_t world)
    : Placement(stage) {
  world_ = std::max<int64_t>(1, world);
  std::vector<uint64_t> bytes;
  for (const auto& [n, t] : params) {
    names_.push_back(n);
    sizes_.push_back(t.numel());
    bytes.push_back(static_cast<uint64_t>(t.numel()) * t.element_size());
  }
  owners_ = owner_partition(bytes, world_);
  if (!shards_gradients()) return;
  for (size_t b = 0; b <= block_prefixes.size(); ++b)
    units_.push_back({b < block_prefixes.size() ? "block " + block_prefixes[b] : "(the parameters outside blocks)"});
  for (size_t i = 0; i < params.size(); ++i) {
    size_t b = 0;
    while (b < block_prefixes.size() && params[i].first.rfind(block_prefixes[b], 0) != 0) ++b;
    Unit& u = units_[b];
    const auto& t = params[i].second;
    if (!u.params.empty()) {
      const auto& first = params[u.params.front()];
      if (first.second.scalar_type() != t.scalar_type() || first.second.device() != t.device())
        throw InputError(key() + " shards each block as one flat buffer, and " + u.name + " mixes '" + first.first +
                         "' (" + c10::toString(first.second.scalar_type()) + " on " + first.second.device().str() +
                         ") with '" + params[i].first + "' (" + c10::toString(t.scalar_type()) + " on " +
                         t.device().str() + ")");
    }
    u.params.push_back(i);
    u.offsets.push_back(aligned(u.numel));
    u.shapes.push_back(t.sizes().vec());
    u.sizes.push_back(t.numel());
    u.numel = u.offsets.back() + t.numel();
  }
  for (auto& u : units_)
    if (!u.params.empty()) u.shard = aligned((u.numel + world_ - 1) / world_);
}

std::vector<Placement::Piece> Placement::pieces(int64_t rank) const {
  std::vector<Piece> out;
  if (!shards_gradients()) {
    for (size_t i = 0; i < names_.size(); ++i)
      if (!shards_optimizer_state() || owners_[i] == rank) out.push_back({i, 0, 0, 0, sizes_[i]});
    return out;
  }
  for (size_t b = 0; b < units_.size(); ++b) {
    const Unit& u = units_[b];
    const int64_t first = rank * u.shard, last = (rank + 1) * u.shard;
    for (size_t k = 0; k < u.params.size(); ++k) {
      const int64_t lo = std::max(u.offsets[k], first), hi = std::min(u.offsets[k] + u.sizes[k], last);
      if (hi > lo) out.push_back({u.params[k], b, lo - u.offsets[k], lo - first, hi - lo});
    }
  }
  // Model order (a unit's parameters need not be contiguous in the model).
  std::stable_sort(out.begin(), out.end(), [](const Piece& a, const Piece& b) { return a.param < b.param; });
  return out;
}

uint64_t Placement::fingerprint() const {
  std::vector<int64_t> words = {-9 - stage_, world_, static_cast<int64_t>(names_.size())};
  words.insert(words.end(), owners_.begin(), owners_.end());
  words.push_back(static_cast<int64_t>(units_.size()));
  for (const auto& u : units_) {
    words.insert(words.end(), {static_cast<int64_t>(u.params.size()), u.shard});
    for (size_t k = 0; k < u.params.size(); ++k)
      words.insert(words.end(), {static_cast<int64_t>(u.params[k]), u.offsets[k], u.sizes[k]});
  }
  return dist::fingerprint(words);
}

nlohmann::json Placement::describe() const {
  nlohmann::json d = {{"stage", stage_}, {"world", world_}};
  if (shards_gradients()) {
    int64_t units = 0;
    for (const auto& u : units_) units += u.params.empty() ? 0 : 1;
    d["units"] = units;
    d["align"] = kAlign;
  }
  return d;
}

}  // namespace keel::dist
