#include "dist/ddp.h"

#include "common/log.h"
#include "common/text.h"

#include <algorithm>
#include <cctype>
#include <optional>
#include <sstream>
#include <unordered_map>

#include "dist/compat.h"
#include "dist/fsdp.h"
#include "dist/tensor_parallel.h"
#include "dist/zero.h"

namespace keel::dist {
namespace {

constexpr int kMaxDims = 6;

// One parameter as integers: dtype, ndim, dims, name hash.
std::vector<int64_t> param_record(const std::string& name, const torch::Tensor& t) {
  std::vector<int64_t> r = {static_cast<int64_t>(t.scalar_type()), t.dim()};
  for (int i = 0; i < kMaxDims; ++i) r.push_back(i < t.dim() ? t.size(i) : -1);
  r.push_back(static_cast<int64_t>(fingerprint(std::string_view(name))));
  return r;
}

std::string shape_str(const int64_t* r) {
  std::ostringstream os;
  os << c10::toString(static_cast<c10::ScalarType>(r[0])) << " [";
  for (int64_t i = 0; i < std::min<int64_t>(r[1], kMaxDims); ++i) os << (i ? ", " : "") << r[2 + i];
  os << "]";
  return os.str();
}

// The Reducer's comm hook: every gradient bucket goes through the collectives' one door
// (Collectives::start_bucket_all_reduce: counted, and seen by an observer), pre-divided by the
// world size. `wire`: the bucket's own dtype (dist.comm_hook = "allreduce"), or bf16 / fp16 to
// compress it on the wire (PyTorch's bf16_compress_hook / fp16_compress_hook) and cast back.
//
// Without a hook the Reducer divides each gradient by the world size as it lands in its bucket
// view (div_, or mul by 1/world while copying one that is not yet a view); with one it copies and
// leaves the division to the hook. Every gradient is a bucket view from the start (DataParallel's
// constructor), so div_ of the whole bucket here gives each element the very same division.
class BucketHook : public c10d::CommHookInterface {
 public:
  BucketHook(std::shared_ptr<Collectives> coll, std::optional<at::ScalarType> wire)
      : coll_(std::move(coll)), wire_(wire) {}
  c10::intrusive_ptr<c10::ivalue::Future> runHook(c10d::GradBucket& bucket) override {
    const double world = static_cast<double>(coll_->size());
    if (!wire_) {
      auto& buffer = bucket.getBufferRef();
      buffer.div_(world);
      return coll_->start_bucket_all_reduce(buffer);
    }
    auto compressed = bucket.getBufferRef().to(*wire_).div_(world);
    auto fut = coll_->start_bucket_all_reduce(compressed);
    return fut->then([compressed](c10::ivalue::Future&) -> c10::IValue { return c10::IValue(compressed); },
                     c10::TensorType::get());
  }
  at::Tensor parseHookResult(const c10::IValue& result) override {
    const at::Tensor t = result.isTensor() ? result.toTensor() : result.toTensorVector()[0];
    return wire_ ? t.to(at::kFloat) : t;
  }

 private:
  std::shared_ptr<Collectives> coll_;
  std::optional<at::ScalarType> wire_;
};

}  // namespace

void verify_parameters_across_ranks(const models::NamedTensors& params, Collectives& coll) {
  std::vector<int64_t> words = {static_cast<int64_t>(params.size())};
  for (const auto& [name, t] : params) {
    auto r = param_record(name, t);
    words.insert(words.end(), r.begin(), r.end());
  }
  // One line per parameter: its record (what must agree), then its shape as the message shows it.
  const int64_t width = 2 + kMaxDims + 1;
  const auto d = agree(
      coll, fingerprint(words),
      [&] {
        std::string lines;
        for (size_t i = 0; i < params.size(); ++i) {
          const int64_t* r = words.data() + 1 + static_cast<int64_t>(i) * width;
          lines += c10::str(std::vector<int64_t>(r, r + width)) + "\t" + shape_str(r) + "\n";
        }
        return lines;
      },
      "parameter check");
  if (!d) return;
  std::vector<std::vector<std::string>> lines;  // per rank, per parameter
  for (const auto& detail : d.details) lines.push_back(split_lines(detail));
  std::ostringstream os;
  os << "DDP: the model differs across ranks: ";
  for (const auto& l : lines)
    if (l.size() != params.size()) {
      for (size_t q = 0; q < lines.size(); ++q)
        os << (q ? ", " : "") << "rank " << q << " has " << lines[q].size() << " parameters";
      throw CollectiveMismatch(os.str());
    }
  for (size_t i = 0; i < params.size(); ++i) {
    bool same = true;
    for (const auto& l : lines) same &= l[i] == lines[0][i];
    if (same) continue;
    os << "parameter #" << i << " '" << params[i].first << "' (name on this rank):";
    for (size_t r = 0; r < lines.size(); ++r)
      os << " rank " << r << " has " << lines[r][i].substr(lines[r][i].find('\t') + 1)
         << (r + 1 < lines.size() ? ";" : "");
    throw CollectiveMismatch(os.str());
  }
  throw CollectiveMismatch("DDP: the model differs across ranks:" + d.by_rank());
}

DataParallel::DataParallel(std::shared_ptr<models::Model> model, std::shared_ptr<Collectives> coll,
                           const DistConfig& cfg, const std::optional<SplitGradients>& split,
                           models::DeferredInit* deferred)
    : model_(std::move(model)),
      coll_(std::move(coll)),
      bucket_bytes_(static_cast<size_t>(std::max(1.0, cfg.bucket_cap_mb * 1024 * 1024))),
      split_(split) {
  auto named = model_->named_parameters();
  verify_parameters_across_ranks(named, *coll_);
  params_ = named;
  placement_ = Placement(cfg.zero, named, model_->block_prefixes(), coll_->size());
  if (split_ && split_->replicated.size() != named.size())
    throw std::logic_error("DataParallel: the split gradients' flags are not one per parameter");
  // The split's partial gradients are summed, and the norm's squares counted, piece by piece:
  // every rank of the split's group must hold the same pieces.
  if (split_ && placement_.shards_optimizer_state() && split_->group->size() > 1)
    if (const auto d = agree(
            *split_->group, placement_.fingerprint(), [&] { return placement_.describe().dump(); },
            "ZeRO placement over tp");
        d)
      throw CollectiveMismatch("ZeRO's placement differs across the tp group:" + d.by_rank());

  if (deferred && !deferred->empty() && !placement_.shards_parameters())
    throw std::logic_error("DataParallel: parameters left unmade for " + placement_.key() +
                           " (only ZeRO-3 makes them)");
  // Start from rank 0's parameters and buffers (those not made yet are drawn alike on every rank).
  std::vector<torch::Tensor> state;
  for (auto& [n, t] : named)
    if (!deferred || !deferred->deferred(t)) state.push_back(t.detach());
  for (auto& [n, t] : model_->named_buffers()) {
    state.push_back(t.detach());
    if (cfg.broadcast_buffers && coll_->size() > 1) buffers_.push_back(t.detach());
  }
  {
    torch::NoGradGuard ng;
    coll_->broadcast_coalesced(state, 0, "DDP initial broadcast");
  }

  std::vector<torch::Tensor> params;
  std::unordered_map<size_t, std::string> names;
  std::vector<int64_t> words;
  for (size_t i = 0; i < named.size(); ++i) {
    params.push_back(named[i].second);
    names[i] = named[i].first;
    auto r = param_record(named[i].first, named[i].second);
    words.insert(words.end(), r.begin(), r.end());
  }
  words.push_back(static_cast<int64_t>(placement_.fingerprint()));
  if (placement_.shards_gradients()) {
    fsdp_ = std::make_unique<FullyShard>(model_, coll_, placement_, /*reduce_in_order=*/cfg.find_unused_parameters,
                                         deferred);
    plan_ = fingerprint(words);
    return;  // no Reducer: FullyShard reduce-scatters each block's gradients
  }
  if (!coll_->group()->pg()) {
    plan_ = fingerprint(words);
    return;
  }
  const auto cap = static_cast<size_t>(cfg.bucket_cap_mb * 1024 * 1024);
  const auto first = static_cast<size_t>(cfg.first_bucket_mb * 1024 * 1024);
  // As PyTorch's DDP: buckets are formed over the parameters in reverse (gradients of the last
  // layers are ready first); the Reducer rebuilds them after the first step in the order the
  // gradients actually became ready, agreed across ranks.
  std::vector<int64_t> order(params.size());
  for (size_t i = 0; i < params.size(); ++i) order[i] = static_cast<int64_t>(params.size() - 1 - i);
  std::vector<torch::Tensor> reversed;
  for (auto i : order) reversed.push_back(params[i]);
  const auto buckets = std::get<0>(c10d::compute_bucket_assignment_by_size(reversed, {first, cap}, {}, order));
  num_buckets_ = static_cast<int64_t>(buckets.size());
  for (auto& b : buckets) {
    words.push_back(-7);
    for (auto i : b) words.push_back(static_cast<int64_t>(i));
  }
  plan_ = fingerprint(words);
  // Gradients defined when the Reducer is built become bucket views at once (issue 44: without a
  // comm hook the Reducer divided a view with div_(world) and copied a gradient not yet one with
  // mul(1/world), so a first step rounded unlike the later ones at a world size that is not a
  // power of two). BucketHook now divides the whole bucket, views or copies alike, so this keeps
  // the copy out of the first step only. (With find_unused_parameters an unused parameter's
  // gradient stays undefined until it is first used, as in PyTorch; its first step's copy is now
  // divided as every later step is, where the Reducer used to multiply by 1/world.)
  if (!cfg.find_unused_parameters)
    for (auto& p : params)
      if (!p.grad().defined()) p.mutable_grad() = torch::zeros_like(p);
  reducer_ = compat::make_reducer(params, buckets, coll_->group()->pg(), static_cast<int64_t>(cap),
                                  cfg.find_unused_parameters, names, static_cast<int64_t>(first));
  find_unused_ = cfg.find_unused_parameters;
  std::optional<at::ScalarType> wire;
  if (cfg.comm_hook != CommHook::Allreduce) wire = cfg.comm_hook == CommHook::Fp16 ? at::kHalf : at::kBFloat16;
  reducer_->register_comm_hook(std::make_unique<BucketHook>(coll_, wire));
  logging::info("DDP: {} parameters in {} buckets (cap {} MiB, first {} MiB), comm hook {}", params.size(),
                num_buckets_, cfg.bucket_cap_mb, cfg.first_bucket_mb, choice_name(kCommHooks, cfg.comm_hook));
  if (placement_.shards_optimizer_state()) {
    int64_t mine = 0, all = 0, count = 0;
    for (const auto& p : params) all += p.numel();
    for (const auto& piece : placement_.pieces(coll_->rank())) mine += piece.numel, ++count;
    logging::info("ZeRO stage {}: this rank owns the optimizer state of {} of {} parameters ({} of {} elements)",
                  placement_.stage(), count, params.size(), mine, all);
  }
}

models::NamedTensors DataParallel::owned_parameters() const {
  if (fsdp_) return fsdp_->pieces();
  models::NamedTensors out;
  for (const auto& piece : placement_.pieces(coll_->rank())) out.push_back(params_[piece.param]);
  return out;
}

void DataParallel::sync_parameters() {
  if (fsdp_) return fsdp_->sync_parameters();
  if (!placement_.shards_optimizer_state() || coll_->size() == 1) return;
  zero_broadcast_parameters(params_, placement_.owners(), *coll_, bucket_bytes_);
}

std::vector<std::pair<torch::Tensor, bool>> DataParallel::held_with(const std::vector<bool>& per_param) const {
  const models::NamedTensors held = owned_parameters();  // parallel to this rank's pieces
  const std::vector<Placement::Piece> pieces = placement_.pieces(coll_->rank());
  std::vector<std::pair<torch::Tensor, bool>> out;
  for (size_t k = 0; k < held.size(); ++k) out.emplace_back(held[k].second, per_param[pieces[k].param]);
  return out;
}

void DataParallel::sum_partial_gradients() {
  if (!split_ || split_->group->size() == 1) return;
  std::vector<torch::Tensor> partial;
  for (const auto& [t, is_partial] : held_with(split_->partial))
    if (is_partial) partial.push_back(t);
  // At dist.zero >= 1 a rank sums only what its optimizer steps (the others' gradients go unread);
  // its tp group holds the same (checked at construction), so every rank issues the same sum.
  tp::sum_gradients(partial, *split_->group);
}

torch::Tensor DataParallel::clip_grad_norm(double max_norm) {
  if (split_) {
    std::vector<torch::Tensor> tensors;
    std::vector<bool> replicated;
    for (const auto& [t, is_replicated] : held_with(split_->replicated))
      tensors.push_back(t), replicated.push_back(is_replicated);
    const bool sharded = placement_.shards_optimizer_state() && coll_->size() > 1;
    return clip_grad_norm_tensor_parallel(tensors, replicated, *split_->group, max_norm,
                                          sharded ? coll_.get() : nullptr);
  }
  if (fsdp_) return clip_grad_norm_of_pieces(fsdp_->pieces(), *coll_, max_norm);
  return dist::clip_grad_norm(params_, placement_.owners(), *coll_, max_norm,
                              placement_.shards_optimizer_state() && coll_->size() > 1);
}

void DataParallel::hold_parameters() {
  if (fsdp_) fsdp_->hold();
}
void DataParallel::release_parameters() {
  if (fsdp_) fsdp_->reshard();
}
namespace {
// The largest of every rank's `mine` (collective).
int64_t agreed_max(Collectives& coll, int64_t mine, const char* what) {
  auto t = torch::tensor({mine}, torch::kLong);
  coll.all_reduce(t, ReduceOp::Max, what);
  return t.item<int64_t>();
}
}  // namespace

int64_t DataParallel::evaluation_rounds(int64_t batches) {
  return placement_.shards_parameters() ? agreed_max(*coll_, batches, "evaluation batches") : batches;
}

void DataParallel::hold_whole_model(bool wanted) {
  if (placement_.shards_parameters() ? agreed_max(*coll_, wanted ? 1 : 0, "on_end") > 0 : wanted) hold_parameters();
}

int64_t DataParallel::sharded_parameter_bytes() const { return fsdp_ ? fsdp_->parameter_bytes() : -1; }
int64_t DataParallel::sharded_gradient_bytes() const { return fsdp_ ? fsdp_->gradient_bytes() : -1; }

DataParallel::~DataParallel() = default;

namespace {
// Gloo's and NCCL's messages for a failed transfer ("Timed out waiting ... for recv",
// "Application timeout caused pair closure", "Connection reset by peer", NCCL watchdog errors).
bool from_process_group(std::string what) {
  for (auto& c : what) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  for (const char* mark :
       {"gloo", "nccl", "c10d", "processgroup", "connection", "timed out", "timeout", "pair closure", "peer"})
    if (what.find(mark) != std::string::npos) return true;
  return false;
}
}  // namespace

void DataParallel::sync_buffers() {
  if (buffers_.empty()) return;
  torch::NoGradGuard ng;
  coll_->broadcast_coalesced(buffers_, 0, "DDP buffer broadcast");
}

void DataParallel::before_forward(bool sync, bool step) {
  // A replayed ZeRO schedule this rank left unfinished is named before any collective of this
  // micro-batch (the buffer broadcast's probe would otherwise meet a peer's replayed collective).
  if (fsdp_) fsdp_->end_open_schedule();
  sync_buffers();
  if (fsdp_) return fsdp_->before_forward(sync, step);
  if (!reducer_ || !sync) return;
  // Every synced forward, as PyTorch's DDP: the Reducer also checks there that the previous
  // reduction finished (a parameter unused without find_unused_parameters is an error); it
  // rebuilds its buckets once, with a broadcast on its raw group, recorded.
  Collectives::RawCall call = rebuild_due_ ? coll_->raw_call("broadcast",
                                                             "DDP Reducer: bucket rebuild (rank 0's "
                                                             "bucket order)")
                                           : Collectives::RawCall();
  reducer_->rebuild_buckets();
  call.done();
  if (rebuild_due_) rebuild_due_ = false, rebuilt_ = true;
  reducer_->prepare_for_forward();
}

void DataParallel::backward(const torch::Tensor& loss, bool sync) {
  reduce_gradients(loss, sync);
  if (sync) sum_partial_gradients();
}

void DataParallel::reduce_gradients(const torch::Tensor& loss, bool sync) {
  if (!fsdp_ && (!reducer_ || !sync)) return loss.backward();
  if (reducer_) reducer_->prepare_for_backward({loss});
  try {
    // dist.find_unused_parameters: the Reducer all-reduces its used-parameter map on its raw group
    // during the backward (recorded as spanning it).
    Collectives::RawCall used = reducer_ && find_unused_
                                    ? coll_->raw_call("all_reduce", "DDP Reducer: used-parameter map")
                                    : Collectives::RawCall();
    loss.backward();  // the Reducer all-reduces the gradient buckets and waits for them here
    used.done();
    // The Reducer rebuilds its buckets once, before the forward after its first synced backward
    // (not under find_unused_parameters).
    if (reducer_ && !find_unused_ && !rebuilt_) rebuild_due_ = true;
    if (fsdp_) fsdp_->after_backward();  // every rank's shard of every gradient (sync or not)
  } catch (const CollectiveError&) {
    throw;  // FullyShard's collectives name their failures
  } catch (const std::exception& e) {
    // A failure of the process group (a lost peer, a partition, a timeout; Gloo throws its own
    // exception types through the Reducer's future) says which rank; an error of the backward
    // pass itself (out of memory, a shape) goes up as it is.
    const auto* c10 = dynamic_cast<const c10::Error*>(&e);
    const std::string what = c10 ? c10->what_without_backtrace() : e.what();
    if (!from_process_group(what)) throw;
    throw coll_->failure("DDP gradient all-reduce (" + std::to_string(num_buckets_) + " buckets)", what);
  }
}

}  // namespace keel::dist
