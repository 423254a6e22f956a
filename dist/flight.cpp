#include "dist/flight.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "common/stop.h"
#include "dist/mesh.h"
#include "dist/phase.h"
#include "keel/common/log_level.h"

namespace keel::dist {
namespace {

std::atomic<bool> g_dump_requested{false};
extern "C" void on_sigusr1(int) { g_dump_requested.store(true); }

const char* lane_name(OpRecord::Lane l) {
  switch (l) {
    case OpRecord::Lane::Calls:
      return "calls";
    case OpRecord::Lane::Replay:
      return "replay";
    case OpRecord::Lane::P2P:
      return "p2p";
    case OpRecord::Lane::Bucket:
      return "bucket";
    case OpRecord::Lane::Raw:
      return "raw";
  }
  return "?";
}

const char* kind_name(OpRecord::Kind k) {
  switch (k) {
    case OpRecord::Kind::Collective:
      return "collective";
    case OpRecord::Kind::Probe:
      return "probe";
    case OpRecord::Kind::Replayed:
      return "replayed";
    case OpRecord::Kind::Bucket:
      return "bucket";
  }
  return "?";
}

// Enqueued: the host is done with it (NCCL: the stream waits), the device has not finished it.
enum class State : uint8_t { Issued, Completed, Failed, TimedOut, Mismatch, Enqueued };
const char* state_name(State s) {
  static const char* names[] = {"issued", "completed", "failed", "timed out", "mismatch", "enqueued"};
  return names[static_cast<size_t>(s)];
}

// Copies a string into a fixed field, cut to fit.
template <size_t N>
void put(char (&dst)[N], const std::string& src) {
  const size_t n = std::min(src.size(), N - 1);
  std::memcpy(dst, src.data(), n);
  dst[n] = '\0';
}

}  // namespace

bool take_dump_request() { return g_dump_requested.exchange(false); }

// One slot of the ring: fixed size, no allocation on the recording path (the error text of a
// failed operation excepted).
struct FlightRecorder::Entry {
  uint64_t id = 0;  // 1 + its place in the order of recording (0: an empty slot)
  char group[24] = {0};
  char what[64] = {0};
  const char* op = "";  // op_name()'s literals
  OpRecord::Kind kind = OpRecord::Kind::Collective;
  OpRecord::Lane lane = OpRecord::Lane::Calls;
  State state = State::Issued;
  c10::ScalarType dtype = c10::ScalarType::Undefined;
  int8_t ndim = 0;
  int64_t dims[8] = {0};
  uint64_t seq = 0;
  int64_t bytes = 0, step = 0, peer = -1, tag = -1;
  uint64_t phase = 0;
  int64_t enqueue_ns = 0, start_ns = 0, end_ns = 0;  // steady clock
  // The device finishes it (OpRecord::device): end_ns is when its work's result came, host_end_ns
  // when the host was done with it.
  bool device = false;
  int64_t host_end_ns = 0;
  std::string error;
};

struct FlightRecorder::Impl {
  FlightOptions o;
  std::vector<Entry> ring;
  mutable std::mutex mu;
  uint64_t next = 0;  // entries recorded
  // The open ones (issued, not ended): the slot's id, by (group, lane, seq). Few at a time (a
  // step's buckets, a replayed schedule's prefetch): a vector searched from the back.
  struct Open {
    std::string group;
    OpRecord::Lane lane;
    uint64_t seq;
    uint64_t id;
  };
  std::vector<Open> open, pending;
  std::vector<std::pair<std::string, std::string>> events;  // (reason, error), oldest first
  std::map<std::string, std::vector<int64_t>> groups;
  std::array<int64_t, 3> coords{0, 0, 0}, sizes{1, 1, 1};
  std::string mesh;
  // steady -> wall clock (the dumps of several hosts are compared by wall time).
  std::chrono::steady_clock::time_point steady0 = std::chrono::steady_clock::now();
  std::chrono::system_clock::time_point wall0 = std::chrono::system_clock::now();
  std::mutex dump_mu;
  bool device_failed = false;                                // a device result of failure was dumped (under `mu`)
  std::function<std::optional<std::string>()> peer_failure;  // under `mu`
  struct sigaction old_usr1 = {};
  std::thread watchdog;
  std::mutex wake_mu;
  std::condition_variable wake;
  bool stopping = false;

  static int64_t ns(std::chrono::steady_clock::time_point t) {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count();
  }
  double wall_ms(int64_t steady_ns) const {
    if (steady_ns == 0) return 0;
    const auto since = std::chrono::nanoseconds(steady_ns) - steady0.time_since_epoch();
    return std::chrono::duration<double, std::milli>(wall0.time_since_epoch() + since).count();
  }
  Entry& slot(uint64_t id) { return ring[(id - 1) % ring.size()]; }
  Entry* live(uint64_t id) {  // the entry `id` while the ring still holds it
    Entry& e = slot(id);
    return e.id == id ? &e : nullptr;
  }
  // Under `mu`: a new entry for `op`.
  Entry& append(const OpRecord& op, State state) {
    const uint64_t id = ++next;
    Entry& e = slot(id);
    e.id = id;
    put(e.group, op.group);
    put(e.what, op.what ? op.what : "");
    e.op = op.op;
    e.kind = op.kind;
    e.lane = op.lane;
    e.state = state;
    e.dtype = op.dtype;
    e.ndim = static_cast<int8_t>(std::min<size_t>(op.shape.size(), 8));
    std::copy(op.shape.begin(), op.shape.begin() + e.ndim, e.dims);
    e.seq = op.seq;
    e.bytes = op.bytes;
    e.step = op.step;
    e.peer = op.peer;
    e.tag = op.tag;
    e.phase = op.phase;
    e.enqueue_ns = ns(op.enqueue);
    e.start_ns = ns(op.start);
    e.end_ns = state == State::Issued ? 0 : ns(op.end);
    e.device = false;
    e.host_end_ns = 0;
    e.error.clear();
    return e;
  }
  // Under `mu`: the newest of the last 64 entries with `op`'s group, lane and number, or null.
  Entry* latest(const OpRecord& op) {
    for (uint64_t id = next; id > 0 && id + 64 > next; --id) {
      Entry* e = live(id);
      if (e && e->seq == op.seq && e->lane == op.lane && op.group == e->group) return e;
    }
    return nullptr;
  }
  // Under `mu`: an operation open on the host (`open`) or enqueued on the device (`pending`),
  // kept until it ends (bounded: the oldest goes first).
  static void keep(std::vector<Open>& in, const OpRecord& op, uint64_t id) {
    in.push_back({op.group, op.lane, op.seq, id});
    if (in.size() > kOpenMax) in.erase(in.begin());
  }
  static constexpr size_t kOpenMax = 4096;
  static void forget(std::vector<Open>& in, uint64_t id) {
    for (size_t i = in.size(); i-- > 0;)
      if (in[i].id == id) in.erase(in.begin() + static_cast<std::ptrdiff_t>(i));
  }
  // Under `mu`: entry `done` of `group` ended (on the host, or its work's result came): one
  // communicator runs its group's collectives in order, so each earlier one still enqueued on it
  // ended too (pipeline messages excepted: NCCL gives each pair its own).
  void settle_before(const char* group, OpRecord::Lane lane, uint64_t done, int64_t end_ns) {
    if (lane == OpRecord::Lane::P2P) return;
    for (size_t i = pending.size(); i-- > 0;) {
      const Open& o = pending[i];
      if (o.id >= done || o.lane == OpRecord::Lane::P2P || o.group != group) continue;
      if (Entry* e = live(o.id); e && e->state == State::Enqueued) e->state = State::Completed, e->end_ns = end_ns;
      pending.erase(pending.begin() + static_cast<std::ptrdiff_t>(i));
    }
  }
  // Under `mu`: the open entry of `op` (removed from `open`), or null.
  Entry* take_open(const OpRecord& op) {
    for (size_t i = open.size(); i-- > 0;) {
      const Open& o = open[i];
      if (o.seq == op.seq && o.lane == op.lane && o.group == op.group) {
        const uint64_t id = o.id;
        open.erase(open.begin() + static_cast<std::ptrdiff_t>(i));
        return live(id);
      }
    }
    return nullptr;
  }
  nlohmann::json entry_json(const Entry& e) const;
  nlohmann::json to_json() const;
  std::string path() const { return o.dir + "/rank" + std::to_string(o.rank) + ".json"; }
  bool dump(const std::string& reason, const std::string& error) noexcept;
  // The work's result of entry `id` came (a c10d::WorkResult): the device finished it, or the
  // backend gave up on it (then the record is dumped, as for a failure the host saw).
  void device_done(uint64_t id, c10::ivalue::Future& result);
};

FlightRecorder::FlightRecorder(FlightOptions options) : impl_(std::make_shared<Impl>()) {
  impl_->o = std::move(options);
  impl_->ring.resize(static_cast<size_t>(std::max<int64_t>(impl_->o.capacity, 1)));
  impl_->groups["world"] = {};
  for (int64_t r = 0; r < impl_->o.world_size; ++r) impl_->groups["world"].push_back(r);
  // A dump of an earlier run in this run.dir is set aside, so that `keel doctor` never reads a
  // rank's old record as this run's (a rank that dies now leaves none).
  std::error_code ec;
  if (std::filesystem::exists(path(), ec)) {
    std::filesystem::create_directories(impl_->o.dir + "/previous", ec);
    std::filesystem::rename(path(), impl_->o.dir + "/previous/rank" + std::to_string(impl_->o.rank) + ".json", ec);
  }
  struct sigaction sa = {};
  sa.sa_handler = on_sigusr1;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  ::sigaction(SIGUSR1, &sa, &impl_->old_usr1);
  impl_->watchdog = std::thread([this] { watch(); });
}

FlightRecorder::~FlightRecorder() {
  {
    std::lock_guard<std::mutex> lock(impl_->wake_mu);
    impl_->stopping = true;
  }
  impl_->wake.notify_all();
  if (impl_->watchdog.joinable()) impl_->watchdog.join();
  ::sigaction(SIGUSR1, &impl_->old_usr1, nullptr);
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->peer_failure = nullptr;
}

void FlightRecorder::install(const Mesh& mesh) {
  std::vector<Collectives*> seen;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    impl_->mesh = mesh.describe();
    for (const Axis a : kAxes) {
      impl_->coords[static_cast<size_t>(a)] = mesh.coordinate(a);
      impl_->sizes[static_cast<size_t>(a)] = mesh.size(a);
      if (mesh.size(a) > 1) impl_->groups[mesh.on(a).group()->name()] = mesh.group_ranks(a);
    }
  }
  for (const Axis a : kAxes) {
    Collectives* c = &mesh.on(a);
    if (std::find(seen.begin(), seen.end(), c) != seen.end()) continue;
    seen.push_back(c);
    c->set_observer(std::shared_ptr<OpObserver>(std::shared_ptr<OpObserver>{}, this));
  }
}

void FlightRecorder::on_start(const OpRecord& op) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  const Entry& e = impl_->append(op, State::Issued);
  Impl::keep(impl_->open, op, e.id);
}

void FlightRecorder::on_end(const OpRecord& op) {
  uint64_t id = 0;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    if (op.kind == OpRecord::Kind::Probe) return;  // its call's entry covers it (issued before it)
    Entry* e = impl_->take_open(op);
    if (!e) e = &impl_->append(op, State::Completed);
    e->state = State::Completed;
    e->end_ns = Impl::ns(op.end);
    e->bytes = op.bytes;
    if (!op.device) {
      impl_->settle_before(e->group, e->lane, e->id, e->end_ns);
      return;
    }
    // The device finishes it: open (the watchdog's stall check sees it) until its result comes.
    e->device = true;
    e->host_end_ns = e->end_ns;
    e->end_ns = 0;
    e->state = State::Enqueued;
    id = e->id;
    Impl::keep(impl_->pending, op, id);
  }
  // Outside the lock: a result already there runs the callback here and now. The callback holds
  // the recorder weakly (a result may come after the run, from the backend's watchdog thread,
  // which an exception would end: none leaves it).
  op.device->addCallback([weak = std::weak_ptr<Impl>(impl_), id](c10::ivalue::Future& result) {
    try {
      if (auto impl = weak.lock()) impl->device_done(id, result);
    } catch (...) {
    }
  });
}

void FlightRecorder::Impl::device_done(uint64_t id, c10::ivalue::Future& result) {
  State state = State::Failed;
  std::string reason;
  {
    std::lock_guard<std::mutex> lock(mu);
    Entry* e = live(id);
    forget(pending, id);
    if (!e || e->state != State::Enqueued) return;  // gone from the ring, failed at its wait, settled
    const int64_t code = result.hasError()        ? -1
                         : result.value().isInt() ? result.value().toInt()
                                                  : static_cast<int64_t>(-1);
    state = code == static_cast<int64_t>(c10d::WorkResult::SUCCESS)   ? State::Completed
            : code == static_cast<int64_t>(c10d::WorkResult::TIMEOUT) ? State::TimedOut
                                                                      : State::Failed;
    e->state = state;
    e->end_ns = ns(std::chrono::steady_clock::now());
    if (state == State::Completed) {
      settle_before(e->group, e->lane, id, e->end_ns);
      return;
    }
    e->error = state == State::TimedOut ? "the backend's watchdog timed it out on the device"
                                        : "the backend reported an error of its communicator";
    // A communicator's error fails each of its pending works: the first one is dumped.
    if (device_failed) return;
    device_failed = true;
    reason = std::string("collective ") + state_name(state) + " on the device (" + e->group + " " + e->op + " #" +
             std::to_string(e->seq) + ")";
  }
  dump(reason, "");  // (the backend may take the process down next: its record is written first)
}

void FlightRecorder::on_failure(const OpRecord& op, const std::string& error) {
  const State state = op.outcome == OpRecord::Outcome::TimedOut   ? State::TimedOut
                      : op.outcome == OpRecord::Outcome::Mismatch ? State::Mismatch
                                                                  : State::Failed;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    auto mark = [&](Entry& e) {
      e.state = state;
      e.end_ns = Impl::ns(op.end);
      e.error = error.substr(0, 2048);
    };
    if (op.seq == UINT64_MAX) {  // every one of the lane open on the host (an enqueued one has
      // left it: its device result says how it ended)
      for (size_t i = impl_->open.size(); i-- > 0;) {
        const Impl::Open& o = impl_->open[i];
        if (o.lane != op.lane || o.group != op.group) continue;
        if (Entry* e = impl_->live(o.id)) mark(*e);
        impl_->open.erase(impl_->open.begin() + static_cast<std::ptrdiff_t>(i));
      }
    } else {
      Entry* e = impl_->take_open(op);
      if (!e) e = impl_->latest(op);  // ended already (NCCL: at its enqueue), failed at its wait
      mark(e ? *e : impl_->append(op, state));
    }
  }
  dump(std::string("collective ") + state_name(state) + " (" + op.group + " " + op.op + " #" + std::to_string(op.seq) +
           ")",
       error);
}

void FlightRecorder::watch_peers(std::function<std::optional<std::string>()> peer_failure) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->peer_failure = std::move(peer_failure);
}

uint64_t FlightRecorder::recorded() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->next;
}

std::string FlightRecorder::path() const { return impl_->path(); }

nlohmann::json FlightRecorder::Impl::entry_json(const Entry& e) const {
  nlohmann::json j;
  j["id"] = e.id;
  j["group"] = e.group;
  j["lane"] = lane_name(e.lane);
  j["seq"] = e.seq;
  j["kind"] = kind_name(e.kind);
  j["op"] = e.op;
  j["what"] = e.what;
  j["dtype"] = e.dtype == c10::ScalarType::Undefined ? "" : c10::toString(e.dtype);
  j["shape"] = std::vector<int64_t>(e.dims, e.dims + e.ndim);
  j["bytes"] = e.bytes;
  if (e.peer >= 0) j["peer"] = e.peer;
  if (e.tag >= 0) j["tag"] = e.tag;
  const PhaseState p = PhaseState::unpack(e.phase, e.step);
  j["phase"] = phase_name(p.phase);
  j["where"] = p.describe();
  if (p.block >= 0) j["block"] = p.block;
  if (p.bucket >= 0) j["bucket"] = p.bucket;
  if (p.stage >= 0) j["stage"] = p.stage;
  if (p.micro >= 0) j["micro_batch"] = p.micro;
  j["step"] = e.step;
  j["enqueue_ms"] = wall_ms(e.enqueue_ns);
  j["start_ms"] = wall_ms(e.start_ns);
  if (e.end_ns) j["end_ms"] = wall_ms(e.end_ns);
  // Whose completion `end_ms` is: the host's, or the device's (the work's result; then the host
  // was done with it at host_end_ms).
  if (e.device || e.state != State::Issued) j["completion"] = e.device ? "device" : "host";
  if (e.device) j["host_end_ms"] = wall_ms(e.host_end_ns);
  j["state"] = state_name(e.state);
  if (!e.error.empty()) j["error"] = e.error;
  return j;
}

nlohmann::json FlightRecorder::Impl::to_json() const {
  nlohmann::json j;
  j["version"] = 1;
  j["rank"] = o.rank;
  j["world_size"] = o.world_size;
  j["host"] = o.host;
  j["pid"] = static_cast<int64_t>(::getpid());
  j["restart"] = o.restart;
  j["started_ms"] = std::chrono::duration<double, std::milli>(wall0.time_since_epoch()).count();
  j["mesh"] = mesh;
  j["coordinates"] = {{"pp", coords[0]}, {"dp", coords[1]}, {"tp", coords[2]}};
  j["groups"] = groups;
  j["capacity"] = ring.size();
  j["recorded"] = next;
  const PhaseState now = current_phase();
  j["phase"] = phase_name(now.phase);
  j["where"] = now.describe();
  j["step"] = now.step;
  // dist.timeout_s: how long an operation may stay open before it is a hang (keel doctor).
  if (o.stall.count() > 0) j["timeout_ms"] = o.stall.count();
  j["dumped_ms"] =
      std::chrono::duration<double, std::milli>(std::chrono::system_clock::now().time_since_epoch()).count();
  j["log_tail"] = logging::last_lines();
  j["events"] = nlohmann::json::array();
  for (const auto& [reason, error] : events) j["events"].push_back({{"reason", reason}, {"error", error}});
  j["ops"] = nlohmann::json::array();
  const uint64_t first = next > ring.size() ? next - ring.size() + 1 : 1;
  for (uint64_t id = first; id <= next; ++id) {
    const Entry& e = ring[(id - 1) % ring.size()];
    if (e.id == id) j["ops"].push_back(entry_json(e));
  }
  return j;
}

bool FlightRecorder::dump(const std::string& reason, const std::string& error) noexcept {
  return impl_->dump(reason, error);
}

bool FlightRecorder::Impl::dump(const std::string& reason, const std::string& error) noexcept {
  try {
    std::lock_guard<std::mutex> dump_lock(dump_mu);
    std::string text;
    {
      std::lock_guard<std::mutex> lock(mu);
      events.emplace_back(reason, error.substr(0, 4096));
      text = to_json().dump(1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
    }
    std::filesystem::create_directories(o.dir);
    const std::string final_path = path(), tmp = final_path + ".tmp." + std::to_string(::getpid());
    const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    bool ok = fd >= 0;
    for (size_t off = 0; ok && off < text.size();) {
      const ssize_t n = ::write(fd, text.data() + off, text.size() - off);
      ok = n > 0;
      off += ok ? static_cast<size_t>(n) : 0;
    }
    ok = ok && ::fsync(fd) == 0;
    if (fd >= 0) ::close(fd);
    ok = ok && ::rename(tmp.c_str(), final_path.c_str()) == 0;
    if (!ok) {
      ::unlink(tmp.c_str());
      std::fprintf(stderr, "keel: the flight record could not be written to %s: %s\n", final_path.c_str(),
                   std::strerror(errno));
    }
    return ok;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "keel: the flight record could not be written: %s\n", e.what());
    return false;
  }
}

// The watchdog: what the issuing thread cannot do while it is blocked in a wait.
void FlightRecorder::watch() {
  using namespace std::chrono_literals;
  int signalled = 0;
  uint64_t stuck_dumped = 0;
  auto next_poll = std::chrono::steady_clock::now() + 1s;
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(impl_->wake_mu);
      if (impl_->wake.wait_for(lock, 100ms, [&] { return impl_->stopping; })) {
        lock.unlock();
        if (take_dump_request()) dump("SIGUSR1 (asked where the run is; it goes on)");  // one that came last
        return;
      }
    }
    if (take_dump_request()) dump("SIGUSR1 (asked where the run is; it goes on)");
    if (const int sig = g_stop_signal.load(); sig && sig != signalled) {
      signalled = sig;
      dump("signal " + std::to_string(sig) + (sig == SIGTERM ? " (SIGTERM)" : sig == SIGINT ? " (SIGINT)" : ""));
    }
    const auto now = std::chrono::steady_clock::now();
    if (impl_->o.stall.count() > 0) {
      std::string stuck;
      {
        std::lock_guard<std::mutex> lock(impl_->mu);
        // The oldest stalled one not dumped yet (ids follow the order of issue, so of stalling).
        const Entry* oldest = nullptr;
        for (const auto* in : {&impl_->open, &impl_->pending})
          for (const Impl::Open& o : *in) {
            const Entry* e = impl_->live(o.id);
            if (!e || e->id <= stuck_dumped || (oldest && oldest->id < e->id) ||
                (e->state != State::Issued && e->state != State::Enqueued))
              continue;
            if (now - std::chrono::steady_clock::time_point(std::chrono::nanoseconds(e->start_ns)) >= impl_->o.stall)
              oldest = e;
          }
        if (const Entry* e = oldest) {
          stuck_dumped = e->id;
          stuck = std::string(e->group) + " " + e->op + " #" + std::to_string(e->seq) + " (" + e->what + ")" +
                  (e->state == State::Enqueued ? ", enqueued: the device has not finished it," : "");
        }
      }
      if (!stuck.empty()) dump("stuck: " + stuck + " open for longer than dist.timeout_s");
    }
    if (now >= next_poll && polling_.load()) {
      next_poll = now + 1s;
      std::function<std::optional<std::string>()> ask;
      {
        std::lock_guard<std::mutex> lock(impl_->mu);
        ask = impl_->peer_failure;
      }
      try {
        // (polling may have stopped while the store answered: the run's end, rank 0 leaving)
        if (auto why = ask ? ask() : std::nullopt; why && !why->empty() && polling_.exchange(false))
          dump("a peer failed", *why);
      } catch (const std::exception&) {
      }
    }
  }
}

}  // namespace keel::dist
