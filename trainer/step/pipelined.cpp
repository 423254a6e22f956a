#include "trainer/step/pipelined.h"

#include <ATen/record_function.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "amp/autocast.h"
#include "amp/grad_scaler.h"
#include "common/log.h"
#include "dist/fsdp.h"
#include "dist/phase.h"
#include "dist/tp_ops.h"
#include "dist/zero.h"
#include "keel/common/error.h"
#include "trainer/config/pipeline.h"
#include "trainer/loss.h"
#include "trainer/optim.h"
#include "trainer/run.h"
#include "trainer/step/split_backward.h"

namespace keel {

using dist::P2POp;
using dist::pipeline::Action;
using dist::pipeline::Op;

namespace {

// A message's identity at both ends: what it carries (an activation, its gradient, or the shape
// of an activation, sent once per batch shape), the stage whose output it is, the micro-batch.
enum Carries : int64_t { kActivation = 0, kGradient = 1, kShape = 2, kRoot = 3 };
int64_t tag_of(Carries what, int stage, int mb) {
  return (static_cast<int64_t>(what) << 40) | (static_cast<int64_t>(stage) << 20) | mb;
}
std::string name_tag(int64_t tag) {
  const auto what = static_cast<Carries>(tag >> 40);
  const std::string of = "stage " + std::to_string((tag >> 20) & 0xfffff) + "'s activation of micro-batch " +
                         std::to_string(tag & 0xfffff);
  if (what == kRoot) return "the root's gradients (first and last stage)";
  return what == kActivation ? of : what == kGradient ? "the gradient of " + of : "the shape of " + of;
}

constexpr int64_t kShapeWords = 10;  // dtype, ndim, dims[8]

torch::Tensor shape_message(const torch::Tensor& t) {
  TORCH_CHECK(t.dim() <= kShapeWords - 2, "a pipeline stage's output has more than 8 dimensions: ", t.sizes());
  auto m = torch::zeros({kShapeWords}, torch::kLong);
  m[0] = static_cast<int64_t>(t.scalar_type());
  m[1] = t.dim();
  for (int64_t i = 0; i < t.dim(); ++i) m[2 + i] = t.size(i);
  return m;
}

}  // namespace

struct PipelinedStep::Slot {
  torch::Tensor input;              // the stage's input (after the first stage: a leaf whose gradient is sent back)
  torch::Tensor output;             // the stage's output with its graph (the last stage's: its loss)
  dist::Collectives::Started recv;  // a posted receive of its input or of its output's gradient
  torch::Tensor received;
  WeightBackward weights;  // the zero-bubble schedules: what I leaves for W
};

PipelinedStep::PipelinedStep(const JobParts& job, ModelParts& net, DataParts& data, UpdateParts& update,
                             const Progress& progress, GraphCounts& counts)
    : Step(job, net, data, update, progress, counts), schedule_(pipeline_schedule(job.cfg)) {
  stages_ = dynamic_cast<dist::StageModel*>(&net.dmodel->model());
  if (!stages_) throw std::logic_error("PipelinedStep: the model is not split into stages (dist/stages.h)");
  pp_ = &job.mesh.on(dist::Axis::Pp);
  rank_ = static_cast<int>(pp_->rank());
  // A compiled block's backward (one package call) makes its input's and its weights' gradients
  // together: split, W would run it a second time. Its I then runs the whole backward, W nothing.
  split_ = !net.dmodel->inductor_block();
  // One gradient plan for every rank: each stage's, in stage order (they differ; the consensus
  // compares one word).
  auto mine = torch::tensor({static_cast<int64_t>(net.dmodel->plan())}, torch::kLong);
  std::vector<int64_t> words;
  for (const auto& t : pp_->all_gather(mine, "pipeline gradient plans")) words.push_back(t.item<int64_t>());
  plan_ = dist::fingerprint(words);
  // The global norm: each parameter of the whole model counted once, by the rank of its stage
  // (the root's by the first stage's), in the whole model's order, so that the norm's vector is
  // the one rank's, summed over pp from entries that are 0 elsewhere.
  const auto prefixes = stages_->whole().block_prefixes();
  const auto& ranges = stages_->ranges();
  for (const auto& [name, t] : stages_->whole().named_parameters()) {
    int64_t owner = schedule_.stage_rank.front();
    for (size_t b = 0; b < prefixes.size(); ++b)
      if (name.compare(0, prefixes[b].size(), prefixes[b]) == 0)
        for (size_t s = 0; s < ranges.size(); ++s)
          if (ranges[s].first <= b && b < ranges[s].end) owner = schedule_.stage_rank[s];
    whole_owner_.push_back(owner);
  }
  net.dmodel->set_global_norm([this](double max_norm) { return global_norm(max_norm); });
  job.faults->strike_sends_with_shape_mismatch();
  std::map<std::string, int64_t> owner_of;
  const models::NamedTensors whole = stages_->whole().named_parameters();
  for (size_t i = 0; i < whole.size(); ++i) owner_of[whole[i].first] = whole_owner_[i];
  for (const auto& [n, p] : stages_->named_parameters()) held_.push_back(p), held_owner_.push_back(owner_of.at(n));
  // parallel.tp > 1: the held parameters' tensor-parallel split (dist/tensor_parallel.h), in held order.
  if (const auto& split = net.dmodel->transforms().split_gradients(); split && split->group->size() > 1)
    tp_split_ = *split;
  // dist.zero >= 2: the stage's ZeRO layout, held whole for each step's schedule (dist/fsdp.h).
  fsdp_ = net.dmodel->fully_shard();
  if (fsdp_) {  // each piece's parameter, by its place in held_
    std::map<std::string, size_t> at;
    const models::NamedTensors held = stages_->named_parameters();
    for (size_t k = 0; k < held.size(); ++k) at[held[k].first] = k;
    for (const auto& [name, piece] : fsdp_->pieces()) piece_held_.push_back(at.at(name));
  }
  // Built, compiled and distributed: the other stages' parameters are not this rank's to keep.
  stages_->release_others();
}

PipelinedStep::~PipelinedStep() = default;

torch::Tensor PipelinedStep::micro_batch_loss(const torch::Tensor&, const torch::Tensor&, bool) {
  throw std::logic_error("PipelinedStep: a micro-batch's loss is its schedule's (launch)");
}

PipelinedStep::Slot& PipelinedStep::slot(int stage, int mb) {
  auto& s = slots_[{stage, mb}];
  if (!s) s = std::make_unique<Slot>();
  return *s;
}

Launched PipelinedStep::launch(StepResult& r) {
  r.lr = update_.schedule->at(r.step - 1);
  set_lr(*update_.optimizer, r.lr);
  const std::vector<data::Batch> batches = next_batches(r.step);
  r.epoch = data_.sampler->position().epoch;
  clear_gradients();
  fault_send_ = job_.faults->sends_another_shape(r.step);
  const bool last = stages_->holds_last();
  if (fsdp_) hold_stage();
  dist::Collectives::Sequence tp_calls = tensor_parallel_calls(batches);
  torch::Tensor loss = run_schedule(batches);
  sum_partial_over_tensor_parallel();
  tp_calls.end();
  if (fsdp_) {  // the root's whole gradients summed first, then every gradient reduce-scattered over dp
    sum_root_gradients();
    reduce_stage();
  } else {
    average_over_data_parallel();
    sum_root_gradients();
  }
  job_.faults->after_backward(r.step, net_.owned);
  Launched l;
  l.share.weight = last ? 1.0 : 0.0;
  l.share.p2p_balance = pp_->take_p2p_balance();
  if (!last) loss = torch::zeros({1}, torch::TensorOptions().dtype(torch::kDouble).device(job_.device));
  if (update_.late) {
    l.loss = loss;
    l.nonfinite = local_nonfinite(l.loss);
  } else {
    l.loss_now = loss.item<double>();
    l.nonfinite_now = local_nonfinite_now(l.loss_now);
  }
  return l;
}

// This rank's actions in order; returns the last stage's mean loss over the micro-batches
// (float64, one element), or nothing on another rank.
torch::Tensor PipelinedStep::run_schedule(const std::vector<data::Batch>& batches) {
  loss_sum_ = torch::Tensor();
  for (const Action& a : schedule_.lowered[static_cast<size_t>(rank_)]) {
    const bool forward_side = a.op == Op::F || a.op == Op::RecvF || a.op == Op::SendF;
    dist::PhaseScope phase(forward_side ? dist::Phase::Forward : dist::Phase::Backward, a.stage, a.mb);
    switch (a.op) {
      case Op::F: {
        RECORD_USER_SCOPE("keel::forward");
        forward(a.stage, a.mb, batches);
        break;
      }
      case Op::B:
      case Op::I: {  // I: the input's gradient only, the weights' left for W (split_backward.h)
        RECORD_USER_SCOPE("keel::backward");
        backward(a.stage, a.mb, /*split=*/a.op == Op::I && split_);
        break;
      }
      case Op::W: {
        RECORD_USER_SCOPE("keel::backward_weight");
        Slot& s = slot(a.stage, a.mb);
        backward_weight(s.weights);
        s.output = torch::Tensor();
        break;
      }
      case Op::RecvF:
      case Op::RecvB:
        post_receive(a, batches);
        break;
      case Op::SendF:
      case Op::SendB:
        send(a, batches);
        break;
    }
  }
  for (auto& s : sends_) s.wait();
  sends_.clear();
  slots_.clear();
  if (!loss_sum_.defined()) return {};
  return loss_sum_ / static_cast<double>(batches.size());
}

torch::Tensor PipelinedStep::stage_input(Slot& slot, int stage, int mb, const std::vector<data::Batch>& batches) {
  if (stage == 0) return batches[static_cast<size_t>(mb)].input;
  torch::Tensor x;
  if (slot.recv) {  // from another rank
    slot.recv.wait();
    x = slot.received;
    slot.received = torch::Tensor();
  } else {  // this rank's previous stage (the V and interleaved schedules)
    x = this->slot(stage - 1, mb).output.detach();
  }
  return x.requires_grad_(true);
}

void PipelinedStep::forward(int stage, int mb, const std::vector<data::Batch>& batches) {
  Slot& s = slot(stage, mb);
  s.input = stage_input(s, stage, mb, batches);
  amp::Autocast ac(job_.device.type(), net_.amp.dtype, net_.amp.enabled);
  torch::Tensor out = stages_->forward_stage(stage, s.input);
  if (stage + 1 < stages_->stages()) {
    s.output = out;
    return;
  }
  s.output = net_.loss(out, batches[static_cast<size_t>(mb)].target).to(torch::kFloat);
  const torch::Tensor l = s.output.detach().to(torch::kDouble).reshape({1});
  loss_sum_ = loss_sum_.defined() ? loss_sum_ + l : l;
}

void PipelinedStep::backward(int stage, int mb, bool split) {
  Slot& s = slot(stage, mb);
  torch::Tensor root = s.output, grad;
  if (stage + 1 == stages_->stages()) {
    const torch::Tensor scaled = s.output / static_cast<double>(schedule_.microbatches);
    root = update_.scaler ? update_.scaler->scale(scaled) : scaled;
  } else {
    if (s.recv) {
      s.recv.wait();
      grad = s.received;
      s.received = torch::Tensor();
    } else {  // this rank's next stage: its input's gradient (then that input is done with)
      Slot& next = slot(stage + 1, mb);
      grad = next.input.grad();
      next.input = torch::Tensor();
    }
    if (!grad.defined()) grad = torch::zeros_like(s.output);
  }
  if (split) {
    s.weights = backward_input(root, grad, stage == 0 ? torch::Tensor() : s.input);
    return;  // the graph is kept for W
  }
  torch::autograd::backward({root}, {grad});  // undefined on the last stage: 1 for its scalar loss
  s.output = torch::Tensor();
}

// An activation's buffer: the shape its sender said for this batch shape (once per batch shape,
// received here before the payload).
torch::Tensor PipelinedStep::activation_buffer(int stage, const torch::Tensor& input) {
  const auto key = shape_key(stage, input);
  auto it = input_shapes_.find(key);
  if (it == input_shapes_.end()) {
    auto m = torch::empty({kShapeWords}, torch::kLong);
    const int64_t from = schedule_.stage_rank[static_cast<size_t>(stage - 1)];
    pp_->start_p2p({{P2POp::Kind::Recv, from, m, tag_of(kShape, stage - 1, 0)}}, "pipeline activation shape", name_tag)
        .wait();
    const int64_t* w = m.data_ptr<int64_t>();
    it =
        input_shapes_
            .emplace(key, std::make_pair(std::vector<int64_t>(w + 2, w + 2 + w[1]), static_cast<c10::ScalarType>(w[0])))
            .first;
  }
  return torch::empty(it->second.first, torch::TensorOptions().dtype(it->second.second).device(job_.device));
}

void PipelinedStep::post_receive(const Action& a, const std::vector<data::Batch>& batches) {
  Slot& s = slot(a.stage, a.mb);
  const bool activation = a.op == Op::RecvF;
  const int peer_stage = activation ? a.stage - 1 : a.stage + 1;
  s.received = activation ? activation_buffer(a.stage, batches[static_cast<size_t>(a.mb)].input)
                          : torch::empty_like(s.output, torch::MemoryFormat::Contiguous);
  const int64_t tag = activation ? tag_of(kActivation, a.stage - 1, a.mb) : tag_of(kGradient, a.stage, a.mb);
  s.recv = pp_->start_p2p({{P2POp::Kind::Recv, schedule_.stage_rank[static_cast<size_t>(peer_stage)], s.received, tag}},
                          activation ? "pipeline activation" : "pipeline gradient", name_tag);
}

void PipelinedStep::send(const Action& a, const std::vector<data::Batch>& batches) {
  Slot& s = slot(a.stage, a.mb);
  const bool activation = a.op == Op::SendF;
  const int peer_stage = activation ? a.stage + 1 : a.stage - 1;
  const int64_t peer = schedule_.stage_rank[static_cast<size_t>(peer_stage)];
  std::vector<P2POp> ops;
  torch::Tensor t;
  if (activation) {
    t = s.output.detach().contiguous();
    if (fault_send_ && t.dim() >= 2) {  // fault.inject shape_mismatch: the same bytes, another shape
      fault_send_ = false;
      t = t.flatten(0, 1);
      logging::warn("fault injection: shape_mismatch: rank {} sends {} as {}", job_.world.rank,
                    name_tag(tag_of(kActivation, a.stage, a.mb)), c10::str(t.sizes()));
    }
    // The shape goes in a call of its own, as its receiver takes it (the same calls at both ends
    // keep a pair's messages in one order under NCCL, which ignores tags).
    if (shapes_said_.insert(shape_key(a.stage + 1, batches[static_cast<size_t>(a.mb)].input)).second)
      sends_.push_back(pp_->start_p2p({{P2POp::Kind::Send, peer, shape_message(s.output), tag_of(kShape, a.stage, 0)}},
                                      "pipeline activation shape", name_tag));
    ops.push_back({P2POp::Kind::Send, peer, t, tag_of(kActivation, a.stage, a.mb)});
  } else {
    t = s.input.grad();
    if (!t.defined()) t = torch::zeros_like(s.input);
    ops.push_back({P2POp::Kind::Send, peer, t.contiguous(), tag_of(kGradient, a.stage - 1, a.mb)});
  }
  sends_.push_back(pp_->start_p2p(std::move(ops), activation ? "pipeline activation" : "pipeline gradient", name_tag));
  if (!activation) s.input = torch::Tensor();
}

// The key of an activation's shape at both ends: the receiving stage, the batch's input shape, and
// whether it is a training forward (autocast) or an evaluation one.
std::pair<int, std::vector<int64_t>> PipelinedStep::shape_key(int stage, const torch::Tensor& input) const {
  std::vector<int64_t> k = input.sizes().vec();
  k.push_back(torch::GradMode::is_enabled() ? 1 : 0);
  return {stage, std::move(k)};
}

// parallel.dp > 1: each stage's gradients averaged over its data-parallel peers once the schedule
// is done (the Reducer's hooks stay idle: every backward runs without sync), one all-reduce per
// dtype of everything this rank holds, then divided by dp as DDP's buckets are.
void PipelinedStep::average_over_data_parallel() {
  dist::Collectives& dp = job_.mesh.on(dist::Axis::Dp);
  if (dp.size() == 1) return;
  RECORD_USER_SCOPE("keel::pipeline_dp_all_reduce");
  std::map<c10::ScalarType, std::vector<torch::Tensor>> by_dtype;
  for (const auto& [name, p] : stages_->named_parameters()) {
    if (!p.grad().defined()) p.mutable_grad() = torch::zeros_like(p);
    by_dtype[p.grad().scalar_type()].push_back(p.grad());
  }
  for (auto& [dtype, grads] : by_dtype) {
    std::vector<torch::Tensor> flat;
    for (const auto& g : grads) flat.push_back(g.reshape({-1}));
    torch::Tensor all = torch::cat(flat);
    dp.all_reduce(all, dist::ReduceOp::Sum, "pipeline stage gradients over dp");
    all.div_(static_cast<double>(dp.size()));
    int64_t at = 0;
    for (auto& g : grads) {
      g.copy_(all.slice(0, at, at + g.numel()).view_as(g));
      at += g.numel();
    }
  }
}

// The root's gradients summed between the first and the last stage's ranks (the same sum on both:
// a + b is b + a), so that both copies of the root take the same update.
void PipelinedStep::sum_root_gradients() {
  const int first = schedule_.stage_rank.front(), last = schedule_.stage_rank.back();
  const auto& root = stages_->root_parameters();
  if (first == last || root.empty() || (rank_ != first && rank_ != last)) return;
  std::vector<torch::Tensor> grads;
  for (const auto& [name, p] : root) {
    if (!p.grad().defined()) p.mutable_grad() = torch::zeros_like(p);
    TORCH_CHECK(p.grad().scalar_type() == root.front().second.scalar_type(),
                "pipeline: the root's parameters hold gradients of more than one dtype (", name, ")");
    grads.push_back(p.grad());
  }
  std::vector<torch::Tensor> flat;
  for (const auto& g : grads) flat.push_back(g.reshape({-1}));
  const torch::Tensor mine = torch::cat(flat), theirs = torch::empty_like(mine);
  const int64_t peer = rank_ == first ? last : first, tag = tag_of(kRoot, 0, 0);
  pp_->start_p2p({{P2POp::Kind::Send, peer, mine, tag}, {P2POp::Kind::Recv, peer, theirs, tag}},
                 "pipeline root gradients", name_tag)
      .wait();
  const torch::Tensor sum = rank_ == first ? mine + theirs : theirs + mine;
  int64_t at = 0;
  for (auto& g : grads) {
    g.copy_(sum.slice(0, at, at + g.numel()).view_as(g));
    at += g.numel();
  }
}

// dist.zero >= 2: the stage's units gathered whole for the schedule (ZeRO-3; ZeRO-2's stay whole),
// their hooks idle, so that every micro-batch's gradients accumulate whole (one dp sequence: the
// gathers validated on the first step, replayed after).
void PipelinedStep::hold_stage() {
  if (!fsdp_->placement().shards_parameters()) return fsdp_->hold();  // ZeRO-2: whole already (no collective)
  dist::Collectives::Sequence gathers = job_.mesh.on(dist::Axis::Dp).sequence(kGathers);
  fsdp_->hold();
  gathers.end();
}

// ... and after it, each unit's gradients reduce-scattered into this rank's shard (averaged over
// dp), the whole ones freed, the units free again.
void PipelinedStep::reduce_stage() {
  RECORD_USER_SCOPE("keel::pipeline_dp_reduce_scatter");
  dist::Collectives::Sequence scatters = job_.mesh.on(dist::Axis::Dp).sequence(kReduceScatters);
  fsdp_->reduce_accumulated();
  scatters.end();
  fsdp_->reshard();
}

// parallel.sequence_parallel: each replicated parameter's gradient holds this rank's positions'
// part of the sum over the stage's tp group; summed once the schedule's backwards are done.
void PipelinedStep::sum_partial_over_tensor_parallel() {
  if (!tp_split_) return;
  std::vector<torch::Tensor> partial;
  for (size_t k = 0; k < held_.size(); ++k)
    if (tp_split_->partial[k]) partial.push_back(held_[k]);
  dist::tp::sum_gradients(partial, *tp_split_->group);
}

// torch.nn.utils.clip_grad_norm_'s arithmetic over the whole model (dist/zero.h's vector of
// per-parameter norms, each entry filled by the one rank that counts it and summed over pp), so
// that the norm is one rank's; the clip scales every gradient this rank holds.
torch::Tensor PipelinedStep::global_norm(double max_norm) {
  if (fsdp_ || tp_split_) return summed_squares_norm(max_norm);
  const torch::Tensor total = dist::clip_grad_norm(stages_->whole().named_parameters(), whole_owner_, *pp_,
                                                   std::numeric_limits<double>::infinity(), /*sharded=*/true);
  if (std::isfinite(max_norm)) {
    std::vector<torch::Tensor> grads;
    for (const auto& p : held_)
      if (p.grad().defined()) grads.push_back(p.grad().detach());
    if (!grads.empty()) at::_foreach_mul_(grads, torch::clamp(max_norm / (total + 1e-6), std::nullopt, 1.0));
  }
  return total;
}

// parallel.tp > 1 or dist.zero >= 2: the squares of the gradients this rank keeps (the held
// parameters' tp parts, or its ZeRO pieces of them, distinct on each dp rank), each counted by the
// stage that counts its parameter and, if tp replicates it, on tp rank 0 only; summed over dp (the
// pieces), pp and tp. The clip scales every one of them.
torch::Tensor PipelinedStep::summed_squares_norm(double max_norm) {
  std::vector<torch::Tensor> counted, grads;
  auto add = [&](const torch::Tensor& t, size_t k) {
    const torch::Tensor& g = t.grad();
    if (!g.defined()) return;
    grads.push_back(g.detach());
    if (held_owner_[k] == rank_ && (!tp_split_ || !tp_split_->replicated[k] || tp_split_->group->rank() == 0))
      counted.push_back(g.detach());
  };
  std::vector<dist::Collectives*> groups;
  if (fsdp_) {
    const models::NamedTensors& pieces = fsdp_->pieces();
    for (size_t i = 0; i < pieces.size(); ++i) add(pieces[i].second, piece_held_[i]);
    groups.push_back(&job_.mesh.on(dist::Axis::Dp));
  } else {
    for (size_t k = 0; k < held_.size(); ++k) add(held_[k], k);
  }
  groups.push_back(pp_);
  if (tp_split_) groups.push_back(tp_split_->group);
  return dist::clip_by_summed_squares(counted, grads, groups, max_norm,
                                      fsdp_ ? "pipeline x ZeRO: gradient norm" : "pipeline x tp: gradient norm");
}

void PipelinedStep::hold_whole_model(bool wanted) {
  // Agreed over the world: ZeRO-3's gathers run over dp, the stages' broadcasts over pp (a rank
  // with Callbacks::on_end makes every rank take part).
  auto any = torch::tensor({wanted ? 1.0 : 0.0});
  job_.coll->all_reduce(any, dist::ReduceOp::Max, "pipeline whole model wanted");
  if (any.item<double>() == 0) return;
  if (fsdp_) fsdp_->hold();  // ZeRO-3: the stage's own parameters whole again (kept so)
  torch::NoGradGuard no_grad;
  stages_->remake_others();
  const models::NamedTensors whole = stages_->whole().named_parameters();
  for (size_t i = 0; i < whole.size(); ++i) {
    torch::Tensor t = whole[i].second.detach();
    pp_->broadcast(t, whole_owner_[i], "pipeline whole model");
  }
}

// Batch by batch, stage by stage: each rank runs its stages' forwards on what the previous stage's
// rank sends; the last stage's rank sums the loss; its totals go to every pp rank, then over dp.
EvalResult PipelinedStep::evaluate(int64_t step) {
  const data::Splits& splits = data_.splits;
  if (!splits.test) return EvalResult{step};
  dist::PhaseScope phase(dist::Phase::Eval);
  job_.faults->signal(FaultPhase::Eval, step);
  net_.dmodel->sync_buffers();  // every dp rank evaluates the same model
  if (fsdp_) hold_stage();      // ZeRO-3: the stage's parameters whole for the evaluation
  torch::NoGradGuard no_grad;
  net_.model->train(false);
  const int64_t dp = job_.mesh.dp(), eval_batch = job_.cfg.data.eval_batch_size;
  const int64_t n =
      job_.cfg.data.eval_samples > 0 ? std::min(splits.test->size(), job_.cfg.data.eval_samples) : splits.test->size();
  double loss_sum = 0, correct = 0, count = 0;
  std::string bad;  // the last stage's first bad target: thrown on every rank once the totals are in
  const int S = stages_->stages();
  std::vector<int64_t> batch;
  auto run_batch = [&] {
    auto b = splits.test->get(batch);
    const torch::Tensor input = b.input.to(job_.device);
    torch::Tensor x = input;
    for (int s = 0; s < S; ++s) {
      if (schedule_.stage_rank[static_cast<size_t>(s)] != rank_) continue;
      if (s > 0 && schedule_.stage_rank[static_cast<size_t>(s - 1)] != rank_) {
        x = activation_buffer(s, input);
        pp_->start_p2p({{P2POp::Kind::Recv, schedule_.stage_rank[static_cast<size_t>(s - 1)], x,
                         tag_of(kActivation, s - 1, 0)}},
                       "pipeline evaluation", name_tag)
            .wait();
      }
      x = stages_->forward_stage(s, x);
      if (s + 1 < S && schedule_.stage_rank[static_cast<size_t>(s + 1)] != rank_) {
        const int64_t peer = schedule_.stage_rank[static_cast<size_t>(s + 1)];
        x = x.contiguous();
        if (shapes_said_.insert(shape_key(s + 1, input)).second)
          pp_->start_p2p({{P2POp::Kind::Send, peer, shape_message(x), tag_of(kShape, s, 0)}}, "pipeline evaluation",
                         name_tag)
              .wait();
        pp_->start_p2p({{P2POp::Kind::Send, peer, x, tag_of(kActivation, s, 0)}}, "pipeline evaluation", name_tag)
            .wait();
      }
    }
    if (stages_->holds_last()) {
      const std::string b_bad = job_.classifier()
                                    ? screen_targets(b.target, net_.spec.num_classes, job_.cfg.train.ignore_index,
                                                     "evaluation batch at step " + std::to_string(step) + " on rank " +
                                                         std::to_string(job_.world.rank))
                                    : "";
      if (bad.empty()) bad = b_bad;
      if (b_bad.empty()) evaluate_batch(x, b.target.to(job_.device), loss_sum, correct, count);
    }
    batch.clear();
  };
  for (int64_t i = job_.mesh.dp_rank(); i < n; i += dp) {
    batch.push_back(i);
    if (static_cast<int64_t>(batch.size()) == eval_batch) run_batch();
  }
  if (!batch.empty()) run_batch();
  net_.model->train(true);
  if (fsdp_) fsdp_->reshard();
  auto totals = torch::tensor({loss_sum, correct, count, bad.empty() ? 0.0 : 1.0}, torch::kDouble);
  pp_->broadcast(totals, schedule_.stage_rank.back(), "pipeline evaluation totals");
  job_.mesh.on(dist::Axis::Dp).all_reduce(totals, dist::ReduceOp::Sum, "evaluation totals");
  if (totals[3].item<double>() > 0) throw InputError(dist::first_error(*job_.coll, bad, "evaluation targets").message);
  return evaluation_result(step, totals);
}

}  // namespace keel
