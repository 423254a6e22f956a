#include "dist/fsdp.h"

#include "dist/phase.h"

#include "common/log.h"

#include <algorithm>

#include "keel/common/error.h"

namespace keel::dist {
namespace {

// A tensor's memory without the tensor: every view of its storage keeps its sizes and offset
// (autograd's saved tensors among them) and reads the memory allocate_storage() gives back.
void release_storage(const torch::Tensor& t) {
  auto* s = t.storage().unsafeGetStorageImpl();
  s->set_data_ptr_noswap(at::DataPtr(nullptr, s->device()));
  s->set_nbytes(0);
}

void allocate_storage(const torch::Tensor& t) {
  auto* s = t.storage().unsafeGetStorageImpl();
  const size_t bytes = static_cast<size_t>(t.numel()) * t.element_size();
  if (s->nbytes() == bytes && s->data() != nullptr) return;
  s->set_data_ptr_noswap(s->allocator()->allocate(bytes));
  s->set_nbytes(bytes);
}

int64_t as_int(FullyShard* fs) { return static_cast<int64_t>(reinterpret_cast<intptr_t>(fs)); }
FullyShard* from_int(int64_t v) { return reinterpret_cast<FullyShard*>(static_cast<intptr_t>(v)); }

// Identities whose backward tells FullyShard where autograd is: the gradient reaching a
// block's output (Pre: gather its parameters again), and the gradient leaving its input
// (!Pre: its parameters' gradients are complete).
template <bool Pre>
struct BlockBoundary : torch::autograd::Function<BlockBoundary<Pre>> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x, int64_t fs,
                               int64_t unit) {
    ctx->saved_data["fs"] = fs;
    ctx->saved_data["unit"] = unit;
    return x;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad) {
    FullyShard* self = from_int(ctx->saved_data["fs"].toInt());
    const auto unit = static_cast<size_t>(ctx->saved_data["unit"].toInt());
    if (Pre)
      self->pre_backward(unit);
    else
      self->post_backward(unit);
    return {grad[0], torch::Tensor(), torch::Tensor()};
  }
};
using PreBackward = BlockBoundary<true>;
using PostBackward = BlockBoundary<false>;

}  // namespace

// A unit of the placement with its tensors.
// A unit's tensors; its layout is the placement's (placement_.units(), which outlives it).
struct FullyShard::Unit {
  explicit Unit(const Placement::Unit& l) : layout(l) {}
  const Placement::Unit& layout;
  torch::Tensor full;  // world x shard elements; no memory unless gathered or gathering
  torch::Tensor shard_data, shard_grad;
  torch::Tensor placeholder;  // 0 elements: what each parameter is while not gathered
  Collectives::Started gathering;
  bool gathered = false;
  bool reduced = false;  // in this micro-batch
  torch::Tensor grad_full, grad_out;
  Collectives::Started scattering;
};

// Rank `rank`'s shard of `unit`'s flat buffer: the elements of each parameter that fall in it
// (a deferred one's made here, from its recipe; the rest copied), zero padding elsewhere.
torch::Tensor FullyShard::shard_of(const Placement::Unit& unit, int64_t rank, const torch::TensorOptions& opts,
                                   models::DeferredInit* deferred) const {
  const int64_t first = rank * unit.shard, last = first + unit.shard;
  auto shard = torch::zeros({unit.shard}, opts);
  for (size_t k = 0; k < unit.params.size(); ++k) {
    const torch::Tensor& p = params_[unit.params[k]].second;
    const int64_t lo = std::max(first, unit.offsets[k]), hi = std::min(last, unit.offsets[k] + unit.sizes[k]);
    const bool made_here = deferred && deferred->deferred(p);
    if (lo < hi) {
      const int64_t from = lo - unit.offsets[k];
      shard.narrow(0, lo - first, hi - lo)
          .copy_(made_here ? deferred->value(p, from, hi - lo) : p.detach().reshape({-1}).narrow(0, from, hi - lo));
    }
    if (made_here) deferred->done(p);
  }
  return shard;
}

FullyShard::FullyShard(std::shared_ptr<models::Model> model, std::shared_ptr<Collectives> coll, Placement placement,
                       bool reduce_in_order, models::DeferredInit* deferred)
    : model_(std::move(model)),
      coll_(std::move(coll)),
      placement_(std::move(placement)),
      params_(model_->named_parameters()),
      in_order_(reduce_in_order) {
  const int64_t world = coll_->size(), rank = coll_->rank();
  if (!placement_.shards_gradients() || placement_.world() != world || placement_.num_params() != params_.size())
    throw std::logic_error("FullyShard: a placement of stage 2 or 3 over this model and world is needed");
  torch::NoGradGuard ng;
  for (const auto& layout : placement_.units()) {
    units_.push_back(std::make_unique<Unit>(layout));
    Unit& u = *units_.back();
    if (u.layout.params.empty()) continue;
    const auto opts = params_[u.layout.params.front()].second.options().requires_grad(false);
    if (keeps_whole()) {  // stage 2: the whole buffer stays; the parameters become views of it
      auto flat = torch::zeros({u.layout.shard * world}, opts);
      for (size_t k = 0; k < u.layout.params.size(); ++k)
        flat.narrow(0, u.layout.offsets[k], u.layout.sizes[k])
            .copy_(params_[u.layout.params[k]].second.detach().reshape({-1}));
      u.full = flat;
      u.shard_data = u.full.narrow(0, rank * u.layout.shard, u.layout.shard);
      for (size_t k = 0; k < u.layout.params.size(); ++k)
        params_[u.layout.params[k]].second.set_data(
            u.full.narrow(0, u.layout.offsets[k], u.layout.sizes[k]).view(u.layout.shapes[k]));
      u.gathered = true;
    } else {
      u.shard_data = shard_of(u.layout, rank, opts, deferred);
      u.full = torch::empty({u.layout.shard * world}, opts);
      release_storage(u.full);
      u.placeholder = torch::empty({0}, opts);
      for (size_t i : u.layout.params) params_[i].second.set_data(u.placeholder);  // the replicated copy is freed here
    }
    u.shard_grad = torch::zeros_like(u.shard_data);
  }
  if (deferred && !deferred->empty())
    throw std::logic_error("FullyShard: " + std::to_string(deferred->size()) + " parameters in no unit left unmade");
  // The pieces: leaves over this rank's shards, each with its gradient over the gradient shard.
  piece_at_ = placement_.pieces(rank);
  for (const auto& at : piece_at_) {
    const Unit& u = *units_[at.unit];
    auto piece = u.shard_data.narrow(0, at.in_shard, at.numel).detach();
    piece.set_requires_grad(true);
    piece.mutable_grad() = u.shard_grad.narrow(0, at.in_shard, at.numel);
    pieces_.emplace_back(params_[at.param].first, piece);
  }
  model_->set_block_hooks(this);
  int64_t mine = 0, all = 0;
  for (const auto& [n, p] : pieces_) mine += p.numel();
  for (size_t i = 0; i < placement_.num_params(); ++i) all += placement_.numel(i);
  logging::info("ZeRO stage {}: {} blocks and the parameters outside them sharded{}; this rank owns {} of {} elements",
                placement_.stage(), units_.size() - 1,
                keeps_whole() ? " (gradients and optimizer state; parameters kept whole)" : "", mine, all);
}

FullyShard::~FullyShard() { model_->set_block_hooks(nullptr); }

size_t FullyShard::index_of(const Unit& u) const {
  for (size_t i = 0; i < units_.size(); ++i)
    if (units_[i].get() == &u) return i;
  throw std::logic_error("FullyShard: a unit of another instance");
}

std::string FullyShard::mismatch_at() const {
  return "collective mismatch at step " + std::to_string(coll_->step()) + " on rank " + std::to_string(coll_->rank()) +
         " (ZeRO stage " + std::to_string(placement_.stage()) + "): ";
}

std::string FullyShard::describe_op(uint64_t op) const {
  const auto unit = static_cast<size_t>(op & 0xffffffffu);
  const std::string name = unit < units_.size() ? units_[unit]->layout.name : "unit " + std::to_string(unit);
  return std::string((op >> 32) == 'G' ? "the all-gather of " : "the reduce-scatter of ") + name;
}

Collectives& FullyShard::via(char kind, size_t unit) {
  if (!open_) return *coll_;
  const uint64_t op = (static_cast<uint64_t>(kind) << 32) | unit;
  if (!open_->recorded) {  // recording: each validated on its own
    open_->ops.push_back(op);
    return *coll_;
  }
  if (next_ >= open_->ops.size() || open_->ops[next_] != op) {
    const std::string expected = next_ < open_->ops.size() ? describe_op(open_->ops[next_]) : "nothing more";
    open_ = nullptr;
    throw CollectiveMismatch(
        mismatch_at() + "its collective #" + std::to_string(next_) + " of this micro-batch would be " +
        describe_op(op) + ", where the schedule every rank validated has " + expected +
        "; nothing was issued. Every rank must run the same blocks in the same order each micro-batch");
  }
  ++next_;
  return coll_->replay_lane();
}

void FullyShard::open_schedule(bool sync) {
  Schedule& s = schedules_[sync ? 1 : 0];
  // A recorded schedule without collectives (stage 2's micro-batches that accumulate without
  // reducing) is not replayed: nothing to confirm, and a rank that would issue one there issues
  // it through coll_, validated, where it meets the other ranks' next validated collective.
  if (s.recorded && s.ops.empty()) return;
  if (!s.recorded) s.ops.clear();
  if (s.recorded) {
    // Every rank confirms the schedule it is about to replay: (h, -h) all-reduced with MIN agree
    // iff min(h) == max(h).
    uint64_t h = 1469598103934665603ull;
    for (uint64_t op : s.ops) h = (h ^ op) * 1099511628211ull;
    const auto v = static_cast<int64_t>(h >> 2);
    auto t =
        torch::tensor({v, -v, static_cast<int64_t>(s.ops.size()), -static_cast<int64_t>(s.ops.size())}, torch::kLong);
    coll_->all_reduce(t, ReduceOp::Min, "ZeRO schedule check");
    if (t[0].item<int64_t>() != -t[1].item<int64_t>() || t[2].item<int64_t>() != -t[3].item<int64_t>())
      throw CollectiveMismatch(mismatch_at() +
                               "the ranks recorded different schedules of gathers and reduce-scatters for this "
                               "micro-batch; every rank must run the same blocks in the same order");
  }
  next_ = 0;
  open_ = &s;
}

void FullyShard::close_schedule() {
  if (!open_) return;
  Schedule& s = *open_;
  open_ = nullptr;
  if (!s.recorded) {
    s.recorded = true;
    return;
  }
  if (next_ != s.ops.size())
    throw CollectiveMismatch(mismatch_at() + "this micro-batch issued " + std::to_string(next_) + " of the " +
                             std::to_string(s.ops.size()) + " collectives of the schedule every rank validated (" +
                             describe_op(s.ops[next_]) +
                             " and after never issued); every rank must run the same blocks each micro-batch");
}

void FullyShard::start_gather(Unit& u) {
  if (u.gathered || u.gathering || u.layout.params.empty()) return;
  allocate_storage(u.full);
  u.gathering =
      via('G', index_of(u))
          .start_all_gather_into(u.full, u.shard_data,
                                 keeps_whole() ? "ZeRO-2 parameter all-gather" : "ZeRO-3 parameter all-gather");
}

void FullyShard::gather(Unit& u) {
  if (u.gathered || u.layout.params.empty()) return;
  start_gather(u);
  u.gathering.wait();
  torch::NoGradGuard ng;
  for (size_t k = 0; k < u.layout.params.size(); ++k) {
    params_[u.layout.params[k]].second.set_data(
        u.full.narrow(0, u.layout.offsets[k], u.layout.sizes[k]).view(u.layout.shapes[k]));
  }
  u.gathered = true;
}

void FullyShard::free(Unit& u) {
  if (held_ || keeps_whole() || u.layout.params.empty()) return;
  u.gathering.wait();  // a prefetch still writing into it
  torch::NoGradGuard ng;
  for (size_t i : u.layout.params) params_[i].second.set_data(u.placeholder);
  release_storage(u.full);
  u.gathered = false;
}

void FullyShard::finish_reduce(Unit& u) {
  if (!u.scattering) return;
  u.scattering.wait();
  torch::NoGradGuard ng;
  u.shard_grad.add_(u.grad_out);
  u.grad_full = u.grad_out = torch::Tensor();
}

void FullyShard::reduce(Unit& u) {
  if (u.reduced || u.layout.params.empty()) return;
  u.reduced = true;
  // One reduce-scatter in flight at a time: the previous block's full gradients are freed
  // before this one's are copied, so a rank never holds more than two blocks' of them.
  for (auto& other : units_) finish_reduce(*other);
  torch::NoGradGuard ng;
  u.grad_full = torch::empty({u.full.numel()}, u.shard_data.options());
  // Each gradient divided by the world size (an average, as DDP's all-reduce) on its way into the
  // flat buffer: one pass over it, not a copy and then a division.
  const c10::Scalar world = static_cast<double>(coll_->size());
  for (size_t k = 0; k < u.layout.params.size(); ++k) {
    auto& p = params_[u.layout.params[k]].second;
    const auto& g = p.grad();
    auto to = u.grad_full.narrow(0, u.layout.offsets[k], u.layout.sizes[k]);
    if (g.defined())
      at::div_out(to, g.reshape({-1}), world);
    else
      to.zero_();                        // not used in this micro-batch
    p.mutable_grad() = torch::Tensor();  // the full gradient is freed
    // The alignment gap after it (and the padding after the last).
    const int64_t gap = u.layout.offsets[k] + u.layout.sizes[k],
                  next = k + 1 < u.layout.params.size() ? u.layout.offsets[k + 1] : u.full.numel();
    if (next > gap) u.grad_full.narrow(0, gap, next - gap).zero_();
  }
  u.grad_out = torch::empty_like(u.shard_data);
  u.scattering =
      via('R', index_of(u))
          .start_reduce_scatter(u.grad_out, u.grad_full,
                                keeps_whole() ? "ZeRO-2 gradient reduce-scatter" : "ZeRO-3 gradient reduce-scatter");
}

void FullyShard::end_open_schedule() {
  if (!open_) return;  // a training micro-batch without after_backward(): complete, or this rank left it
  if (open_->recorded && next_ != open_->ops.size()) close_schedule();  // throws, naming it
  open_ = nullptr;
}

void FullyShard::before_forward(bool sync, bool step) {
  if (held_) return;
  sync_ = sync || !keeps_whole();  // stage 3 does not keep full gradients between micro-batches
  end_open_schedule();
  if (step && coll_->validating() && coll_->size() > 1) open_schedule(sync_);
  for (auto& u : units_) u->reduced = false;
  if (keeps_whole()) return;
  gather(*units_.back());
  if (units_.size() > 1) start_gather(*units_.front());
}

torch::Tensor FullyShard::enter(size_t block, const torch::Tensor& input) {
  if (held_ || block + 1 >= units_.size()) return input;
  gather(*units_[block]);
  if (block + 2 < units_.size()) start_gather(*units_[block + 1]);
  if (!sync_ || (keeps_whole() && in_order_) || !torch::GradMode::is_enabled() || !input.requires_grad()) return input;
  return PostBackward::apply(input, as_int(this), static_cast<int64_t>(block));
}

torch::Tensor FullyShard::leave(size_t block, const torch::Tensor& output) {
  if (held_ || keeps_whole() || block + 1 >= units_.size()) return output;
  const bool training = torch::GradMode::is_enabled() && output.requires_grad();
  auto out = training ? PreBackward::apply(output, as_int(this), static_cast<int64_t>(block)) : output;
  // The last block's backward comes first, right after the loss: it stays gathered for it (as the
  // root does) instead of being freed and gathered again. after_backward() or reshard() frees it.
  if (!training || block + 2 < units_.size()) free(*units_[block]);
  return out;
}

void FullyShard::pre_backward(size_t unit) {
  if (unit + 1 < units_.size()) set_block(static_cast<int32_t>(unit));  // blocks first, the root last
  gather(*units_[unit]);
  if (unit > 0) start_gather(*units_[unit - 1]);
}

void FullyShard::post_backward(size_t unit) {
  if (!in_order_) reduce(*units_[unit]);  // else after the backward, in order (its gradients kept until then)
  free(*units_[unit]);
}

void FullyShard::after_backward() {
  if (held_) return;
  if (!sync_) return close_schedule();  // stage 2's gradients accumulate in the parameters until the last micro-batch
  // A block whose input needs no gradient (mlp's first layer: the data) has no autograd node
  // to say that its gradients are complete; they are now. A gradient that arrives after its
  // block was reduced would be lost: that is a model whose block is not self-contained.
  for (auto& up : units_) {
    std::string late;
    for (size_t i : up->layout.params)
      if (params_[i].second.grad().defined()) late = params_[i].first;
    if (!late.empty() && up->reduced)
      throw std::logic_error(placement_.key() + ": the gradient of '" + late + "' arrived after " + up->layout.name +
                             " was reduced: a block's parameters must be used inside the block only (BlockStructure)");
    if (in_order_ || !late.empty() || up.get() == units_.back().get()) reduce(*up);
    free(*up);
  }
  close_schedule();  // before anything else is issued (finishing the reduce-scatters issues nothing)
  for (auto& up : units_) finish_reduce(*up);
}

void FullyShard::sync_parameters() {
  if (!keeps_whole() || coll_->size() == 1) return;
  // Each unit's own range is the all-gather's input and part of its output: it goes from a copy.
  std::vector<Collectives::Started> started;
  for (auto& up : units_)
    if (!up->layout.params.empty())
      started.push_back(coll_->start_all_gather_into(up->full, up->shard_data.clone(), "ZeRO-2 parameter all-gather"));
  for (auto& s : started) s.wait();
}

void FullyShard::hold() {
  for (auto& u : units_) gather(*u);
  held_ = true;
}

void FullyShard::reshard() {
  held_ = false;
  for (auto& u : units_) free(*u);
}

void FullyShard::reduce_accumulated() {
  for (auto& u : units_) u->reduced = false;
  for (auto& u : units_) reduce(*u);  // one reduce-scatter in flight at a time (reduce() finishes the previous)
  for (auto& u : units_) finish_reduce(*u);
}

models::NamedTensors FullyShard::whole_state(const models::NamedTensors& piece_state,
                                             const std::map<std::string, std::string>& fields) {
  const auto& owner = placement_.owners();
  std::map<std::string, torch::Tensor> mine(piece_state.begin(), piece_state.end());
  std::vector<std::string> scalars, tensors;
  for (const auto& [f, kind] : fields) (kind == "scalar" ? scalars : tensors).push_back(f);
  // Per parameter: whether any rank has its state, then each scalar (the same on every rank
  // that has a piece; -1 where a rank has none), in one all-reduce (max).
  const auto P = static_cast<int64_t>(params_.size()), S = static_cast<int64_t>(scalars.size());
  auto table = torch::full({P * (1 + S)}, int64_t{-1}, torch::kLong);
  auto* t = table.data_ptr<int64_t>();
  for (size_t i = 0; i < pieces_.size(); ++i) {
    const auto& name = pieces_[i].first;
    const auto p = static_cast<int64_t>(piece_at_[i].param);
    bool any = false;
    for (const auto& f : tensors) any |= mine.count(name + "." + f) != 0;
    for (int64_t s = 0; s < S; ++s)
      if (auto it = mine.find(name + "." + scalars[static_cast<size_t>(s)]); it != mine.end())
        t[P * (1 + s) + p] = it->second.item<int64_t>(), any = true;
    if (any) t[p] = 1;
  }
  coll_->all_reduce(table, ReduceOp::Max, "ZeRO checkpoint: optimizer state presence");
  t = table.data_ptr<int64_t>();
  models::NamedTensors out;
  torch::NoGradGuard ng;
  for (const auto& up : units_) {
    const Unit& u = *up;
    if (u.layout.params.empty()) continue;
    for (const auto& f : tensors) {
      auto shard = torch::zeros_like(u.shard_data);
      for (size_t i = 0; i < pieces_.size(); ++i)
        if (units_[piece_at_[i].unit].get() == &u)
          if (auto it = mine.find(pieces_[i].first + "." + f); it != mine.end())
            shard.narrow(0, piece_at_[i].in_shard, it->second.numel()).copy_(it->second.reshape({-1}));
      auto full = torch::empty({u.layout.shard * coll_->size()}, shard.options());
      coll_->start_all_gather_into(full, shard, "ZeRO checkpoint: optimizer state all-gather").wait();
      for (size_t k = 0; k < u.layout.params.size(); ++k) {
        const size_t i = u.layout.params[k];
        if (owner[i] != coll_->rank() || t[i] < 0) continue;
        const int64_t n = c10::multiply_integers(u.layout.shapes[k]);
        out.emplace_back(params_[i].first + "." + f,
                         full.narrow(0, u.layout.offsets[k], n).view(u.layout.shapes[k]).clone());
      }
    }
    for (size_t k = 0; k < u.layout.params.size(); ++k) {
      const size_t i = u.layout.params[k];
      if (owner[i] != coll_->rank() || t[i] < 0) continue;
      for (int64_t s = 0; s < S; ++s)
        if (t[P * (1 + s) + static_cast<int64_t>(i)] >= 0)
          out.emplace_back(params_[i].first + "." + scalars[static_cast<size_t>(s)],
                           torch::tensor(t[P * (1 + s) + static_cast<int64_t>(i)], torch::kLong));
    }
  }
  return out;
}

models::NamedTensors FullyShard::piece_state(const models::NamedTensors& whole_state) const {
  std::map<std::string, size_t> piece_of;
  for (size_t i = 0; i < pieces_.size(); ++i) piece_of[pieces_[i].first] = i;
  models::NamedTensors out;
  for (const auto& [name, t] : whole_state) {
    const size_t dot = name.find_last_of('.');
    const auto it = dot == std::string::npos ? piece_of.end() : piece_of.find(name.substr(0, dot));
    if (it == piece_of.end()) {
      out.emplace_back(name, t);
      continue;
    }
    const auto& at = piece_at_[it->second];
    if ((t.dim() == 0 && !t.is_floating_point()) ||
        t.numel() != placement_.numel(at.param)) {  // a scalar, or a tensor the loader will name
      out.emplace_back(name, t);
      continue;
    }
    out.emplace_back(name, t.reshape({-1}).narrow(0, at.in_param, pieces_[it->second].second.numel()).clone());
  }
  return out;
}

models::NamedTensors FullyShard::whole_owned_parameters() {
  models::NamedTensors out;
  torch::NoGradGuard ng;
  for (auto& up : units_) {
    Unit& u = *up;
    const bool held = u.gathered;
    gather(u);
    for (size_t k = 0; k < u.layout.params.size(); ++k)
      if (placement_.owner(u.layout.params[k]) == coll_->rank())  // to the host at once: the device keeps one unit
        out.emplace_back(params_[u.layout.params[k]].first,
                         u.full.narrow(0, u.layout.offsets[k], u.layout.sizes[k])
                             .view(u.layout.shapes[k])
                             .to(torch::kCPU, /*non_blocking=*/false, /*copy=*/true));
    if (!held) free(u);
  }
  return out;
}

void FullyShard::load_pieces(const models::NamedTensors& whole) {
  // Only the shards are written: a whole copy (stage 2's buffers, a gathered unit) would keep
  // the old values.
  for (const auto& u : units_)
    if (keeps_whole() || (u->gathered && !u->layout.params.empty()))
      throw std::logic_error("FullyShard::load_pieces: stage 3 with no unit gathered only");
  std::map<std::string, const torch::Tensor*> by_name;
  for (const auto& [n, t] : whole) by_name[n] = &t;
  torch::NoGradGuard ng;
  for (size_t i = 0; i < pieces_.size(); ++i) {
    const auto& at = piece_at_[i];
    const auto it = by_name.find(params_[at.param].first);
    if (it == by_name.end() || it->second->numel() != placement_.numel(at.param)) continue;
    pieces_[i].second.copy_(it->second->reshape({-1}).narrow(0, at.in_param, at.numel));
  }
}

models::NamedTensors FullyShard::parameter_shapes() const {
  models::NamedTensors out(params_.size());  // model order
  for (const auto& up : units_)
    for (size_t k = 0; k < up->layout.params.size(); ++k)
      out[up->layout.params[k]] = {params_[up->layout.params[k]].first,
                                   torch::empty(up->layout.shapes[k], up->shard_data.options().device(torch::kMeta))};
  return out;
}

int64_t FullyShard::parameter_bytes() const {
  int64_t b = 0;
  for (const auto& u : units_)
    if (u->shard_data.defined()) b += static_cast<int64_t>(keeps_whole() ? u->full.nbytes() : u->shard_data.nbytes());
  return b;
}

int64_t FullyShard::gradient_bytes() const {
  int64_t b = 0;
  for (const auto& u : units_)
    if (u->shard_grad.defined()) b += static_cast<int64_t>(u->shard_grad.nbytes());
  return b;
}

}  // namespace keel::dist
