// keel/dist/collectives.h: the only door to the process group. Every collective keel issues (the
// initial broadcast, metric reductions, the per-step consensus, checkpoint coordination) and
// the public keel::dist API for user code go through Collectives, which first checks that all
// ranks agree on what they are about to do.
//
// The check: each call has a descriptor (op, reduce op, dtype, shape, root, device type and a
// per-group sequence number). Its 62-bit FNV-1a fingerprint f is all-reduced as the pair
// (f, -f) with MIN: all ranks agree iff min(f) == -min(-f), i.e. min == max. That is one
// 16-byte all-reduce in the common case; only on a mismatch are the full descriptors
// all-gathered, to name every rank's op, dtype and shape in the error, which every rank
// throws before the real collective runs (so it can neither hang on nor garble mismatched
// buffers). DDP's gradient buckets are covered by the per-step consensus (step_sync), which
// checks the step number and the bucket plan before the optimizer applies the gradients.
//
// dist.validate: always (every call), first_step (calls made while step <= 1), off.
//
// A collective that fails (dist.timeout_s passed, or a peer's connection dropped) raises
// CollectiveError on this rank naming the op, the step and the ranks that never reported a
// failure of their own through the store within a short grace period: the hung or dead ones.
// Thread-compatible: one thread issues collectives (as c10d requires of a group).
#pragma once

#include <torch/torch.h>

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "keel/dist/config.h"
#include "keel/dist/process_group.h"

namespace keel::dist {

enum class ReduceOp { Sum, Avg, Min, Max };

/// Ranks disagreed on a collective; the message names the op, the step and each rank's
/// dtype and shape. Thrown on every rank.
class CollectiveMismatch : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// A collective failed or timed out (dist.timeout_s); the message names the op and step.
class CollectiveError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// What every rank learns at the end of a step's backward (one all-gather).
struct StepConsensus {
  double mean_loss = 0;                 // the ranks' losses averaged, each by its weight (NaN: no weight)
  bool any_nonfinite = false;           // some rank saw inf/NaN (loss or gradients)
  std::vector<double> rank_compute_ms;  // each rank's forward+backward time this step
  uint32_t any_flags = 0;               // OR of every rank's `flags`
  uint32_t all_flags = 0;               // AND of every rank's `flags`
};

/// A rank's share of the per-step consensus beyond its loss (Collectives::step_sync).
struct StepShare {
  /// The loss's weight in the step's mean, Σ weight·loss / Σ weight: 1 on every rank, the plain
  /// mean; under pipeline parallelism only the last stage computes a loss and the others weigh 0.
  double weight = 1.0;
  /// Collectives::take_p2p_balance() of the step's point-to-point (summed over the world, 0 when
  /// every message was received as it was sent).
  uint64_t p2p_balance = 0;
};

/// One message of a point-to-point batch (Collectives::start_p2p): `tensor` sent to `peer` (a
/// rank of the group), or received into it from there. `tag` is the message's identity at both
/// ends (a pipeline's kind, stage and micro-batch; 0 <= tag < 2^48); a receive's dtype and shape
/// are what it expects.
struct P2POp {
  enum class Kind : uint8_t { Send, Recv };
  Kind kind = Kind::Send;
  int64_t peer = 0;
  torch::Tensor tensor;  // contiguous; stays in use until the batch's wait()
  int64_t tag = 0;
};

/// A per-step record on its way (Collectives::exchange_step): the exchange is issued and the
/// verdict is on the device, but the host has not waited for either. resolve() reads it.
class PendingStep {
 public:
  PendingStep() = default;
  /// float32, one element, on the devices' side (the group's device; the CPU with Gloo): 1 when
  /// some rank saw inf/NaN, or when some rank's step or gradient plan differs from this rank's
  /// (so that no update is applied before the disagreement is reported); else 0. What the fused
  /// optimizer and the GradScaler take as found_inf.
  const torch::Tensor& found_inf() const;
  explicit operator bool() const { return impl_ != nullptr; }

 private:
  friend class Collectives;
  struct Impl;
  std::shared_ptr<Impl> impl_;
};

/// What the collectives through one group's door cost this rank so far. The first six count the
/// control traffic: every call but DDP's gradient buckets (the per-step consensus, validation
/// probes, checkpoint coordination, evaluation totals, buffer broadcasts, ZeRO's gathers and
/// reduce-scatters, replayed ones included, user collectives); the last two DDP's buckets, which
/// the Reducer issues through the door from its comm hook.
struct TrafficStats {
  int64_t collectives = 0;       // calls, probes included
  int64_t probes = 0;            // of which validation probes (dist.validate)
  int64_t bytes_sent = 0;        // payload this rank contributed
  int64_t bytes_received = 0;    // payload it got back (world x its input for an all-gather)
  double wait_ms = 0;            // time spent waiting for them (latency, and other ranks' lateness)
  int64_t replayed = 0;          // of the calls, those replayed from a validated ZeRO schedule (no probe)
  int64_t gradient_buckets = 0;  // DDP's gradient bucket all-reduces completed
  int64_t gradient_bytes = 0;    // their payload (in the dtype on the wire)
  TrafficStats operator-(const TrafficStats& o) const {
    return {collectives - o.collectives,
            probes - o.probes,
            bytes_sent - o.bytes_sent,
            bytes_received - o.bytes_received,
            wait_ms - o.wait_ms,
            replayed - o.replayed,
            gradient_buckets - o.gradient_buckets,
            gradient_bytes - o.gradient_bytes};
  }
};

/// One operation through a group's door, as an OpObserver sees it.
struct OpRecord {
  enum class Kind { Collective, Probe, Replayed, Bucket };
  /// The numbering its `seq` belongs to: the group's calls (validated or replayed in a sequence),
  /// its replay lane (ZeRO-2/3's schedule), its point-to-point messages, DDP's gradient buckets,
  /// the calls others make on its raw process group (Collectives::raw_call).
  enum class Lane : uint8_t { Calls, Replay, P2P, Bucket, Raw };
  /// How it ended, for OpObserver::on_failure.
  enum class Outcome : uint8_t { Failed, TimedOut, Mismatch };
  Kind kind = Kind::Collective;
  Lane lane = Lane::Calls;
  std::string group;      // the group's name: "world", or a mesh axis's subgroup ("tp/2")
  uint64_t seq = 0;       // per group and lane
  const char* op = "";    // "all_reduce", "all_gather", "reduce_scatter", "send", ...
  const char* what = "";  // the caller's label: "DDP buffer broadcast", "DDP gradient bucket", ...
  std::vector<int64_t> shape;
  c10::ScalarType dtype = c10::ScalarType::Undefined;
  int64_t bytes = 0;   // payload this rank contributed (on_end; on_start: the tensor's)
  int64_t step = 0;    // the optimizer step (Collectives::step())
  int64_t peer = -1;   // a message's peer (send, recv), the root of a broadcast; else -1
  int64_t tag = -1;    // a message's tag (P2POp::tag: the same at both ends); else -1
  uint64_t phase = 0;  // where the rank was when it was issued: dist/phase.h's PhaseState::pack()
  // enqueue: when the door numbered it (before its validation); start: when it was issued; end:
  // in on_end only.
  std::chrono::steady_clock::time_point enqueue, start, end;
  Outcome outcome = Outcome::Failed;  // on_failure only
  // on_end of an operation whose result stays on the device (NCCL: the stream waits, not the
  // host): the work's own result (c10d's Work::getFutureResult), which the backend's watchdog
  // completes with a c10d::WorkResult (SUCCESS, TIMEOUT, COMM_ERROR) once the device finished it
  // or gave up. `end` is then when the host was done with it. Null when the host saw it complete.
  c10::intrusive_ptr<c10::ivalue::Future> device;
};

/// Sees every operation that passes a group's door (Collectives::set_observer): on_start once the
/// door numbered it, before its validation (a validation probe is reported by on_end alone),
/// on_end once the host saw it complete, on_failure when it failed, timed out or was found to
/// differ from its peers' (before the error unwinds; `op.seq` = UINT64_MAX: every operation of
/// the lane still open, DDP's buckets when the Reducer's backward failed). Called on the issuing
/// thread, except on_end of a DDP bucket: the backend's thread that completes it, so an
/// implementation is thread-safe. With NCCL, on_end of a bucket and of a collective whose result
/// stays on the device comes when the host enqueued it, with `op.device`: the work's result,
/// completed when the device finished it. It must not throw or issue collectives. The flight
/// recorder (dist/flight.h) is one.
class OpObserver {
 public:
  virtual ~OpObserver() = default;
  virtual void on_start(const OpRecord& /*op*/) {}
  virtual void on_end(const OpRecord& /*op*/) {}
  virtual void on_failure(const OpRecord& /*op*/, const std::string& /*error*/) {}
};

class Collectives {
 public:
  /// `validate`: dist.validate.
  Collectives(std::shared_ptr<Group> group, Validate validate);
  ~Collectives();

  int64_t rank() const { return group_->rank(); }
  int64_t size() const { return group_->size(); }
  const std::shared_ptr<Group>& group() const { return group_; }
  /// The current optimizer step (for messages and validate = first_step).
  void set_step(int64_t step) { step_ = step; }
  int64_t step() const { return step_; }
  bool validating() const;

  /// In place. Avg is Sum followed by a division (Gloo has no native average).
  void all_reduce(torch::Tensor& t, ReduceOp op = ReduceOp::Sum, const char* what = "all_reduce");
  void broadcast(torch::Tensor& t, int64_t root = 0, const char* what = "broadcast");
  /// Returns every rank's `t`, in rank order; all ranks must pass the same shape.
  std::vector<torch::Tensor> all_gather(const torch::Tensor& t, const char* what = "all_gather");
  void barrier(const char* what = "barrier");
  /// Broadcasts a list of tensors from `root`, coalesced into messages of at most
  /// `bucket_bytes` (c10d; up to two in flight). The list's dtypes and shapes are validated as
  /// one descriptor.
  void broadcast_coalesced(std::vector<torch::Tensor>& tensors, int64_t root = 0,
                           const char* what = "broadcast_coalesced", size_t bucket_bytes = size_t{256} << 20);

  /// A collective started and not yet finished: wait() finishes it (once; later calls and an
  /// empty Started do nothing), with the blocking calls' errors and traffic counting. True from
  /// its start until wait(), whatever the group: a one-rank group's work is done at the start
  /// (a copy), and the caller's wait() is still where it takes the result (issue 64: a
  /// reduce-scatter that tested false at dp 1 was never added into ZeRO's gradient shards).
  class Started {
   public:
    Started() = default;
    void wait();
    explicit operator bool() const { return static_cast<bool>(finish_); }

   private:
    friend class Collectives;
    std::function<void()> finish_;
  };
  /// Starts an all-gather of every rank's `shard` (validated like the blocking calls, before it
  /// starts) into `full`, flat: rank r's shard at r x shard.numel(). Both stay in use until wait().
  Started start_all_gather_into(const torch::Tensor& full, const torch::Tensor& shard, const char* what = "all_gather");
  /// Starts a reduce-scatter (sum) of `full` (flat, world x shard.numel()) into `shard`: rank r
  /// receives the sum over ranks of full's r-th chunk.
  Started start_reduce_scatter(const torch::Tensor& shard, const torch::Tensor& full,
                               const char* what = "reduce_scatter");

  /// The per-step consensus, one all-gather: checks that every rank is at the same `step`
  /// with the same `plan` fingerprint (gradient bucket layout), and shares losses, non-finite
  /// flags and compute times. `flags` are the caller's bits (e.g. "stop requested",
  /// "checkpoint written"), returned OR-ed and AND-ed over ranks. `share`: the loss's weight in
  /// the mean and the step's point-to-point balance (StepShare): a balance that does not sum to 0
  /// over the ranks is a CollectiveMismatch, as a plan that differs is.
  StepConsensus step_sync(int64_t step, uint64_t plan, double loss, bool nonfinite, double compute_ms,
                          uint32_t flags = 0, const StepShare& share = {});
  /// step_sync without waiting: `loss` (a float tensor of one element) and `nonfinite` (one
  /// element, non-zero = inf/NaN) may live on the device and are not read by the host. With
  /// NCCL the host neither waits for the all-gather nor for the values: the record is copied to
  /// pinned memory behind an event, and PendingStep::found_inf() is computed on the device.
  PendingStep exchange_step(int64_t step, uint64_t plan, const torch::Tensor& loss, const torch::Tensor& nonfinite,
                            double compute_ms, uint32_t flags = 0, const StepShare& share = {});
  /// Reads an exchanged record (waiting for it when needed) and checks it as step_sync does,
  /// with the same CollectiveMismatch naming each rank's step and plan. Also returns this
  /// rank's own loss (`local_loss`).
  StepConsensus resolve(PendingStep& pending, double* local_loss = nullptr);

  /// Point-to-point through the door: starts `ops` (NCCL: one coalesced batch, as PyTorch's
  /// batch_isend_irecv; Gloo: each on its own, in order), each pair's messages matched in the
  /// order both ranks list them (one FIFO per pair of ranks, whatever the tags). On the first step
  /// (step() <= 1) while validating() (dist.validate always or first_step; later steps are
  /// confirmed by the balance below), each pair first swaps every message's descriptor (tag, step,
  /// dtype, shape): a receive that expects another message than its peer sends throws
  /// CollectiveMismatch before its payload is posted, and its sender throws the same at wait(),
  /// naming both ranks, the message (`name(tag)`; default "message tag N") and both shapes; a send
  /// never waits for its receiver to arrive. Every message is counted and
  /// observed as a collective is, and folded into take_p2p_balance(). A peer that is dead or
  /// hung is named within dist.timeout_s (CollectiveError). The tensors stay in use until wait().
  Started start_p2p(std::vector<P2POp> ops, const char* what = "point-to-point",
                    const std::function<std::string(int64_t tag)>& name = nullptr);
  /// Σ h(message sent) − Σ h(message received) over the messages this door started since the
  /// last call (h: a hash of the group, sender, receiver, tag, step, dtype and shape), then reset:
  /// summed over every rank of the world it is 0 when each message was received as it was sent.
  /// The per-step consensus checks it (StepShare), so that after the first step's descriptors a
  /// message costs no exchange of its own.
  uint64_t take_p2p_balance();

  /// What a rank whose collective failed reported through the store (see above), or nullopt
  /// while none has. Does not block. "" for one rank without a store.
  std::optional<std::string> peer_failure() const;

  /// The counters of everything through this group's door (see TrafficStats): this object's
  /// calls, its replay lane's and the DDP buckets'.
  TrafficStats traffic() const;

  /// Every operation through this door (this object, its replay lane, DDP's buckets) is reported
  /// to `observer` (null: none; the default, which costs nothing).
  void set_observer(std::shared_ptr<OpObserver> observer);

  /// A run of calls that every rank of the group makes in one order each time it runs (tensor
  /// parallelism's in a training step's forward and backward, keyed by the step's batch shapes),
  /// validated once and replayed after, as ZeRO-3's schedule is. Under dist.validate = always,
  /// with more than one rank: the first run of a key validates each call as always and records it;
  /// each later run first confirms, with one probe, that every rank of the group replays the same
  /// record, then checks each call against the record on this rank (a call that differs throws
  /// CollectiveMismatch naming both before anything is issued; its peers, which issue theirs,
  /// fail within dist.timeout_s naming this rank) and issues it without a probe. Otherwise it
  /// does nothing. end() closes the run (a rank that made fewer calls than the record throws);
  /// one left without end() (an exception on its way) is dropped, its record unkept.
  class Sequence {
   public:
    Sequence() = default;
    Sequence(Sequence&& o) noexcept : coll_(std::exchange(o.coll_, nullptr)) {}
    Sequence& operator=(Sequence&&) = delete;
    ~Sequence();
    void end();

   private:
    friend class Collectives;
    explicit Sequence(Collectives* coll) : coll_(coll) {}
    Collectives* coll_ = nullptr;
  };
  /// Starts one (see Sequence); `key` names the run (what makes its calls differ: the shapes).
  Sequence sequence(uint64_t key);

  /// The lane for collectives replayed from a schedule every rank has validated (ZeRO-2/3's
  /// per-block gathers and reduce-scatters, dist/fsdp.h): the same group and door (counters,
  /// observer), without a probe, with its own sequence numbers; its step follows this one's.
  Collectives& replay_lane();

  /// DDP's gradient bucket all-reduce (sum, in place), issued by the Reducer's comm hook
  /// (dist/ddp.cpp) through the door: counted and observed, not validated (the per-step
  /// consensus checks the bucket plan). The future completes with the reduced `buffer`.
  c10::intrusive_ptr<c10::ivalue::Future> start_bucket_all_reduce(const torch::Tensor& buffer);

  /// A call that another engine makes on this group's raw process group (the DDP Reducer's own:
  /// the bucket rebuild's broadcast, the used-parameter map's all-reduce), recorded as the door's
  /// calls are: its observer sees on_start now, on_end at done(), on_failure when it is dropped
  /// without done() (an exception on its way). Not validated, not counted. Every rank of the group
  /// makes the same raw calls in one order (the Reducer's are collective), numbered on their own.
  class RawCall {
   public:
    RawCall() = default;
    RawCall(RawCall&& o) noexcept : observer_(std::move(o.observer_)), record_(std::move(o.record_)) {}
    RawCall& operator=(RawCall&&) = delete;
    ~RawCall();
    void done();

   private:
    friend class Collectives;
    std::shared_ptr<OpObserver> observer_;
    OpRecord record_;
  };
  RawCall raw_call(const char* op, const char* what);

  /// The error for a collective `what` that failed with `error` outside this class (the DDP
  /// Reducer's gradient all-reduce): records the failure in the store and names the ranks that
  /// did not report theirs, or says that the store's host cannot be reached (a lost host or a
  /// partition), within dist.timeout_s plus a short grace.
  CollectiveError failure(const std::string& what, const std::string& error);

 private:
  struct Desc;
  struct Door;          // shared by this object, its replay lane and the DDP buckets: counters and observer
  void check(Desc& d);  // numbers the call, validates it (dist.validate), tells the observer
  void validate(const Desc& d);
  void observe_start(const Desc& d);
  // Tells the observer that `d` failed with `error` (before it is thrown).
  void observe_failure(const Desc& d, const std::string& error, OpRecord::Outcome outcome);
  std::shared_ptr<OpObserver> observer() const;
  OpRecord record_of(const Desc& d) const;
  void wait(const c10::intrusive_ptr<c10d::Work>& w, const Desc& d);
  // The traffic counters, for a call that finished (on the host; `device`: the work's result,
  // for one the device finishes later: OpRecord::device).
  void count(const Desc& d, double wait_ms, c10::intrusive_ptr<c10::ivalue::Future> device = {});
  // One finished call into the door's counters (`sent`, `received` bytes), then the observer's
  // on_end with `payload` (this rank's contribution).
  void tally(const Desc& d, int64_t payload, int64_t sent, int64_t received, double wait_ms,
             c10::intrusive_ptr<c10::ivalue::Future> device = {});
  // The result of `w` as the device finishes it, when the host does not wait for it (NCCL, outside
  // a CUDA graph's capture); else null.
  c10::intrusive_ptr<c10::ivalue::Future> device_result(const c10::intrusive_ptr<c10d::Work>& w) const;
  static Desc step_desc(int64_t step, uint64_t plan, int64_t seq);
  StepConsensus read_step(const torch::Tensor& all, int64_t mine, int64_t step, double* local_loss) const;
  // start_p2p's descriptor swap (validating()): throws CollectiveMismatch on a receive whose sender
  // sends another message; returns the same check of the sends, to run before their payload is
  // waited for (null without sends; `arrived_only`: skipped unless the descriptors are in).
  std::function<void(bool arrived_only)> validate_p2p(const std::vector<P2POp>& ops, const char* what,
                                                      const std::function<std::string(int64_t)>& name);
  std::string describe(const Desc& d) const;
  // failure() without telling the observer (the caller tells it about the call that failed).
  CollectiveError failed(const std::string& what, const std::string& error);
  torch::Tensor on_comm_device(const torch::Tensor& t) const;
  // After a failed collective: records this rank's failure in the store and waits briefly for
  // the other ranks to do the same; says which did not (hung or dead), or that the store's host
  // is unreachable.
  std::string missing_ranks(const std::string& what);
  std::chrono::milliseconds report_grace() const;

  std::shared_ptr<Group> group_;
  Validate mode_;
  int64_t step_ = 0;
  uint64_t seq_ = 0;
  std::shared_ptr<Door> door_;
  std::unique_ptr<Collectives> replay_;  // replay_lane(), made on first use
  bool replaying_ = false;               // this object is a replay lane
  uint64_t p2p_seq_ = 0;                 // point-to-point messages started (their sequence numbers)
  uint64_t raw_seq_ = 0;                 // raw_call()s
  uint64_t p2p_balance_ = 0;             // take_p2p_balance()
  // Validated sends whose check waits for their receivers' descriptors (start_p2p), by call.
  std::map<uint64_t, std::function<void(bool arrived_only)>> send_checks_;
  uint64_t next_send_check_ = 0;
  void run_send_checks();  // every pending one whose descriptors are in (throws the first mismatch)
  struct Sequences;        // sequence(): the records by key, the run in progress
  std::shared_ptr<Sequences> sequences_;
  void replay_call(Desc& d);  // a call of a replayed sequence, checked against its record
  void end_sequence(bool completed);
};

// Cross-rank agreement, failing together and strings across ranks: one way each, used by
// the collectives' own check, DDP's parameter check, the checkpointer (plan, commit, load
// verdict), the compile stage and the trainer's start.

/// The one encoding of strings across ranks: every rank's `mine`, exact bytes, in rank order
/// (collective: an all-gather of the lengths, then one of the bytes padded to the longest).
std::vector<std::string> all_gather_strings(Collectives& coll, const std::string& mine, const char* what);

/// What agree() found when the ranks did not agree: every rank's fingerprint and its own
/// description, in rank order. Empty when they agreed.
struct Disagreement {
  std::vector<uint64_t> fingerprints;
  std::vector<std::string> details;
  std::vector<std::string> names;  // how messages name each rank (the group's rank_name); empty: "rank r"
  explicit operator bool() const { return !fingerprints.empty(); }
  /// The ranks whose fingerprint differs from `rank`'s.
  std::vector<int64_t> differing_from(int64_t rank) const;
  /// "\n  rank r: <its detail>" for every rank (its name, for a mesh axis's group).
  std::string by_rank() const;
};

/// Collective, the one agreement primitive: every rank passes its fingerprint of what must be
/// the same everywhere. All equal: an empty Disagreement, after one 16-byte MIN all-reduce.
/// Otherwise every rank gets every rank's fingerprint and `describe()` (called only then, on
/// every rank), so that every rank can say who differs and how, and fail alike.
Disagreement agree(Collectives& coll, uint64_t fingerprint, const std::function<std::string()>& describe,
                   const char* what);

/// An error of one rank, as errors_on_every_rank and first_error report it.
struct RankError {
  int64_t rank = -1;    // -1: no rank had one
  std::string message;  // that rank's message (at most 2 KiB of it)
  explicit operator bool() const { return rank >= 0; }
};

/// compile.cuda_graphs: while one lives (in any thread: the count is the process's), every
/// Collectives skips its cross-rank check (the captured step's collectives were checked when it
/// ran eagerly, and a capture cannot wait for a check's answer) and, on a CUDA device, makes the
/// stream wait for a collective, never the host (a capture cannot query its events). Nests.
class CaptureScope {
 public:
  CaptureScope();
  ~CaptureScope();
  CaptureScope(const CaptureScope&) = delete;
  CaptureScope& operator=(const CaptureScope&) = delete;
  /// Whether one lives.
  static bool active();
};

/// Collective, the one way to fail together: each rank passes its own error ("" when it has
/// none); every rank gets the same answer, every rank's error in rank order (empty: none had
/// one), so every rank makes the same decision and can name the ranks and their reasons. One
/// all-reduce when no rank had an error; all_gather_strings otherwise.
std::vector<RankError> errors_on_every_rank(Collectives& coll, const std::string& mine, const char* what);
/// The first of errors_on_every_rank: the lowest rank's error, or none.
RankError first_error(Collectives& coll, const std::string& mine, const char* what);

/// FNV-1a over a descriptor's integers, or over bytes; 62 bits so that -f never overflows.
uint64_t fingerprint(const std::vector<int64_t>& words);
uint64_t fingerprint(std::string_view bytes);

}  // namespace keel::dist
