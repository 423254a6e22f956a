#include "keel/dist/collectives.h"

#include "common/host_copy.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <map>
#include <sstream>
#include <thread>

#include "dist/compat.h"
#include "dist/phase.h"

namespace keel::dist {

// Gloo's and NCCL's words for a wait that ran out of time.
static bool timed_out(const std::string& error) {
  return error.find("imed out") != std::string::npos || error.find("imeout") != std::string::npos;
}

enum class OpCode : int64_t {
  AllReduce = 1,
  Broadcast,
  AllGather,
  Barrier,
  BroadcastCoalesced,
  StepSync,
  ReduceScatter,
  Send,
  Recv,
  Sequence  // the confirmation of a replayed sequence's record (sequence())
};

static const char* op_name(int64_t code) {
  switch (static_cast<OpCode>(code)) {
    case OpCode::AllReduce:
      return "all_reduce";
    case OpCode::Broadcast:
      return "broadcast";
    case OpCode::AllGather:
      return "all_gather";
    case OpCode::Barrier:
      return "barrier";
    case OpCode::BroadcastCoalesced:
      return "broadcast_coalesced";
    case OpCode::StepSync:
      return "step_sync";
    case OpCode::ReduceScatter:
      return "reduce_scatter";
    case OpCode::Send:
      return "send";
    case OpCode::Recv:
      return "recv";
    case OpCode::Sequence:
      return "sequence";
  }
  return "?";
}

// A collective as a fixed-size integer record: what the ranks compare and, on a mismatch,
// exchange. Shapes beyond 8 dimensions enter the fingerprint through numel and `extra`.
struct Collectives::Desc {
  static constexpr int kDims = 8;
  int64_t op = 0, reduce = 0, dtype = -1, ndim = 0, dims[kDims] = {0};
  int64_t root = -1, device = 0, numel = 0, seq = 0, step = 0, extra = 0;
  const char* what = "";
  bool validation = false;  // the cross-rank check that runs before the collective `what`
  bool replayed = false;    // a call of a replayed sequence (sequence()): checked here, not probed
  // NCCL, a collective whose result stays on the device (start_*): wait() makes the current
  // stream wait for it instead of blocking the host (failures: the NCCL watchdog's timeout).
  bool stream_wait = false;
  // Issued while a CUDA graph was captured: its work never reaches the backend's watchdog, which
  // would complete its result (Collectives::device_result).
  bool captured = false;
  std::chrono::steady_clock::time_point issued;  // when it passed check() (for an observer)

  std::vector<int64_t> words() const {
    std::vector<int64_t> w = {op, reduce, dtype, ndim};
    w.insert(w.end(), dims, dims + kDims);
    w.insert(w.end(), {root, device, numel, seq, step, extra});
    return w;
  }
  // The call as a sequence records it (Collectives::sequence): without its place in the group's
  // calls and the step.
  std::vector<int64_t> sequence_words() const {
    Desc d = *this;
    d.seq = d.step = 0;
    return d.words();
  }
  static Desc from_words(const int64_t* w) {
    Desc d;
    d.op = w[0], d.reduce = w[1], d.dtype = w[2], d.ndim = w[3];
    std::copy(w + 4, w + 4 + kDims, d.dims);
    d.root = w[12], d.device = w[13], d.numel = w[14], d.seq = w[15], d.step = w[16], d.extra = w[17];
    return d;
  }
  static constexpr int64_t kWords = 18;

  static Desc of(OpCode op, const torch::Tensor& t) {
    Desc d;
    d.op = static_cast<int64_t>(op);
    if (t.defined()) {
      d.dtype = static_cast<int64_t>(t.scalar_type());
      d.ndim = t.dim();
      for (int64_t i = 0; i < std::min<int64_t>(t.dim(), kDims); ++i) d.dims[i] = t.size(i);
      d.numel = t.numel();
      d.device = static_cast<int64_t>(t.device().type());
    }
    return d;
  }
};

uint64_t fingerprint(const std::vector<int64_t>& words) {
  uint64_t h = 1469598103934665603ull;
  for (int64_t w : words) {
    uint64_t v = static_cast<uint64_t>(w);
    for (int i = 0; i < 8; ++i) {
      h ^= (v >> (8 * i)) & 0xff;
      h *= 1099511628211ull;
    }
  }
  return h & ((1ull << 62) - 1);
}

uint64_t fingerprint(std::string_view bytes) {
  uint64_t h = 1469598103934665603ull;
  for (const char c : bytes) {
    h ^= static_cast<unsigned char>(c);
    h *= 1099511628211ull;
  }
  return h & ((1ull << 62) - 1);
}

std::vector<int64_t> Disagreement::differing_from(int64_t rank) const {
  std::vector<int64_t> out;
  for (size_t r = 0; r < fingerprints.size(); ++r)
    if (fingerprints[r] != fingerprints.at(static_cast<size_t>(rank))) out.push_back(static_cast<int64_t>(r));
  return out;
}

std::string Disagreement::by_rank() const {
  std::string out;
  for (size_t r = 0; r < details.size(); ++r)
    out += "\n  " + (r < names.size() ? names[r] : "rank " + std::to_string(r)) + ": " + details[r];
  return out;
}

// Starts an all-gather of `t` over `pg` into `out`, one fresh tensor per rank (like `t`).
static c10::intrusive_ptr<c10d::Work> start_all_gather(c10d::ProcessGroup& pg, int64_t world, const torch::Tensor& t,
                                                       std::vector<torch::Tensor>& out) {
  std::vector<std::vector<at::Tensor>> outs(1);
  for (int64_t r = 0; r < world; ++r) outs[0].push_back(torch::empty_like(t));
  std::vector<at::Tensor> in{t};
  auto work = pg.allgather(outs, in);
  out = outs[0];
  return work;
}

namespace {

// Strings across ranks, whatever all-gathers the tensors: the lengths, then the bytes padded to
// the longest (`all_gather` returns host tensors in rank order).
std::vector<std::string> gather_strings(
    const std::string& mine, const std::function<std::vector<torch::Tensor>(const torch::Tensor&)>& all_gather) {
  const auto lens = all_gather(torch::tensor({static_cast<int64_t>(mine.size())}, torch::kLong));
  int64_t longest = 0;
  for (const auto& l : lens) longest = std::max(longest, l.item<int64_t>());
  auto buf = torch::zeros({std::max<int64_t>(longest, 1)}, torch::kByte);
  std::memcpy(buf.data_ptr(), mine.data(), mine.size());
  const auto all = all_gather(buf);
  std::vector<std::string> out;
  for (size_t r = 0; r < all.size(); ++r)
    out.emplace_back(reinterpret_cast<const char*>(all[r].data_ptr()), static_cast<size_t>(lens[r].item<int64_t>()));
  return out;
}

// The agreement algorithm, whatever carries it: `min_pair` all-reduces (f, -f) with MIN in
// place, so that min == max iff every rank passed f; only then does every rank's fingerprint
// and description travel, through `gather`. agree() runs it over validated collectives;
// Collectives::check, the validation itself, over the raw group.
Disagreement run_agreement(uint64_t fingerprint, const std::function<std::string()>& describe,
                           const std::function<void(torch::Tensor&)>& min_pair,
                           const std::function<std::vector<std::string>(const std::string&)>& gather) {
  const auto f = static_cast<int64_t>(fingerprint);
  auto pair = torch::tensor({f, -f}, torch::kLong);
  min_pair(pair);
  if (pair[0].item<int64_t>() == -pair[1].item<int64_t>()) return {};
  Disagreement d;
  for (const auto& s : gather(std::to_string(fingerprint) + "\n" + describe())) {
    const size_t nl = s.find('\n');
    d.fingerprints.push_back(std::stoull(s.substr(0, nl)));
    d.details.push_back(s.substr(nl + 1));
  }
  return d;
}

}  // namespace

struct Collectives::Door {
  mutable std::mutex mu;
  TrafficStats traffic;
  std::shared_ptr<OpObserver> observer;
  uint64_t buckets = 0;  // DDP buckets issued (their sequence numbers)
  // The first bucket's number in the current step (a bucket's index in its step: seq minus it).
  int64_t bucket_step = -1;
  uint64_t first_bucket = 0;
  uint64_t step_first_bucket(int64_t step, uint64_t seq) {  // under `mu`
    if (step != bucket_step) bucket_step = step, first_bucket = seq;
    return first_bucket;
  }
};

Collectives::Collectives(std::shared_ptr<Group> group, Validate validate)
    : group_(std::move(group)), mode_(validate), door_(std::make_shared<Door>()) {}

Collectives::~Collectives() = default;

TrafficStats Collectives::traffic() const {
  std::lock_guard<std::mutex> lock(door_->mu);
  return door_->traffic;
}

void Collectives::set_observer(std::shared_ptr<OpObserver> observer) {
  std::lock_guard<std::mutex> lock(door_->mu);
  door_->observer = std::move(observer);
}

Collectives& Collectives::replay_lane() {
  if (replaying_) return *this;
  if (!replay_) {
    replay_ = std::make_unique<Collectives>(group_, Validate::Off);
    replay_->door_ = door_;
    replay_->replaying_ = true;
  }
  replay_->step_ = step_;
  return *replay_;
}

OpRecord Collectives::record_of(const Desc& d) const {
  OpRecord r;
  r.kind = d.validation               ? OpRecord::Kind::Probe
           : replaying_ || d.replayed ? OpRecord::Kind::Replayed
                                      : OpRecord::Kind::Collective;
  const bool p2p = d.op == static_cast<int64_t>(OpCode::Send) || d.op == static_cast<int64_t>(OpCode::Recv);
  r.lane = p2p ? OpRecord::Lane::P2P : replaying_ ? OpRecord::Lane::Replay : OpRecord::Lane::Calls;
  r.group = group_->name();
  r.seq = static_cast<uint64_t>(d.seq);
  r.op = op_name(d.op);
  r.what = d.what;
  if (d.validation) {
    r.shape = {2};
    r.dtype = torch::kLong;
  } else if (d.dtype >= 0) {
    r.shape.assign(d.dims, d.dims + std::min<int64_t>(d.ndim, Desc::kDims));
    r.dtype = static_cast<c10::ScalarType>(d.dtype);
    r.bytes = d.numel * static_cast<int64_t>(c10::elementSize(r.dtype));
  }
  r.peer = d.root;
  if (p2p) r.tag = d.extra;
  r.step = step_;
  r.phase = current_phase().pack();
  r.enqueue = r.start = d.issued;
  return r;
}

// A record of an operation the door has no descriptor for (a DDP bucket, a raw call, the Reducer's
// failure): stamped with the phase and the time now.
static OpRecord door_record(OpRecord::Kind kind, OpRecord::Lane lane, const std::string& group, const char* op,
                            const char* what, int64_t step) {
  OpRecord r;
  r.kind = kind;
  r.lane = lane;
  r.group = group;
  r.op = op;
  r.what = what;
  r.step = step;
  r.phase = current_phase().pack();
  r.enqueue = r.start = r.end = std::chrono::steady_clock::now();
  return r;
}

std::shared_ptr<OpObserver> Collectives::observer() const {
  std::lock_guard<std::mutex> lock(door_->mu);
  return door_->observer;
}

void Collectives::observe_start(const Desc& d) {
  if (auto observer = this->observer()) {
    OpRecord r = record_of(d);
    r.start = std::chrono::steady_clock::now();
    observer->on_start(r);
  }
}

void Collectives::observe_failure(const Desc& d, const std::string& error, OpRecord::Outcome outcome) {
  if (auto observer = this->observer()) {
    OpRecord r = record_of(d);
    if (d.validation) r.kind = OpRecord::Kind::Collective;  // the call its probe guarded
    r.outcome = outcome;
    r.end = std::chrono::steady_clock::now();
    observer->on_failure(r, error);
  }
}

c10::intrusive_ptr<c10::ivalue::Future> Collectives::start_bucket_all_reduce(const torch::Tensor& buffer) {
  std::shared_ptr<OpObserver> observer;
  uint64_t seq = 0;
  int32_t index = 0;  // the bucket's place in its step
  {
    std::lock_guard<std::mutex> lock(door_->mu);
    observer = door_->observer;
    seq = door_->buckets++;
    index = static_cast<int32_t>(seq - door_->step_first_bucket(step_, seq));
  }
  const int64_t bytes = buffer.numel() * static_cast<int64_t>(buffer.element_size());
  OpRecord r;
  if (observer) {
    r = door_record(OpRecord::Kind::Bucket, OpRecord::Lane::Bucket, group_->name(), "all_reduce", "DDP gradient bucket",
                    step_);
    r.seq = seq;
    r.shape = buffer.sizes().vec();
    r.dtype = buffer.scalar_type();
    r.bytes = bytes;
    PhaseState where = PhaseState::unpack(r.phase, step_);
    where.bucket = index;
    r.phase = where.pack();
    observer->on_start(r);
  }
  std::vector<at::Tensor> v{buffer};
  const auto work = group_->pg()->allreduce(v);
  auto future = work->getFuture();
  // NCCL completes `future` when the bucket is enqueued (its waiters wait on the stream): the
  // record takes the bucket's end from the work's result instead.
  auto device = observer ? device_result(work) : nullptr;
  // Counted in a then(), not a callback: the Reducer waits on the future returned, which
  // completes only after this ran (a Future wakes its waiters before it runs its callbacks).
  // An error passes through then() untouched (DataParallel::backward names it).
  return future->then(
      [door = door_, observer, r, bytes, device](c10::ivalue::Future& f) -> c10::IValue {
        {
          std::lock_guard<std::mutex> lock(door->mu);
          door->traffic.gradient_buckets += 1;
          door->traffic.gradient_bytes += bytes;
        }
        if (observer) {
          OpRecord done = r;
          done.end = std::chrono::steady_clock::now();
          if (f.hasError()) {  // a lost peer, a timeout: the bucket failed (value() rethrows it below)
            const std::string error = f.tryRetrieveErrorMessage();
            done.outcome = timed_out(error) ? OpRecord::Outcome::TimedOut : OpRecord::Outcome::Failed;
            observer->on_failure(done, error);
          } else {
            done.device = device;
            observer->on_end(done);
          }
        }
        return f.value();
      },
      future->elementType());
}

// NCCL moves only CUDA tensors: host tensors (validation probes, the per-step record,
// checkpoint coordination, metric totals) travel through a copy on the group's device.
torch::Tensor Collectives::on_comm_device(const torch::Tensor& t) const {
  const torch::Device dev = group_->comm_device();
  return t.device() == dev ? t.contiguous() : t.to(dev).contiguous();
}

namespace {
std::atomic<int> g_capturing{0};
}  // namespace

CaptureScope::CaptureScope() { g_capturing.fetch_add(1); }
CaptureScope::~CaptureScope() { g_capturing.fetch_sub(1); }
bool CaptureScope::active() { return g_capturing.load() > 0; }

bool Collectives::validating() const {
  if (CaptureScope::active()) return false;
  return mode_ == Validate::Always || (mode_ == Validate::FirstStep && step_ <= 1);
}

std::string Collectives::describe(const Desc& d) const {
  std::ostringstream os;
  os << op_name(d.op);
  if (d.op == static_cast<int64_t>(OpCode::AllReduce)) {
    static const char* names[] = {"sum", "avg", "min", "max"};
    os << "(" << (d.reduce >= 0 && d.reduce < 4 ? names[d.reduce] : "?") << ")";
  }
  if (d.op == static_cast<int64_t>(OpCode::Sequence))
    return os.str() + " of " + std::to_string(d.numel) + " recorded collectives (replayed)";
  if (d.op == static_cast<int64_t>(OpCode::StepSync)) {
    os << " at step " << d.step << " with gradient plan " << std::hex << d.extra << std::dec;
    return os.str();
  }
  const bool p2p = d.op == static_cast<int64_t>(OpCode::Send) || d.op == static_cast<int64_t>(OpCode::Recv);
  if (p2p && d.dtype < 0) return os.str() + " descriptors (message #" + std::to_string(d.seq) + ")";
  if (p2p) {  // a message: its peer instead of a root, its own sequence
    os << " " << c10::toString(static_cast<c10::ScalarType>(d.dtype)) << " [";
    for (int64_t i = 0; i < std::min<int64_t>(d.ndim, Desc::kDims); ++i) os << (i ? ", " : "") << d.dims[i];
    os << (d.ndim > Desc::kDims ? ", ...]" : "]") << (d.op == static_cast<int64_t>(OpCode::Send) ? " to " : " from ")
       << group_->rank_name(d.root) << " (tag " << d.extra << ", message #" << d.seq << ")";
    return os.str();
  }
  if (d.dtype >= 0) {
    os << " " << c10::toString(static_cast<c10::ScalarType>(d.dtype)) << " [";
    for (int64_t i = 0; i < std::min<int64_t>(d.ndim, Desc::kDims); ++i) os << (i ? ", " : "") << d.dims[i];
    if (d.ndim > Desc::kDims) os << ", ...";
    os << "]";
  }
  if (d.op == static_cast<int64_t>(OpCode::BroadcastCoalesced)) os << " (" << d.extra << " tensors)";
  if (d.root >= 0) os << " root " << d.root;
  os << " (collective #" << d.seq << ")";
  return os.str();
}

namespace {
// Keyed by the restart count, like the rendezvous (torchrun's agent store outlives a restart).
std::string failed_key(const World& w, int64_t rank) {
  return "keel/" + std::to_string(w.restart_count) + "/failed/" + std::to_string(rank);
}
std::string abort_key(const World& w) { return "keel/" + std::to_string(w.restart_count) + "/abort"; }
}  // namespace

std::string Collectives::missing_ranks(const std::string& what) {
  const auto& store = group_->store();
  if (!store || size() == 1) return "";
  const std::string timeout = "dist.timeout_s = " + std::to_string(group_->timeout().count() / 1000);
  // A store whose host is gone or cut off would block each operation below for dist.timeout_s:
  // a fresh connection tells in a moment.
  if (!group_->store_reachable(report_grace()))
    return std::string(group_->store_on_rank0() ? "rank 0 is unreachable" : "the store's host is unreachable") +
           ": the store at " + group_->store_address() +
           (group_->store_on_rank0() ? ", which rank 0 serves," : " (torchrun's agent)") +
           " cannot be reached from this host either (that host is lost, or the network between the two is cut; " +
           timeout + ")";
  try {
    const World& w = group_->world();
    store->set(failed_key(w, rank()), std::vector<uint8_t>(what.begin(), what.end()));
    store->set(abort_key(w), std::vector<uint8_t>(what.begin(), what.end()));
    // The healthy ranks fail in the same collective at about the same time; give them a
    // moment to say so (wait() kept that moment out of the collective's own timeout).
    const auto deadline = std::chrono::steady_clock::now() + report_grace();
    std::string missing;
    for (;;) {
      missing.clear();
      for (int64_t r = 0; r < size(); ++r)
        if (!store->check({failed_key(w, r)})) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
      if (missing.empty() || std::chrono::steady_clock::now() >= deadline) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    if (missing.empty()) return "";
    return "rank(s) " + missing + " never reached or never finished this collective (hung, dead or cut off; " +
           timeout + ")";
  } catch (const std::exception&) {
    return "";  // the store is gone too (its host, rank 0 or the agent, died)
  }
}

Collectives::RawCall Collectives::raw_call(const char* op, const char* what) {
  RawCall call;
  const uint64_t seq = raw_seq_++;
  call.observer_ = observer();
  if (!call.observer_ || !group_->pg()) {
    call.observer_ = nullptr;
    return call;
  }
  call.record_ = door_record(OpRecord::Kind::Collective, OpRecord::Lane::Raw, group_->name(), op, what, step_);
  call.record_.seq = seq;
  call.observer_->on_start(call.record_);
  return call;
}

void Collectives::RawCall::done() {
  if (auto observer = std::move(observer_)) {
    record_.end = std::chrono::steady_clock::now();
    observer->on_end(record_);
  }
}

Collectives::RawCall::~RawCall() {
  if (auto observer = std::move(observer_)) {
    record_.end = std::chrono::steady_clock::now();
    record_.outcome = OpRecord::Outcome::Failed;
    try {  // (a destructor, maybe while an exception unwinds)
      observer->on_failure(record_, std::string(record_.what) + ": did not finish (an error on its way)");
    } catch (...) {
    }
  }
}

CollectiveError Collectives::failure(const std::string& what, const std::string& error) {
  CollectiveError e = failed(what, error);
  if (auto observer = this->observer()) {  // the Reducer's buckets: every one still open
    OpRecord r = door_record(OpRecord::Kind::Bucket, OpRecord::Lane::Bucket, group_->name(), "all_reduce",
                             "DDP gradient bucket", step_);
    r.seq = UINT64_MAX;
    r.outcome = timed_out(error) ? OpRecord::Outcome::TimedOut : OpRecord::Outcome::Failed;
    observer->on_failure(r, e.what());
  }
  return e;
}

CollectiveError Collectives::failed(const std::string& what, const std::string& error) {
  std::string msg = "[" + group_->rank_name(rank()) + "/" + std::to_string(size()) + "] " + what + " at step " +
                    std::to_string(step_) + " failed: " + error.substr(0, error.find('\n'));
  const std::string missing = missing_ranks(msg);
  if (!missing.empty()) msg += "; " + missing;
  return CollectiveError(msg);
}

std::optional<std::string> Collectives::peer_failure() const {
  const auto& store = group_->store();
  if (!store) return std::string();
  try {
    if (!store->check({abort_key(group_->world())})) return std::nullopt;
    auto v = store->get(abort_key(group_->world()));
    return std::string(v.begin(), v.end());
  } catch (const std::exception& e) {
    return std::string("the store is unreachable: ") + e.what();
  }
}

std::chrono::milliseconds Collectives::report_grace() const {
  return std::min<std::chrono::milliseconds>(std::chrono::milliseconds(2000), group_->timeout() / 4);
}

void Collectives::wait(const c10::intrusive_ptr<c10d::Work>& w, const Desc& d) {
  const auto t0 = std::chrono::steady_clock::now();
  try {
    // dist.timeout_s bounds the whole failure: the wait, then the grace to name missing ranks.
    if (d.stream_wait || (CaptureScope::active() && group_->comm_device().is_cuda()))
      w->wait();
    else
      w->wait(group_->timeout() - report_grace());
  } catch (const std::exception& e) {
    CollectiveError error =
        failed(std::string(d.validation ? "validation of " : "") + d.what + ": " + describe(d), e.what());
    observe_failure(d, error.what(), timed_out(e.what()) ? OpRecord::Outcome::TimedOut : OpRecord::Outcome::Failed);
    throw error;
  }
  count(d, std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count(),
        d.stream_wait && !d.captured ? device_result(w) : nullptr);
}

c10::intrusive_ptr<c10::ivalue::Future> Collectives::device_result(const c10::intrusive_ptr<c10d::Work>& w) const {
  // A work captured into a CUDA graph never reaches the backend's watchdog: nothing completes it
  // (the callers also pass none for a call issued during a capture). Under
  // TORCH_NCCL_BLOCKING_WAIT the host's wait is the device's: the host's end is the record's.
  static const bool blocking_wait = [] {
    const char* v = std::getenv("TORCH_NCCL_BLOCKING_WAIT");
    return v && *v && std::string(v) != "0";
  }();
  if (!w || blocking_wait || group_->backend() != "nccl" || CaptureScope::active()) return {};
  try {
    return w->getFutureResult();
  } catch (const std::exception&) {  // a backend without one
    return {};
  }
}

void Collectives::count(const Desc& d, double wait_ms, c10::intrusive_ptr<c10::ivalue::Future> device) {
  // A probe is the 16-byte (f, -f) pair whatever it guards; otherwise the tensor's payload.
  const int64_t bytes = d.validation ? 16
                        : d.dtype >= 0
                            ? d.numel * static_cast<int64_t>(c10::elementSize(static_cast<c10::ScalarType>(d.dtype)))
                            : 0;
  const bool gather = !d.validation && (d.op == static_cast<int64_t>(OpCode::AllGather) ||
                                        d.op == static_cast<int64_t>(OpCode::StepSync));
  tally(d, bytes, bytes, gather ? bytes * size() : bytes, wait_ms, std::move(device));
}

void Collectives::tally(const Desc& d, int64_t payload, int64_t sent, int64_t received, double wait_ms,
                        c10::intrusive_ptr<c10::ivalue::Future> device) {
  std::shared_ptr<OpObserver> observer;
  {
    std::lock_guard<std::mutex> lock(door_->mu);
    TrafficStats& t = door_->traffic;
    t.collectives += 1;
    t.probes += d.validation ? 1 : 0;
    t.replayed += replaying_ || d.replayed ? 1 : 0;
    t.bytes_sent += sent;
    t.bytes_received += received;
    t.wait_ms += wait_ms;
    observer = door_->observer;
  }
  if (!observer) return;
  OpRecord r = record_of(d);
  r.bytes = payload;
  r.end = std::chrono::steady_clock::now();
  if (d.validation) r.start = r.end - std::chrono::microseconds(static_cast<int64_t>(wait_ms * 1000));
  r.device = std::move(device);
  observer->on_end(r);
}

struct Collectives::Sequences {
  std::map<uint64_t, std::vector<Desc>> records;
  std::vector<Desc>* record = nullptr;  // the run in progress: its record
  bool recording = false;               // (else replaying it)
  size_t next = 0;                      // replaying: the next call's place in the record
  uint64_t key = 0;
  std::vector<Desc> pending;  // recording: kept under `key` by end()
};

Collectives::Sequence Collectives::sequence(uint64_t key) {
  if (mode_ != Validate::Always || size() == 1 || replaying_ || CaptureScope::active()) return Sequence();
  if (!sequences_) sequences_ = std::make_shared<Sequences>();
  Sequences& s = *sequences_;
  if (s.record) throw std::logic_error("Collectives::sequence: a sequence is already running on this group");
  auto it = s.records.find(key);
  s.key = key;
  s.next = 0;
  if (it == s.records.end()) {  // recorded as it is validated, kept by end()
    s.recording = true;
    s.record = &s.pending;
    s.pending.clear();
    return Sequence(this);
  }
  // Every rank confirms that it replays the same record: one probe (a rank recording instead
  // meets it with its first call's, and every rank throws the mismatch naming both).
  std::vector<int64_t> words;
  for (const Desc& c : it->second) {
    const std::vector<int64_t> w = c.sequence_words();
    words.insert(words.end(), w.begin(), w.end());
  }
  Desc d;
  d.op = static_cast<int64_t>(OpCode::Sequence);
  d.numel = static_cast<int64_t>(it->second.size());
  d.extra = static_cast<int64_t>(fingerprint(words));
  d.what = "a sequence of collectives replayed from its validated record";
  d.seq = static_cast<int64_t>(seq_++);
  d.issued = std::chrono::steady_clock::now();
  validate(d);
  s.recording = false;
  s.record = &it->second;
  return Sequence(this);
}

void Collectives::replay_call(Desc& d) {
  Sequences& s = *sequences_;
  const size_t at = s.next++;
  if (at < s.record->size() && (*s.record)[at].sequence_words() == d.sequence_words()) {
    d.replayed = true;
    return;
  }
  const std::string expected = at < s.record->size() ? describe((*s.record)[at]) : "nothing more";
  s.record = nullptr;
  const CollectiveMismatch error("collective mismatch at step " + std::to_string(step_) + " (" + d.what + ") on " +
                                 group_->rank_name(rank()) + ": its collective #" + std::to_string(at) +
                                 " of a replayed sequence would be " + describe(d) +
                                 ", where the record every rank of the group confirmed has " + expected +
                                 "; nothing was issued. Every rank must make the same calls in the same order");
  observe_failure(d, error.what(), OpRecord::Outcome::Mismatch);
  throw error;
}

void Collectives::end_sequence(bool completed) {
  if (!sequences_ || !sequences_->record) return;
  Sequences& s = *sequences_;
  std::vector<Desc>* record = s.record;
  s.record = nullptr;
  if (!completed) return;  // an exception is on its way: a partial record is not kept
  if (s.recording) {
    s.records[s.key] = std::move(*record);
    return;
  }
  if (s.next != record->size())
    throw CollectiveMismatch("collective mismatch at step " + std::to_string(step_) + " on " +
                             group_->rank_name(rank()) + ": a replayed sequence ended after " + std::to_string(s.next) +
                             " of its record's " + std::to_string(record->size()) + " collectives (the next: " +
                             describe((*record)[s.next]) + "). Every rank must make the same calls in the same order");
}

void Collectives::Sequence::end() {
  if (Collectives* c = std::exchange(coll_, nullptr)) c->end_sequence(/*completed=*/true);
}

Collectives::Sequence::~Sequence() {
  if (coll_) coll_->end_sequence(/*completed=*/false);
}

void Collectives::check(Desc& d) {
  d.seq = static_cast<int64_t>(seq_++);
  d.issued = std::chrono::steady_clock::now();
  d.captured = CaptureScope::active();
  observe_start(d);  // before its validation: a rank waiting in the probe is in this call
  if (sequences_ && sequences_->record && !sequences_->recording) {
    replay_call(d);
  } else if (validating()) {
    validate(d);
    if (sequences_ && sequences_->record) {
      sequences_->record->push_back(d);
      sequences_->record->back().what = "";  // (the caller's; a record outlives it)
    }
  }
}

void Collectives::validate(const Desc& d) {
  Desc probe = d;  // a failure here names the collective it guards ("checkpoint load verdict")
  probe.validation = true;
  // The agreement on the raw group (this is the validation): a probe is counted per exchange.
  auto raw_gather = [&](const torch::Tensor& t) {
    std::vector<torch::Tensor> out;
    wait(start_all_gather(*group_->pg(), size(), on_comm_device(t), out), probe);
    for (auto& o : out) o = o.cpu();
    return out;
  };
  Disagreement dis = run_agreement(
      fingerprint(d.words()), [&] { return describe(d); },
      [&](torch::Tensor& pair) {
        auto c = on_comm_device(pair);
        std::vector<at::Tensor> v{c};
        c10d::AllreduceOptions o;
        o.reduceOp = c10d::ReduceOp::MIN;
        wait(group_->pg()->allreduce(v, o), probe);
        pair = c.cpu();
      },
      [&](const std::string& mine) { return gather_strings(mine, raw_gather); });
  if (!dis) return;
  for (int64_t r = 0; r < size(); ++r) dis.names.push_back(group_->rank_name(r));
  const CollectiveMismatch error("collective mismatch at step " + std::to_string(step_) + " (" + d.what +
                                 "):" + dis.by_rank() +
                                 "\nevery rank must issue the same collectives in the same order with the same "
                                 "dtypes and shapes");
  observe_failure(d, error.what(), OpRecord::Outcome::Mismatch);
  throw error;
}

void Collectives::all_reduce(torch::Tensor& t, ReduceOp op, const char* what) {
  if (!group_->pg()) return;
  Desc d = Desc::of(OpCode::AllReduce, t);
  d.reduce = static_cast<int64_t>(op);
  d.what = what;
  check(d);
  torch::Tensor c = on_comm_device(t);
  std::vector<at::Tensor> v{c};
  c10d::AllreduceOptions o;
  o.reduceOp = op == ReduceOp::Min   ? c10d::ReduceOp::MIN
               : op == ReduceOp::Max ? c10d::ReduceOp::MAX
                                     : c10d::ReduceOp::SUM;
  wait(group_->pg()->allreduce(v, o), d);
  if (!c.is_same(t)) t.copy_(c);
  if (op == ReduceOp::Avg) t.div_(static_cast<double>(size()));
}

void Collectives::broadcast(torch::Tensor& t, int64_t root, const char* what) {
  if (!group_->pg()) return;
  Desc d = Desc::of(OpCode::Broadcast, t);
  d.root = root;
  d.what = what;
  check(d);
  torch::Tensor c = on_comm_device(t);
  std::vector<at::Tensor> v{c};
  c10d::BroadcastOptions o;
  o.rootRank = root;
  wait(group_->pg()->broadcast(v, o), d);
  if (!c.is_same(t)) t.copy_(c);
}

std::vector<torch::Tensor> Collectives::all_gather(const torch::Tensor& t, const char* what) {
  if (!group_->pg()) return {t.clone()};
  Desc d = Desc::of(OpCode::AllGather, t);
  d.what = what;
  check(d);
  std::vector<torch::Tensor> out;
  wait(start_all_gather(*group_->pg(), size(), on_comm_device(t), out), d);
  for (auto& o : out)
    if (o.device() != t.device()) o = o.to(t.device());
  return out;
}

void Collectives::Started::wait() {
  if (!finish_) return;
  auto f = std::move(finish_);
  finish_ = nullptr;
  f();
}

Collectives::Started Collectives::start_all_gather_into(const torch::Tensor& full, const torch::Tensor& shard,
                                                        const char* what) {
  TORCH_CHECK(full.is_contiguous() && shard.is_contiguous() && full.numel() == shard.numel() * size() &&
                  full.scalar_type() == shard.scalar_type(),
              "start_all_gather_into: full must be world x shard, contiguous, of shard's dtype");
  Started s;
  if (!group_->pg()) {  // one rank: done now, still pending until the caller's wait()
    full.copy_(shard.reshape(full.sizes()));
    s.finish_ = [] {};
    return s;
  }
  Desc d = Desc::of(OpCode::AllGather, shard);
  d.what = what;
  check(d);
  // Tensors on another device than the group's (Gloo with CUDA tensors: two ranks sharing one
  // GPU, which NCCL refuses) travel through copies on the group's device.
  const torch::Device comm = group_->comm_device();
  const bool staged = shard.device() != comm;
  const torch::Tensor io_full = staged ? torch::empty(full.sizes(), full.options().device(comm)) : full;
  const torch::Tensor io_shard = staged ? shard.to(comm) : shard;
  c10::intrusive_ptr<c10d::Work> work;
  auto flat_full = io_full.view({-1}), flat_shard = io_shard.view({-1});
  if (group_->backend() == "nccl") {
    d.stream_wait = true;
    work = group_->pg()->_allgather_base(flat_full, flat_shard);
  } else {  // Gloo: the list form (its flat form is not on every version), chunks of `full`
    std::vector<std::vector<at::Tensor>> outs{flat_full.chunk(size())};
    std::vector<at::Tensor> in{flat_shard};
    work = group_->pg()->allgather(outs, in);
  }
  s.finish_ = [this, work, d, full, io_full, io_shard, staged] {
    wait(work, d);
    if (staged) full.copy_(io_full);
  };
  return s;
}

Collectives::Started Collectives::start_reduce_scatter(const torch::Tensor& shard, const torch::Tensor& full,
                                                       const char* what) {
  TORCH_CHECK(full.is_contiguous() && shard.is_contiguous() && full.numel() == shard.numel() * size() &&
                  full.scalar_type() == shard.scalar_type(),
              "start_reduce_scatter: full must be world x shard, contiguous, of shard's dtype");
  Started s;
  if (!group_->pg()) {  // one rank: as start_all_gather_into's
    shard.copy_(full.reshape(shard.sizes()));
    s.finish_ = [] {};
    return s;
  }
  Desc d = Desc::of(OpCode::ReduceScatter, shard);
  d.what = what;
  check(d);
  const torch::Device comm = group_->comm_device();  // staged as start_all_gather_into's
  const bool staged = shard.device() != comm;
  const torch::Tensor io_full = staged ? full.to(comm) : full;
  const torch::Tensor io_shard = staged ? torch::empty(shard.sizes(), shard.options().device(comm)) : shard;
  c10::intrusive_ptr<c10d::Work> work;
  auto flat_full = io_full.view({-1}), flat_shard = io_shard.view({-1});
  if (group_->backend() == "nccl") {
    d.stream_wait = true;
    work = group_->pg()->_reduce_scatter_base(flat_shard, flat_full);
  } else {
    std::vector<at::Tensor> out{flat_shard};
    std::vector<std::vector<at::Tensor>> ins{flat_full.chunk(size())};
    work = group_->pg()->reduce_scatter(out, ins);
  }
  s.finish_ = [this, work, d, shard, io_full, io_shard, staged] {
    wait(work, d);
    if (staged) shard.copy_(io_shard);
  };
  return s;
}

// ---- point-to-point ---------------------------------------------------------------------------
namespace {

// Gloo matches a pair's messages by tag in order: every payload on one tag and every descriptor on
// another keeps one FIFO per pair of ranks, NCCL's order (which ignores tags), so that a schedule
// that would deadlock or cross its messages under NCCL does so on the CPU too.
constexpr int kPayloadTag = 1, kDescriptorTag = 2;
constexpr int64_t kP2PWords = 14;  // tag, step, dtype, ndim, dims[8], numel, kind

torch::Tensor p2p_descriptor(const P2POp& op, int64_t step) {
  auto d = torch::zeros({kP2PWords}, torch::kLong);
  int64_t* w = d.data_ptr<int64_t>();
  const torch::Tensor& t = op.tensor;
  w[0] = op.tag;
  w[1] = step;
  w[2] = static_cast<int64_t>(t.scalar_type());
  w[3] = t.dim();
  for (int64_t i = 0; i < std::min<int64_t>(t.dim(), 8); ++i) w[4 + i] = t.size(i);
  w[12] = t.numel();
  w[13] = static_cast<int64_t>(op.kind);
  return d;
}

std::string shape_text(const int64_t* w) {
  std::ostringstream os;
  os << c10::toString(static_cast<c10::ScalarType>(w[2])) << " [";
  for (int64_t i = 0; i < std::min<int64_t>(w[3], 8); ++i) os << (i ? ", " : "") << w[4 + i];
  os << (w[3] > 8 ? ", ...]" : "]");
  return os.str();
}

}  // namespace

void Collectives::run_send_checks() {
  std::map<uint64_t, std::function<void(bool)>> checks;
  checks.swap(send_checks_);
  for (auto& [id, check] : checks) check(/*arrived_only=*/true);
}

uint64_t Collectives::take_p2p_balance() {
  const uint64_t b = p2p_balance_;
  p2p_balance_ = 0;
  return b;
}

// Each pair's messages in two rounds, one coalesced batch: every send's descriptor to its receiver
// (matched, in order, with the receiver's receives from this rank), then every receive's expected
// descriptor back to its sender (matched with the sender's sends). A receive waits for its sender's
// descriptor here (a receive waits anyway) and throws before its payload is posted; a send does not
// wait (sends stay asynchronous, as the schedule's simulation assumes): the returned check, run
// before its payload is waited for, throws the same message on the sender.
std::function<void(bool)> Collectives::validate_p2p(const std::vector<P2POp>& ops, const char* what,
                                                    const std::function<std::string(int64_t)>& name) {
  const torch::Device comm = group_->comm_device();
  const bool nccl = group_->backend() == "nccl";
  std::vector<torch::Tensor> mine, theirs;
  auto works = std::make_shared<std::vector<c10::intrusive_ptr<c10d::Work>>>(2 * ops.size());  // [round][op]
  Desc probe;
  probe.op = static_cast<int64_t>(OpCode::Send);
  probe.what = what;
  probe.validation = true;
  probe.seq = static_cast<int64_t>(p2p_seq_);
  probe.issued = std::chrono::steady_clock::now();
  for (const P2POp& op : ops) {
    mine.push_back(p2p_descriptor(op, step_).to(comm));
    theirs.push_back(torch::empty({kP2PWords}, torch::TensorOptions().dtype(torch::kLong).device(comm)));
  }
  if (nccl) group_->pg()->startCoalescing(comm.type());
  for (const int round : {0, 1})
    for (size_t i = 0; i < ops.size(); ++i) {
      // Round one: a send's descriptor out, a receive's sender's descriptor in; round two: a
      // receive's expectation out, a send's receiver's expectation in.
      const bool send = ops[i].kind == P2POp::Kind::Send, out = send == (round == 0);
      std::vector<at::Tensor> t{out ? mine[i] : theirs[i]};
      const int peer = static_cast<int>(ops[i].peer);
      (*works)[round * ops.size() + i] =
          out ? group_->pg()->send(t, peer, kDescriptorTag) : group_->pg()->recv(t, peer, kDescriptorTag);
    }
  if (nccl) {
    auto all = group_->pg()->endCoalescing(comm.type());
    works->assign(works->size(), nullptr);
    works->front() = all;
  }
  probe.step = step_;
  // The sends' or the receives' mismatches, once every descriptor of the batch is in (the peer
  // posts its side of a batch at once, so this waits for nothing but the peer's call).
  // `arrived_only`: a failure path's check, which waits a moment at most for each descriptor (one
  // from a receiver that left with the mismatch is already here) and says nothing when one is not.
  auto check = [this, ops, mine, theirs, works, probe, what = std::string(what), name](bool sends,
                                                                                       bool arrived_only = false) {
    for (auto& w : *works) {
      if (!w) continue;
      if (arrived_only) {
        try {
          w->wait(std::chrono::milliseconds(1000));
        } catch (const std::exception&) {
          return;
        }
      } else {
        wait(w, probe);
      }
      w.reset();  // (a Gloo receive waited twice would wait for another message)
    }
    const auto named = [&](int64_t tag) { return name ? name(tag) : "message tag " + std::to_string(tag); };
    std::string errors;
    for (size_t i = 0; i < ops.size(); ++i) {
      const bool send = ops[i].kind == P2POp::Kind::Send;
      if (send != sends) continue;
      const auto a = mine[i].cpu(), b = theirs[i].cpu();
      const int64_t *m = a.data_ptr<int64_t>(), *t = b.data_ptr<int64_t>();
      if (std::equal(m, m + 13, t) && t[13] != m[13]) continue;
      const int64_t *sent = send ? m : t, *expected = send ? t : m;
      std::ostringstream os;
      os << "\n  " << group_->rank_name(send ? rank() : ops[i].peer) << " sends " << named(sent[0]) << " of step "
         << sent[1] << " as " << shape_text(sent) << "; " << group_->rank_name(send ? ops[i].peer : rank())
         << " expects " << named(expected[0]) << " of step " << expected[1] << " as " << shape_text(expected);
      errors += os.str();
    }
    if (!errors.empty())
      throw CollectiveMismatch("point-to-point mismatch at step " + std::to_string(probe.step) + " (" + what +
                               "):" + errors +
                               "\nthe two ranks of a pair must send and receive the same messages, in the same "
                               "order, with the same dtypes and shapes");
  };
  bool receives = false, sends = false;
  for (const P2POp& op : ops) (op.kind == P2POp::Kind::Send ? sends : receives) = true;
  if (receives) {
    try {
      check(false);
    } catch (const CollectiveError&) {
      run_send_checks();  // a receiver that found a mismatch left: say it here too
      throw;
    }
  }
  if (!sends) return nullptr;
  return [check](bool arrived_only) { check(true, arrived_only); };
}

Collectives::Started Collectives::start_p2p(std::vector<P2POp> ops, const char* what,
                                            const std::function<std::string(int64_t)>& name) {
  Started s;
  if (ops.empty()) {
    s.finish_ = [] {};
    return s;
  }
  if (!group_->pg()) throw std::logic_error(std::string("start_p2p (") + what + "): a one-rank group has no peer");
  for (const P2POp& op : ops)
    TORCH_CHECK(op.peer >= 0 && op.peer < size() && op.peer != rank() && op.tensor.defined() &&
                    op.tensor.is_contiguous() && op.tag >= 0 && op.tag < (int64_t{1} << 48),
                "start_p2p (", what, "): peer ", op.peer, " of ", size(), " ranks, a contiguous tensor and ",
                "0 <= tag < 2^48");
  // While validating: the receives checked now, the sends before their payload is waited for.
  // Messages are described on the first step only (dist.validate always or first_step; as ZeRO-3
  // validates its first step's schedule and replays it after): later steps are confirmed by the
  // balance word in the step's consensus, which costs no message of its own.
  const bool described = validating() && step_ <= 1;
  const std::function<void(bool)> check = described ? validate_p2p(ops, what, name) : nullptr;
  // A send's check waits for its receiver's descriptor at wait(), or, when some point-to-point of
  // this rank fails first (the receiver found the mismatch and left), before that failure is said.
  const uint64_t check_id = next_send_check_++;
  if (check) send_checks_[check_id] = check;
  const torch::Device comm = group_->comm_device();
  const bool nccl = group_->backend() == "nccl";
  std::vector<Desc> descs;
  std::vector<torch::Tensor> io;  // on the group's device (a copy when the tensor is elsewhere)
  for (const P2POp& op : ops) {
    const bool send = op.kind == P2POp::Kind::Send;
    Desc d = Desc::of(send ? OpCode::Send : OpCode::Recv, op.tensor);
    d.what = what;
    d.root = op.peer;
    d.extra = op.tag;
    d.step = step_;
    d.seq = static_cast<int64_t>(p2p_seq_++);
    d.issued = std::chrono::steady_clock::now();
    d.captured = CaptureScope::active();
    d.stream_wait = nccl;
    // The balance: this message's hash, + sent, - received (the group's name makes it the world's).
    const int64_t src = send ? rank() : op.peer, dst = send ? op.peer : rank();
    std::vector<int64_t> words = {
        static_cast<int64_t>(fingerprint(group_->name())), src, dst, op.tag, step_, d.dtype, d.ndim};
    words.insert(words.end(), d.dims, d.dims + Desc::kDims);
    const uint64_t h = fingerprint(words);
    p2p_balance_ += send ? h : (~h + 1);
    observe_start(d);
    descs.push_back(d);
    io.push_back(op.tensor.device() == comm ? op.tensor : op.tensor.to(comm));
  }
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  if (nccl) group_->pg()->startCoalescing(comm.type());
  for (size_t i = 0; i < ops.size(); ++i) {
    std::vector<at::Tensor> t{io[i]};
    const int peer = static_cast<int>(ops[i].peer);
    works.push_back(ops[i].kind == P2POp::Kind::Send ? group_->pg()->send(t, peer, kPayloadTag)
                                                     : group_->pg()->recv(t, peer, kPayloadTag));
  }
  if (nccl) works = {group_->pg()->endCoalescing(comm.type())};
  s.finish_ = [this, ops = std::move(ops), descs = std::move(descs), io = std::move(io), works = std::move(works),
               check_id] {
    if (auto it = send_checks_.find(check_id); it != send_checks_.end()) {
      const std::function<void(bool)> check = std::move(it->second);
      send_checks_.erase(it);
      check(false);
    }
    const auto t0 = std::chrono::steady_clock::now();
    for (size_t i = 0; i < works.size(); ++i) {
      if (!works[i]) continue;
      try {
        if (descs[i].stream_wait)
          works[i]->wait();
        else
          works[i]->wait(group_->timeout() - report_grace());
      } catch (const std::exception& e) {
        const Desc& d = descs[std::min(i, descs.size() - 1)];
        run_send_checks();
        CollectiveError error = failed(std::string(d.what) + ": " + describe(d), e.what());
        observe_failure(d, error.what(), timed_out(e.what()) ? OpRecord::Outcome::TimedOut : OpRecord::Outcome::Failed);
        throw error;
      }
    }
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    for (size_t i = 0; i < ops.size(); ++i) {
      const bool send = ops[i].kind == P2POp::Kind::Send;
      if (!send && io[i].data_ptr() != ops[i].tensor.data_ptr()) ops[i].tensor.copy_(io[i]);
      const int64_t bytes = static_cast<int64_t>(io[i].nbytes());
      // (NCCL coalesces a schedule's messages into one work: each message ends with it)
      tally(descs[i], bytes, send ? bytes : 0, send ? 0 : bytes, i == 0 ? ms : 0.0,
            descs[i].stream_wait && !descs[i].captured ? device_result(works[std::min(i, works.size() - 1)]) : nullptr);
    }
  };
  return s;
}

void Collectives::barrier(const char* what) {
  if (!group_->pg()) return;
  Desc d;
  d.op = static_cast<int64_t>(OpCode::Barrier);
  d.what = what;
  check(d);
  // A barrier is an all-reduce of one element: Gloo's barrier does not take the timeout
  // from the options on every version, an all-reduce does.
  auto one = on_comm_device(torch::ones({1}));
  std::vector<at::Tensor> v{one};
  wait(group_->pg()->allreduce(v), d);
}

void Collectives::broadcast_coalesced(std::vector<torch::Tensor>& tensors, int64_t root, const char* what,
                                      size_t bucket_bytes) {
  if (!group_->pg() || tensors.empty()) return;
  Desc d;
  d.op = static_cast<int64_t>(OpCode::BroadcastCoalesced);
  d.root = root;
  d.what = what;
  d.extra = static_cast<int64_t>(tensors.size());
  std::vector<int64_t> words;
  for (const auto& t : tensors) {
    words.push_back(static_cast<int64_t>(t.scalar_type()));
    for (auto s : t.sizes()) words.push_back(s);
    words.push_back(-1);
    d.numel += t.numel();
  }
  d.dims[0] = static_cast<int64_t>(fingerprint(words));  // the list's layout, in one word
  d.ndim = 0;
  check(d);
  const auto t0 = std::chrono::steady_clock::now();
  try {
    c10d::broadcast_coalesced(group_->pg(), tensors, bucket_bytes, static_cast<int>(root));
  } catch (const std::exception& e) {
    std::string m = e.what();
    const CollectiveError error(std::string(what) + ": " + describe(d) + " failed: " + m.substr(0, m.find('\n')));
    observe_failure(d, error.what(), timed_out(m) ? OpRecord::Outcome::TimedOut : OpRecord::Outcome::Failed);
    throw error;
  }
  int64_t bytes = 0;
  for (const auto& t : tensors) bytes += static_cast<int64_t>(t.nbytes());
  tally(d, bytes, rank() == root ? bytes : 0, rank() == root ? 0 : bytes,
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
}

struct PendingStep::Impl {
  int64_t step = 0, plan = 0, seq = 0, fingerprint = 0;
  torch::Tensor found_inf;
  HostCopy record;  // [world, 9] int64: each rank's (fingerprint, step, plan, loss bits, nonfinite, compute us, flags,
                    // weight bits, point-to-point balance)
  c10::intrusive_ptr<c10d::Work> work;  // waited for by the host only at resolve() (a GPU group)
};

const torch::Tensor& PendingStep::found_inf() const {
  static const torch::Tensor none;
  return impl_ ? impl_->found_inf : none;
}

Collectives::Desc Collectives::step_desc(int64_t step, uint64_t plan, int64_t seq) {
  Desc d;
  d.op = static_cast<int64_t>(OpCode::StepSync);
  d.step = step;
  d.extra = static_cast<int64_t>(plan & ((1ull << 62) - 1));  // 62 bits, as a fingerprint
  d.seq = seq;
  d.what = "per-step consensus";
  d.dtype = static_cast<int64_t>(torch::kLong);
  d.numel = 9;
  return d;
}

// The record built on the host, exchanged and read at once (dist.consensus = step).
StepConsensus Collectives::step_sync(int64_t step, uint64_t plan, double loss, bool nonfinite, double compute_ms,
                                     uint32_t flags, const StepShare& share) {
  if (!group_->pg()) {  // one process: nothing to agree on
    StepConsensus c;
    c.mean_loss = share.weight > 0 ? loss : std::nan("");
    c.any_nonfinite = nonfinite;
    c.rank_compute_ms = {compute_ms};
    c.any_flags = c.all_flags = flags;
    return c;
  }
  Desc d = step_desc(step, plan, static_cast<int64_t>(seq_++));
  d.issued = std::chrono::steady_clock::now();
  observe_start(d);
  const int64_t f = static_cast<int64_t>(fingerprint(d.words())), p = d.extra;
  int64_t loss_bits, weight_bits;
  std::memcpy(&loss_bits, &loss, sizeof loss);
  std::memcpy(&weight_bits, &share.weight, sizeof share.weight);
  auto mine = torch::tensor({f, step, p, loss_bits, int64_t(nonfinite), static_cast<int64_t>(compute_ms * 1000.0),
                             int64_t(flags), weight_bits, static_cast<int64_t>(share.p2p_balance)},
                            torch::kLong);
  std::vector<torch::Tensor> out;
  wait(start_all_gather(*group_->pg(), size(), on_comm_device(mine), out), d);
  return read_step(torch::stack(out).cpu(), f, step, nullptr);
}

// No separate validation round: the record itself carries the step and plan, and is checked when
// it is resolved; until then found_inf() holds back the update of a rank that disagrees.
PendingStep Collectives::exchange_step(int64_t step, uint64_t plan, const torch::Tensor& loss,
                                       const torch::Tensor& nonfinite, double compute_ms, uint32_t flags,
                                       const StepShare& share) {
  PendingStep p;
  p.impl_ = std::make_shared<PendingStep::Impl>();
  auto& im = *p.impl_;
  im.step = step;
  im.seq = group_->pg() ? static_cast<int64_t>(seq_++) : 0;
  Desc d = step_desc(step, plan, im.seq);
  d.issued = std::chrono::steady_clock::now();
  if (group_->pg()) observe_start(d);
  im.plan = d.extra;
  im.fingerprint = static_cast<int64_t>(fingerprint(d.words()));
  const torch::Device dev = group_->pg() ? group_->comm_device() : loss.device();
  // The host's fields travel through pinned memory without a wait; the device's stay there.
  int64_t weight_bits;
  std::memcpy(&weight_bits, &share.weight, sizeof share.weight);
  auto host = torch::tensor({im.fingerprint, step, im.plan, static_cast<int64_t>(compute_ms * 1000.0), int64_t(flags),
                             weight_bits, static_cast<int64_t>(share.p2p_balance)},
                            torch::kLong);
  const torch::Tensor fields =
      dev.is_cpu() ? host : host.pin_memory().to(torch::TensorOptions().device(dev), /*non_blocking=*/true);
  const torch::Tensor loss_bits = loss.detach().reshape({1}).to(dev).to(torch::kDouble).contiguous().view(torch::kLong);
  const torch::Tensor bad = nonfinite.detach().reshape({1}).to(dev).ne(0).to(torch::kLong);
  const torch::Tensor mine = torch::cat({fields.slice(0, 0, 3), loss_bits, bad, fields.slice(0, 3, 7)});
  torch::Tensor all;
  if (!group_->pg()) {
    all = mine.unsqueeze(0);
  } else {
    std::vector<torch::Tensor> out;
    im.work = start_all_gather(*group_->pg(), size(), mine, out);
    // On the CPU the host waits here, as for every collective; on a GPU only the stream does
    // (the host waits, bounded by dist.timeout_s, in resolve()).
    if (dev.is_cpu()) {
      wait(im.work, d);
      im.work.reset();
    } else {
      im.work->wait();
      count(d, 0.0, device_result(im.work));
    }
    all = torch::stack(out);
  }
  torch::Tensor found = all.select(1, 4).ne(0).any();
  if (mode_ != Validate::Off)  // a plan that differs, or a message not received as sent
    found = found.logical_or(all.select(1, 0).ne(mine[0]).any()).logical_or(all.select(1, 8).sum().ne(0));
  im.found_inf = found.to(torch::kFloat).reshape({1});
  im.record = HostCopy::start(all);
  return p;
}

StepConsensus Collectives::resolve(PendingStep& pending, double* local_loss) {
  if (!pending) throw std::logic_error("Collectives::resolve: no exchanged step");
  auto& im = *pending.impl_;
  const Desc d = step_desc(im.step, im.plan, im.seq);
  if (im.work) {  // a GPU group: the host waits for the all-gather, bounded by dist.timeout_s
    const auto t0 = std::chrono::steady_clock::now();
    try {
      im.work->wait(group_->timeout() - report_grace());
    } catch (const std::exception& e) {
      step_ = im.step;  // the failure names the step whose record it is
      CollectiveError error = failed(std::string(d.what) + ": " + describe(d), e.what());
      observe_failure(d, error.what(), timed_out(e.what()) ? OpRecord::Outcome::TimedOut : OpRecord::Outcome::Failed);
      throw error;
    }
    {
      std::lock_guard<std::mutex> lock(door_->mu);
      door_->traffic.wait_ms +=
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    }
    im.work.reset();
  }
  return read_step(im.record.get(), im.fingerprint, im.step, local_loss);
}

// Every rank's record ([world, 9] int64 on the host): the consensus, or CollectiveMismatch naming
// each rank's step and plan when a fingerprint differs from this rank's (`mine`). The mean loss
// is Σ weight·loss / Σ weight (with every weight 1, exactly the plain mean: 1·l is l, Σ1 is n).
StepConsensus Collectives::read_step(const torch::Tensor& all, int64_t mine, int64_t step, double* local_loss) const {
  const int64_t n = all.size(0);
  StepConsensus c;
  bool agree = true;
  double sum = 0, weights = 0;
  uint64_t p2p = 0;  // Σ balances, mod 2^64
  c.all_flags = ~0u;
  for (int64_t r = 0; r < n; ++r) {
    const int64_t* w = all[r].data_ptr<int64_t>();
    agree &= (w[0] == mine);
    double l, weight;
    std::memcpy(&l, &w[3], sizeof l);
    std::memcpy(&weight, &w[7], sizeof weight);
    if (weight != 0) sum += weight * l;  // a weightless rank's loss (none computed) counts for nothing, NaN or not
    weights += weight;
    p2p += static_cast<uint64_t>(w[8]);
    if (local_loss && r == (group_->pg() ? rank() : 0)) *local_loss = l;
    c.any_nonfinite |= (w[4] != 0);
    c.rank_compute_ms.push_back(static_cast<double>(w[5]) / 1000.0);
    c.any_flags |= static_cast<uint32_t>(w[6]);
    c.all_flags &= static_cast<uint32_t>(w[6]);
  }
  if (!agree && mode_ != Validate::Off) {
    std::ostringstream os;
    os << "ranks disagree at the end of step " << step << "'s backward; no update was applied:";
    for (int64_t r = 0; r < n; ++r) {
      const int64_t* w = all[r].data_ptr<int64_t>();
      os << "\n  " << group_->rank_name(r) << ": step " << w[1] << ", gradient plan " << std::hex << w[2] << std::dec;
    }
    os << "\nall ranks must run the same number of micro-batches per step over the same parameters";
    throw CollectiveMismatch(os.str());
  }
  if (p2p != 0 && mode_ != Validate::Off)
    throw CollectiveMismatch("point-to-point at step " + std::to_string(step) +
                             ": the messages received are not the messages sent (another tag, dtype or shape, or "
                             "one not received); no update was applied. Rerun with dist.validate = \"always\" to "
                             "name the pair and both shapes");
  c.mean_loss = weights > 0 ? sum / weights : std::nan("");
  return c;
}

std::vector<std::string> all_gather_strings(Collectives& coll, const std::string& mine, const char* what) {
  return gather_strings(mine, [&](const torch::Tensor& t) { return coll.all_gather(t, what); });
}

Disagreement agree(Collectives& coll, uint64_t fingerprint, const std::function<std::string()>& describe,
                   const char* what) {
  Disagreement d = run_agreement(
      fingerprint, describe, [&](torch::Tensor& pair) { coll.all_reduce(pair, ReduceOp::Min, what); },
      [&](const std::string& mine) { return all_gather_strings(coll, mine, what); });
  if (d)
    for (int64_t r = 0; r < coll.size(); ++r) d.names.push_back(coll.group()->rank_name(r));
  return d;
}

std::vector<RankError> errors_on_every_rank(Collectives& coll, const std::string& mine, const char* what) {
  auto any = torch::tensor({mine.empty() ? int64_t{0} : int64_t{1}}, torch::kLong);
  coll.all_reduce(any, ReduceOp::Max, what);
  if (any.item<int64_t>() == 0) return {};
  constexpr size_t kBytes = 2048;  // each rank's message, at most
  std::vector<RankError> out;
  const auto all = all_gather_strings(coll, mine.substr(0, kBytes), what);
  for (size_t r = 0; r < all.size(); ++r)
    if (!all[r].empty()) out.push_back({static_cast<int64_t>(r), all[r]});
  return out;
}

RankError first_error(Collectives& coll, const std::string& mine, const char* what) {
  const auto all = errors_on_every_rank(coll, mine, what);
  return all.empty() ? RankError{} : all.front();
}

}  // namespace keel::dist
