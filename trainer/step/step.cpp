#include "trainer/step/step.h"

#include <ATen/record_function.h>

#include <algorithm>
#include <string>
#include <vector>

#include "amp/autocast.h"
#include "amp/grad_scaler.h"
#include "dist/phase.h"
#include "dist/tp_ops.h"
#include "keel/common/error.h"
#include "keel/dist/collectives.h"
#include "trainer/loss.h"
#include "trainer/run.h"
#include "trainer/step/compiled.h"
#include "trainer/step/eager.h"
#include "trainer/step/graphs.h"
#include "trainer/step/pipelined.h"

namespace keel {

namespace {
template <class Kind>
std::unique_ptr<Step> made(Run& run) {
  return std::make_unique<Kind>(run.job, run.net, run.data, run.update, run.progress, run.graphs);
}
}  // namespace

std::unique_ptr<Step> make_step(Run& run) {
  if (run.job.mesh.pp() > 1) return made<PipelinedStep>(run);
  if (run.net.dmodel->inductor_step()) return made<CompiledStep>(run);
  return made<EagerStep>(run);
}

Step::Step(const JobParts& job, ModelParts& net, DataParts& data, UpdateParts& update, const Progress& progress,
           GraphCounts& counts)
    : job_(job), net_(net), data_(data), update_(update), first_step_(progress.steps_done + 1) {
  if (job.cfg.compile.cuda_graphs) graphs_ = std::make_unique<StepGraphs>(job, net, update, progress, counts);
}

// Without train.grad_clip the global gradient norm is measured (one norm and one all-reduce of a
// number) on the loop's first step and every train.log_interval-th, so that a step whose
// gradients are all exactly zero is said in the log (RunReport::log_step): a model that cannot
// train is never silent. Under compile.cuda_graphs every step measures: the update graph replays
// what its capture did (a few kernels and one scalar all-reduce inside it), so a measurement
// left out of the capture would be left out of every later step.
bool Step::measures_norm(int64_t step) const {
  if (job_.cfg.train.grad_clip > 0) return false;  // the clip measures it every step
  if (graphs_) return true;
  const int64_t every = std::max<int64_t>(1, job_.cfg.train.log_interval);
  return step == first_step_ || step % every == 0;
}

Step::~Step() = default;

Launched Step::launch(StepResult& r) {
  r.lr = update_.schedule->at(r.step - 1);
  set_lr(*update_.optimizer, r.lr);
  const std::vector<data::Batch> batches = next_batches(r.step);
  r.epoch = data_.sampler->position().epoch;
  Launched l;
  dist::Collectives::Sequence tp_calls = tensor_parallel_calls(batches);
  if (graphs_)
    l.loss = graphs_->forward_backward(batches, [this](const auto& b) { return forward_backward(b, nullptr); });
  else
    l.loss = forward_backward(batches, update_.late ? nullptr : &l.loss_now);
  tp_calls.end();
  job_.faults->after_backward(r.step, net_.owned);
  // The verdict on the device (late), or read now (step: the host decides, as cheaply as it can).
  if (update_.late) {
    l.nonfinite = local_nonfinite(l.loss);
  } else {
    l.nonfinite_now = local_nonfinite_now(l.loss_now);
  }
  return l;
}

dist::Collectives::Sequence Step::tensor_parallel_calls(const std::vector<data::Batch>& batches) const {
  // compile.cuda_graphs: a replayed graph issues its collectives without the host (validated call
  // by call in the eager warm-up steps, then captured).
  if (job_.mesh.tp() == 1 || graphs_) return {};
  // What makes one step's calls differ from another's: the micro-batches and their shapes.
  std::vector<int64_t> words = {static_cast<int64_t>(batches.size())};
  for (const data::Batch& b : batches) {
    words.insert(words.end(), b.input.sizes().begin(), b.input.sizes().end());
    words.push_back(-1);
    words.insert(words.end(), b.target.sizes().begin(), b.target.sizes().end());
    words.push_back(-2);
  }
  return job_.mesh.on(dist::Axis::Tp).sequence(dist::fingerprint(words));
}

torch::Tensor Step::eager_loss(const torch::Tensor& input, const torch::Tensor& target, bool sync) {
  amp::Autocast ac(job_.device.type(), net_.amp.dtype, net_.amp.enabled);
  auto out = net_.dmodel->forward(input, sync, /*step=*/true);
  return net_.loss(out, target).to(torch::kFloat);
}

// The step's micro-batches, on the device (on a GPU through pinned memory, without making the
// host wait for the copy); with the default loss, their targets checked on the host first.
std::vector<data::Batch> Step::next_batches(int64_t step) {
  RECORD_USER_SCOPE("keel::data");
  std::vector<data::Batch> batches;
  for (int64_t micro = 0; micro < job_.cfg.train.grad_accum; ++micro) {
    data::Batch b = data_.splits.train->get(data_.sampler->next());
    if (job_.classifier()) {  // a bad target is carried to the consensus, so every rank fails with it
      const std::string bad =
          screen_targets(b.target, net_.spec.num_classes, job_.cfg.train.ignore_index,
                         "training batch of step " + std::to_string(step) + " (micro-batch " + std::to_string(micro) +
                             ") on rank " + std::to_string(job_.world.rank));
      if (bad_input_.empty()) bad_input_ = bad;
    }
    batches.push_back({to_device(b.input), to_device(b.target)});
  }
  return batches;
}

// Forward and backward over the step's micro-batches; returns this rank's mean loss, a float64
// tensor of one element on the device (nothing is read by the host), or, given `loss_now`, reads
// it into *loss_now (the sum in double, as the tensor's) and returns nothing.
torch::Tensor Step::forward_backward(const std::vector<data::Batch>& batches, double* loss_now) {
  const auto accum = static_cast<int64_t>(batches.size());
  clear_gradients();
  torch::Tensor loss_sum;
  double host_sum = 0;
  for (int64_t micro = 0; micro < accum; ++micro) {
    // Gradients are all-reduced only on the last micro-batch of the step.
    const bool sync = micro + 1 == accum;
    const data::Batch& b = batches[static_cast<size_t>(micro)];
    torch::Tensor loss;
    {
      RECORD_USER_SCOPE("keel::forward");
      dist::PhaseScope phase(dist::Phase::Forward, -1, static_cast<int32_t>(micro));
      loss = micro_batch_loss(b.input, b.target, sync);
    }
    auto scaled = loss / static_cast<double>(accum);
    {
      RECORD_USER_SCOPE("keel::backward");  // with the Reducer's gradient all-reduces on the last micro-batch
      dist::PhaseScope phase(dist::Phase::Backward, -1, static_cast<int32_t>(micro));
      net_.dmodel->backward(update_.scaler ? update_.scaler->scale(scaled) : scaled, sync);
    }
    if (loss_now) {
      host_sum += loss.item<double>();
    } else {
      const torch::Tensor l = loss.detach().to(torch::kDouble).reshape({1});
      loss_sum = loss_sum.defined() ? loss_sum + l : l;
    }
  }
  if (loss_now) {
    *loss_now = host_sum / static_cast<double>(accum);
    return {};
  }
  return loss_sum / static_cast<double>(accum);
}

// train.grads_to_none: gradients nothing else holds are freed, so that the forward runs without
// them (PyTorch's zero_grad(set_to_none=True)); DDP's bucket views and ZeRO's are zeroed, and so
// is every gradient under compile.cuda_graphs (a captured backward writes where they are).
void Step::clear_gradients() {
  if (job_.cfg.train.grads_to_none && !job_.cfg.compile.cuda_graphs && !net_.dmodel->gradients_are_buffers())
    free_grads(net_.params);
  else
    zero_grads(net_.params);
  net_.dmodel->zero_gradient_shards();
}

uint64_t Step::plan() const { return net_.dmodel->plan(); }

void Step::hold_whole_model(bool wanted) { net_.dmodel->hold_whole_model(wanted); }

torch::Tensor Step::to_device(const torch::Tensor& t) const {
  const torch::Device& device = job_.device;
  if (device.is_cpu() || !t.device().is_cpu()) return t.to(device);
  return (t.is_pinned() ? t : t.pin_memory()).to(torch::TensorOptions().device(device), /*non_blocking=*/true);
}

// This rank's verdict on its gradients, after unscaling (before clipping): a float32 tensor of one
// element on their device, 1 = inf/NaN; undefined when nothing asks to look (no loss scaling,
// train.skip_nonfinite off, no fault watching them). With dist.zero >= 1 a rank reads only the
// gradients it owns; the consensus ORs the verdicts.
torch::Tensor Step::grad_verdict() {
  if (update_.scaler) return update_.scaler->unscale_on_device(verdict_parameters());
  if (job_.cfg.train.skip_nonfinite || job_.faults->watches_gradients()) return amp::nonfinite(verdict_parameters());
  return {};
}

const std::vector<torch::Tensor>& Step::verdict_parameters() const { return net_.owned; }

// The verdict on the loss and the gradients, on the device (dist.consensus = late).
torch::Tensor Step::local_nonfinite(const torch::Tensor& local_loss) {
  const torch::Tensor bad = local_loss.isfinite().logical_not().to(torch::kFloat).reshape({1});
  const torch::Tensor grads = grad_verdict();
  return grads.defined() ? torch::maximum(grads.to(bad.device()), bad) : bad;
}

// The same verdict, read by the host (dist.consensus = step).
bool Step::local_nonfinite_now(double local_loss) {
  const torch::Tensor grads = grad_verdict();
  return (grads.defined() && grads.item<float>() != 0) || !std::isfinite(local_loss);
}

// Clip and step, or skip on every rank. With dist.consensus = late the skip is decided on the
// device (the consensus' found_inf feeds the fused kernel and the GradScaler) and the step's
// grad norm and loss scales are copied to the host behind an event, read when the step
// finishes; otherwise the host has read the consensus already and decides.
void Step::update(InFlight& f) {
  RECORD_USER_SCOPE("keel::optimizer");
  dist::PhaseScope phase(dist::Phase::Optimizer);
  if (update_.late) {
    device_decided_update(f);
  } else {
    host_decided_update(f.r);
  }
}

void Step::host_decided_update(StepResult& r) {
  amp::GradScaler* scaler = update_.scaler.get();
  if (!r.skipped) {
    if (job_.cfg.train.grad_clip > 0)
      r.grad_norm = net_.dmodel->clip_grad_norm(job_.cfg.train.grad_clip).item<double>();
    else if (measures_norm(r.step))
      r.grad_norm = net_.dmodel->grad_norm().item<double>();
    update_.optimizer->step();
    net_.dmodel->sync_parameters();  // dist.zero >= 1: each owner's update to every rank
  }
  if (scaler) {
    if (r.skipped) r.loss_scale_before = scaler->scale_value();  // for the skip's warning only
    scaler->update(r.skipped);
    r.loss_scale = scaler->scale_value();
  }
}

void Step::device_decided_update(InFlight& f) {
  const torch::Tensor found = f.record.found_inf().to(net_.params.front().device());
  const bool measure = measures_norm(f.r.step);
  const torch::Tensor extras =
      graphs_ ? graphs_->update(found, f.r.lr, [this, measure](const auto& v) { return device_update(v, measure); })
              : device_update(found, measure);
  if (update_.scaler) update_.scaler->end_step();  // a replayed update() ran its kernels only
  f.extras = HostCopy::start(extras);
}

// The update the device decides on `found` (float32, one element: skip when non-zero); returns
// float64 [grad norm, loss scale before the update, after it] (NaN where there is none), on the
// device. `measure_norm`: without train.grad_clip, the norm measured anyway (measures_norm).
torch::Tensor Step::device_update(const torch::Tensor& found, bool measure_norm) {
  amp::GradScaler* scaler = update_.scaler.get();
  const torch::Device dev = found.device();
  const auto nan = torch::full({1}, std::nan(""), torch::TensorOptions().dtype(torch::kDouble).device(dev));
  torch::Tensor norm = nan;
  if (job_.cfg.train.grad_clip > 0)  // NaN on a skipped step, as when the host decides
    norm = torch::where(found.ne(0), nan,
                        net_.dmodel->clip_grad_norm(job_.cfg.train.grad_clip).to(torch::kDouble).reshape({1}));
  else if (measure_norm)
    norm = torch::where(found.ne(0), nan, net_.dmodel->grad_norm().to(torch::kDouble).reshape({1}));
  const torch::Tensor scale_before = scaler ? scaler->scale_tensor().to(dev, torch::kDouble).reshape({1}) : nan;
  update_.fused->step_unless(found);
  net_.dmodel->sync_parameters();  // dist.zero >= 1: each owner's update (or its old values) to every rank
  if (scaler) scaler->update(found);
  const torch::Tensor scale_after = scaler ? scaler->scale_tensor().to(dev, torch::kDouble).reshape({1}) : nan;
  return torch::cat({norm, scale_before, scale_after});
}

EvalResult Step::evaluate(int64_t step) {
  EvalResult r;
  r.step = step;
  const data::Splits& splits = data_.splits;
  if (!splits.test) return r;
  dist::PhaseScope phase(dist::Phase::Eval);
  job_.faults->signal(FaultPhase::Eval, step);
  net_.dmodel->sync_buffers();  // every rank evaluates rank 0's model
  torch::NoGradGuard no_grad;
  net_.model->train(false);
  const int64_t dp = job_.mesh.dp(), eval_batch = job_.cfg.data.eval_batch_size;
  const int64_t n =
      job_.cfg.data.eval_samples > 0 ? std::min(splits.test->size(), job_.cfg.data.eval_samples) : splits.test->size();
  std::vector<std::vector<int64_t>> batches(1);
  for (int64_t i = job_.mesh.dp_rank(); i < n; i += dp) {
    batches.back().push_back(i);
    if (static_cast<int64_t>(batches.back().size()) == eval_batch && i + dp < n) batches.emplace_back();
  }
  if (batches.back().empty()) batches.pop_back();
  // dist.zero = 3: each block is gathered around its call, as in training, so every rank runs
  // as many forwards as the rank with the most batches (one more all-reduce; the extra ones
  // are discarded), and no rank holds the whole model.
  double loss_sum = 0, correct = 0, count = 0;
  std::string bad;  // this rank's first bad target: summed over dp with the totals, thrown on every rank
  const int64_t rounds = net_.dmodel->evaluation_rounds(static_cast<int64_t>(batches.size()));
  for (int64_t k = 0; k < rounds; ++k) {
    const bool real = k < static_cast<int64_t>(batches.size());
    auto b = splits.test->get(real ? batches[static_cast<size_t>(k)] : std::vector<int64_t>{0});
    if (real && job_.classifier()) {
      const std::string b_bad = screen_targets(
          b.target, net_.spec.num_classes, job_.cfg.train.ignore_index,
          "evaluation batch at step " + std::to_string(step) + " on rank " + std::to_string(job_.world.rank));
      if (bad.empty()) bad = b_bad;
    }
    auto out = net_.dmodel->evaluation_forward(b.input.to(job_.device), *net_.model);
    if (real) evaluate_batch(out, b.target.to(job_.device), loss_sum, correct, count);
  }
  net_.model->train(true);
  net_.dmodel->end_evaluation();
  auto totals = torch::tensor({loss_sum, correct, count, bad.empty() ? 0.0 : 1.0}, torch::kDouble);
  job_.mesh.on(dist::Axis::Dp).all_reduce(totals, dist::ReduceOp::Sum, "evaluation totals");
  // Every tp rank of a dp rank reads the same batches, so every dp group sums the same verdict.
  if (totals[3].item<double>() > 0) throw InputError(dist::first_error(*job_.coll, bad, "evaluation targets").message);
  return evaluation_result(step, totals);
}

// The totals summed over the ranks ([loss, top-1 hits, counted targets, ...], float64) as a result.
EvalResult Step::evaluation_result(int64_t step, const torch::Tensor& totals) const {
  EvalResult r;
  r.step = step;
  const double loss_sum = totals[0].item<double>(), correct = totals[1].item<double>(),
               count = totals[2].item<double>();
  r.loss = count > 0 ? loss_sum / count : std::nan("");
  r.accuracy = count > 0 && job_.classifier() ? correct / count : std::nan("");
  r.count = static_cast<int64_t>(count);
  return r;
}

// One evaluation batch's sums: the loss over its samples (tokens), and with the default loss
// the top-1 hits; targets equal to train.ignore_index count in neither, nor in `count`.
void Step::evaluate_batch(const torch::Tensor& out, const torch::Tensor& target, double& loss_sum, double& correct,
                          double& count) {
  const int64_t ignore = job_.cfg.train.ignore_index;
  if (job_.mesh.tp() > 1) {  // this rank's vocabulary columns (parallel.tp; the default loss)
    const dist::tp::VocabRange range = net_.vocab_range(job_.mesh);
    dist::Collectives& tp = job_.mesh.on(dist::Axis::Tp);
    const auto t = target.reshape({-1});
    const auto counted = t.ne(ignore);
    const auto tokens = static_cast<double>(counted.sum().item<int64_t>());
    loss_sum += dist::tp::vocab_parallel_cross_entropy(out, t, range, tp, ignore).item<double>() * tokens;
    correct += static_cast<double>(
        dist::tp::vocab_parallel_argmax(out, range, tp).eq(t).logical_and(counted).sum().item<int64_t>());
    count += tokens;
    return;
  }
  if (job_.classifier()) {
    auto flat = out.reshape({-1, out.size(-1)});
    auto t = target.reshape({-1});
    const auto counted = t.ne(ignore);
    loss_sum +=
        torch::nn::functional::cross_entropy(
            flat, t, torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum).ignore_index(ignore))
            .item<double>();
    correct += static_cast<double>(flat.argmax(1).eq(t).logical_and(counted).sum().item<int64_t>());
    count += static_cast<double>(counted.sum().item<int64_t>());
  } else {
    const auto rows = static_cast<double>(out.size(0));
    loss_sum += net_.loss(out, target).item<double>() * rows;
    count += rows;
  }
}

}  // namespace keel
