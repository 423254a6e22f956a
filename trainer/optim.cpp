#include "trainer/optim.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <optional>
#include <set>
#include <sstream>
#include <type_traits>

#include "common/registry.h"
#include "keel/common/error.h"
#include "keel/trainer/trainer.h"

namespace keel {

namespace {

struct OptimizerEntry {
  OptimizerFn make;
  OptimizerStateFn make_state;  // empty for the built-ins: their states are known by type
};

Registry<OptimizerEntry>& optimizers() {
  static Registry<OptimizerEntry> r("optimizer", "train.optimizer", [](Registry<OptimizerEntry>& t) {
    t.add_builtin(
        "adamw",
        {[](std::vector<torch::Tensor> params, const TrainConfig& c) -> std::unique_ptr<torch::optim::Optimizer> {
           auto o = torch::optim::AdamWOptions(c.lr).betas({c.beta1, c.beta2}).eps(c.eps).weight_decay(c.weight_decay);
           if (c.fused_optimizer) return std::make_unique<FusedAdamW>(params, o);
           return std::make_unique<torch::optim::AdamW>(params, o);
         },
         nullptr});
    t.add_builtin("sgd", {[](std::vector<torch::Tensor> params,
                             const TrainConfig& c) -> std::unique_ptr<torch::optim::Optimizer> {
                            auto o = torch::optim::SGDOptions(c.lr).momentum(c.momentum).weight_decay(c.weight_decay);
                            if (c.fused_optimizer) return std::make_unique<FusedSgd>(params, o);
                            return std::make_unique<torch::optim::SGD>(params, o);
                          },
                          nullptr});
  });
  return r;
}

}  // namespace

void register_optimizer(const std::string& name, OptimizerFn make, OptimizerStateFn make_state) {
  if (!make || !make_state) throw std::invalid_argument("register_optimizer(\"" + name + "\"): empty function");
  optimizers().add(name, {std::move(make), std::move(make_state)});
}

std::vector<std::string> registered_optimizers() { return optimizers().names(); }

std::unique_ptr<torch::optim::Optimizer> OptimizerChoice::make(const std::vector<torch::Tensor>& params) const {
  auto opt = make_(params, cfg_);
  if (!opt) throw InputError("train.optimizer = \"" + cfg_.optimizer + "\": its registered function made no optimizer");
  return opt;
}

std::unique_ptr<torch::optim::Optimizer> make_optimizer(const TrainConfig& cfg,
                                                        const std::vector<torch::Tensor>& params) {
  return resolve_optimizer(cfg).make(params);
}

// ---------------------------------------------------------------------------------------------
// The fused optimizers: per parameter group, the parameters with a gradient are grouped by
// device (one kernel each; keel's are all on one), the state is created on first use as
// PyTorch creates it, and one ATen kernel updates them all, reading found_inf on the device.
// ---------------------------------------------------------------------------------------------
torch::Tensor FusedOptimizer::step(LossClosure closure) {
  TORCH_CHECK(!closure, "keel's fused optimizers take no closure");
  step_unless({});
  return {};
}

namespace {

// The parameters of `group` that have a gradient, grouped by device and dtype as torch.optim
// groups them for a fused kernel (in order of first use).
std::vector<std::vector<torch::Tensor>> by_device(const torch::optim::OptimizerParamGroup& group) {
  std::vector<std::vector<torch::Tensor>> out;
  for (const auto& p : group.params()) {
    if (!p.grad().defined()) continue;
    TORCH_CHECK(!p.grad().is_sparse(), "keel's fused optimizers do not take sparse gradients");
    auto it = std::find_if(out.begin(), out.end(), [&](const auto& l) {
      return l.front().device() == p.device() && l.front().scalar_type() == p.scalar_type();
    });
    if (it == out.end())
      out.push_back({p});
    else
      it->push_back(p);
  }
  return out;
}

std::vector<torch::Tensor> grads_of(const std::vector<torch::Tensor>& params) {
  std::vector<torch::Tensor> g;
  g.reserve(params.size());
  for (const auto& p : params) g.push_back(p.grad());
  return g;
}

// found_inf as the fused kernels read it: exactly 1.0 skips (any other value would apply the
// update), so a non-zero verdict is made 1.0 first.
std::optional<torch::Tensor> on_device(const torch::Tensor& found_inf, const torch::Device& device) {
  if (!found_inf.defined()) return std::nullopt;
  TORCH_CHECK(found_inf.numel() == 1 && found_inf.scalar_type() == torch::kFloat,
              "found_inf must be a float32 tensor of one element");
  return found_inf.to(device).ne(0).to(torch::kFloat);
}

}  // namespace

FusedAdamW::FusedAdamW(std::vector<torch::Tensor> params, const torch::optim::AdamWOptions& o)
    : FusedOptimizer(std::move(params), std::make_unique<torch::optim::AdamWOptions>(o)) {}

void FusedAdamW::step_unless(const torch::Tensor& found_inf) {
  torch::NoGradGuard no_grad;
  for (auto& group : param_groups_) {
    const auto& o = static_cast<const torch::optim::AdamWOptions&>(group.options());
    for (const auto& params : by_device(group)) {
      std::vector<torch::Tensor> m, v, vmax, steps;
      for (const auto& p : params) {
        auto& slot = state_[p.unsafeGetTensorImpl()];
        if (!slot) {
          auto s = std::make_unique<ParamState>();
          s->step = torch::zeros({}, p.options().dtype(torch::kFloat));
          s->exp_avg = torch::zeros_like(p, torch::MemoryFormat::Preserve);
          s->exp_avg_sq = torch::zeros_like(p, torch::MemoryFormat::Preserve);
          if (o.amsgrad()) s->max_exp_avg_sq = torch::zeros_like(p, torch::MemoryFormat::Preserve);
          slot = std::move(s);
        }
        auto& s = static_cast<ParamState&>(*slot);
        steps.push_back(s.step);
        m.push_back(s.exp_avg);
        v.push_back(s.exp_avg_sq);
        if (o.amsgrad()) vmax.push_back(s.max_exp_avg_sq);
      }
      const auto inf = on_device(found_inf, params.front().device());
      // As torch.optim's _fused_adamw: the kernel reads the counts after the increment, and
      // leaves everything else alone when found_inf is set; the increment is undone then.
      at::_foreach_add_(steps, 1);
      const auto [b1, b2] = o.betas();
      if (lr_.defined())
        at::_fused_adamw_(params, grads_of(params), m, v, vmax, steps, lr_, b1, b2, o.weight_decay(), o.eps(),
                          o.amsgrad(), /*maximize=*/false, /*grad_scale=*/std::nullopt, inf);
      else
        at::_fused_adamw_(params, grads_of(params), m, v, vmax, steps, o.lr(), b1, b2, o.weight_decay(), o.eps(),
                          o.amsgrad(), /*maximize=*/false, /*grad_scale=*/std::nullopt, inf);
      if (inf) at::_foreach_sub_(steps, std::vector<torch::Tensor>(steps.size(), inf->reshape({})));
    }
  }
}

FusedSgd::FusedSgd(std::vector<torch::Tensor> params, const torch::optim::SGDOptions& o)
    : FusedOptimizer(std::move(params), std::make_unique<torch::optim::SGDOptions>(o)) {
  TORCH_CHECK(o.dampening() == 0 && !o.nesterov(), "keel's fused SGD has no dampening and no Nesterov momentum");
}

void FusedSgd::step_unless(const torch::Tensor& found_inf) {
  torch::NoGradGuard no_grad;
  for (auto& group : param_groups_) {
    const auto& o = static_cast<const torch::optim::SGDOptions&>(group.options());
    for (const auto& params : by_device(group)) {
      std::vector<torch::Tensor> buffers;
      if (o.momentum() != 0) {
        for (const auto& p : params) {
          auto& slot = state_[p.unsafeGetTensorImpl()];
          if (!slot) {
            // PyTorch starts a buffer as a copy of the first gradient (is_first_step); a zero
            // buffer stepped normally is the same without dampening (momentum * 0 + grad), and
            // stays right when that first step is skipped by found_inf.
            auto s = std::make_unique<ParamState>();
            s->momentum_buffer = torch::zeros_like(p, torch::MemoryFormat::Preserve);
            slot = std::move(s);
          }
          buffers.push_back(static_cast<ParamState&>(*slot).momentum_buffer);
        }
      }
      const auto inf = on_device(found_inf, params.front().device());
      if (lr_.defined())
        at::_fused_sgd_(params, grads_of(params), buffers, o.weight_decay(), o.momentum(), lr_, /*dampening=*/0.0,
                        /*nesterov=*/false, /*maximize=*/false, /*is_first_step=*/false, /*grad_scale=*/std::nullopt,
                        inf);
      else
        at::_fused_sgd_(params, grads_of(params), buffers, o.weight_decay(), o.momentum(), o.lr(), /*dampening=*/0.0,
                        /*nesterov=*/false, /*maximize=*/false, /*is_first_step=*/false, /*grad_scale=*/std::nullopt,
                        inf);
    }
  }
}

namespace {

using Schedule = std::function<double(int64_t, int64_t, const TrainConfig&)>;

// Linear warmup from 0 to lr over warmup_steps, then `after`.
double warmup_then(int64_t step, const TrainConfig& c, double after) {
  return step < c.warmup_steps ? c.lr * double(step + 1) / double(c.warmup_steps) : after;
}

Registry<Schedule>& schedules() {
  static Registry<Schedule> r("schedule", "train.schedule", [](Registry<Schedule>& t) {
    t.add_builtin("constant", [](int64_t step, int64_t, const TrainConfig& c) { return warmup_then(step, c, c.lr); });
    t.add_builtin("cosine", [](int64_t step, int64_t total, const TrainConfig& c) {
      const int64_t span = std::max<int64_t>(1, total - c.warmup_steps);
      const double progress = std::min(1.0, double(step - c.warmup_steps) / double(span));
      return warmup_then(step, c, c.min_lr + 0.5 * (c.lr - c.min_lr) * (1.0 + std::cos(M_PI * progress)));
    });
  });
  return r;
}

}  // namespace

void register_schedule(const std::string& name, ScheduleFn schedule) { schedules().add(name, std::move(schedule)); }

std::vector<std::string> registered_schedules() { return schedules().names(); }

LrSchedule::LrSchedule(const TrainConfig& cfg, int64_t total_steps)
    : cfg_(cfg), total_(total_steps), fn_(schedules().get(cfg.schedule)) {}

void set_lr(torch::optim::Optimizer& opt, double lr) {
  for (auto& g : opt.param_groups()) g.options().set_lr(lr);
}

namespace {

// The key under which torch::optim keeps a parameter's state: a string of the TensorImpl
// address in 1.13 (c10::guts::to_string), the address itself where the map is keyed by
// pointers. Chosen from the map's key type, so no version test is needed.
template <class Map>
typename Map::key_type state_key(const torch::Tensor& p) {
  using Key = typename Map::key_type;
  if constexpr (std::is_same_v<Key, std::string>) {
    std::ostringstream os;
    os << p.unsafeGetTensorImpl();
    return os.str();
  } else {
    return static_cast<Key>(p.unsafeGetTensorImpl());
  }
}

template <class Opt>
auto key_of(Opt& opt, const torch::Tensor& p) {
  return state_key<std::decay_t<decltype(opt.state())>>(p);
}

}  // namespace

namespace {

// A per-parameter state's fields through its own serialize(): the archive a torch::optim state
// writes, read back (a registered optimizer's state, whose type keel does not know).
// What is wrong with a registered optimizer's state field `field` of parameter `p` for a
// checkpoint, or "": a "param" field is a tensor of p's shape and dtype, a "scalar" one integer.
std::string state_field_problem(const std::string& field, const torch::Tensor& t, const torch::Tensor& p,
                                const std::string& kind) {
  if (!t.defined()) return "its state field '" + field + "' is undefined";
  if (kind == "scalar") {
    if (t.numel() == 1 && !c10::isFloatingType(t.scalar_type())) return "";
    return "its state field '" + field + "' is not one integer";
  }
  if (t.sizes() == p.sizes() && t.scalar_type() == p.scalar_type()) return "";
  return "its state field '" + field + "' is a " + std::string(c10::toString(t.scalar_type())) + " tensor of shape " +
         c10::str(t.sizes()) + " for a " + std::string(c10::toString(p.scalar_type())) + " parameter of shape " +
         c10::str(p.sizes());
}

// What `out` holds, as an archive to read (its tensors on `device`, else where they were).
void reopen(torch::serialize::OutputArchive& out, torch::serialize::InputArchive& in,
            std::optional<torch::Device> device = std::nullopt) {
  std::string bytes;
  out.save_to([&](const void* d, size_t n) {
    bytes.append(static_cast<const char*>(d), n);
    return n;
  });
  in.load_from(bytes.data(), bytes.size(), device);
}

std::vector<std::pair<std::string, c10::IValue>> archived_fields(const torch::optim::OptimizerParamState& s) {
  torch::serialize::OutputArchive out;
  s.serialize(out);
  torch::serialize::InputArchive in;
  reopen(out, in, torch::kCPU);  // host copies, as a checkpoint writes them: no second copy on a GPU
  std::vector<std::pair<std::string, c10::IValue>> fields;
  for (const auto& k : in.keys()) {
    c10::IValue v;
    in.read(k, v);
    if (k == "training" && v.isBool()) continue;  // the archive's module's own attribute
    fields.emplace_back(k, std::move(v));
  }
  return fields;
}

// The inverse: a new state of the registered type, read from `fields` by its own serialize().
std::unique_ptr<torch::optim::OptimizerParamState> archived_state(
    const OptimizerCodec& codec, const std::vector<std::pair<std::string, c10::IValue>>& fields) {
  torch::serialize::OutputArchive out;
  for (const auto& [k, v] : fields) out.write(k, v);
  torch::serialize::InputArchive in;
  reopen(out, in);
  auto s = codec.make_state();
  s->serialize(in);
  return s;
}

// A registered optimizer's codec, found by one step of it on probe parameters; empty for a
// built-in (no make_state), whose state keel knows by type.
OptimizerCodec probe_codec(const TrainConfig& cfg, const OptimizerFn& make, const OptimizerStateFn& make_state) {
  OptimizerCodec codec;
  codec.name = cfg.optimizer;
  if (!make_state) return codec;
  codec.make_state = make_state;
  const std::string who = "train.optimizer = \"" + cfg.optimizer + "\"";
  // One step on a vector and a matrix parameter: the fields their states hold (an optimizer may
  // keep other fields for matrices), each either shaped like its parameter or a step count.
  std::vector<torch::Tensor> probe = {torch::zeros({2}, torch::kFloat), torch::zeros({2, 3}, torch::kFloat)};
  for (auto& p : probe) {
    p.set_requires_grad(true);
    p.mutable_grad() = torch::full_like(p, 0.5f);
  }
  std::unique_ptr<torch::optim::Optimizer> opt;
  try {
    opt = make(probe, cfg);
    opt->step();
  } catch (const std::exception& e) {
    throw InputError(who + ": a step of it on a probe parameter failed (keel steps an optimizer without a closure): " +
                     std::string(e.what()).substr(0, 400));
  }
  for (const auto& p : probe) {
    const auto it = opt->state().find(key_of(*opt, p));
    if (it == opt->state().end()) continue;
    for (const auto& [field, v] : archived_fields(*it->second)) {
      const std::string problem = state_field_problem(field,
                                                      v.isInt()      ? torch::tensor(v.toInt(), torch::kLong)
                                                      : v.isTensor() ? v.toTensor()
                                                                     : torch::Tensor(),
                                                      p, v.isInt() ? "scalar" : "param");
      if (!problem.empty() || !(v.isInt() || v.isTensor()))
        throw InputError(who + ": " +
                         (problem.empty() ? "its state field '" + field + "' is a " + v.tagKind() : problem) +
                         "; keel checkpoints tensors shaped like their parameter and integer step counts");
      codec.fields[field] = v.isInt() ? "scalar" : "param";
    }
  }
  return codec;
}

}  // namespace

OptimizerChoice resolve_optimizer(const TrainConfig& cfg) {
  const auto entry = optimizers().get(cfg.optimizer);
  return OptimizerChoice(cfg, entry.make, probe_codec(cfg, entry.make, entry.make_state));
}

NamedTensorList optimizer_state(torch::optim::Optimizer& opt, const NamedTensorList& params) {
  NamedTensorList out;
  auto& st = opt.state();
  for (const auto& [name, p] : params) {
    auto it = st.find(key_of(opt, p));
    if (it == st.end()) continue;  // no step has touched this parameter yet
    if (auto* f = dynamic_cast<FusedAdamW::ParamState*>(it->second.get())) {
      out.emplace_back(name + ".step", f->step.to(torch::kCPU, torch::kLong));
      out.emplace_back(name + ".exp_avg", f->exp_avg);
      out.emplace_back(name + ".exp_avg_sq", f->exp_avg_sq);
      if (f->max_exp_avg_sq.defined()) out.emplace_back(name + ".max_exp_avg_sq", f->max_exp_avg_sq);
    } else if (auto* g = dynamic_cast<FusedSgd::ParamState*>(it->second.get())) {
      out.emplace_back(name + ".momentum_buffer", g->momentum_buffer);
    } else if (auto* a = dynamic_cast<torch::optim::AdamWParamState*>(it->second.get())) {
      out.emplace_back(name + ".step", torch::tensor(a->step(), torch::kLong));
      out.emplace_back(name + ".exp_avg", a->exp_avg());
      out.emplace_back(name + ".exp_avg_sq", a->exp_avg_sq());
      if (a->max_exp_avg_sq().defined()) out.emplace_back(name + ".max_exp_avg_sq", a->max_exp_avg_sq());
    } else if (auto* s = dynamic_cast<torch::optim::SGDParamState*>(it->second.get())) {
      if (s->momentum_buffer().defined()) out.emplace_back(name + ".momentum_buffer", s->momentum_buffer());
    } else {
      // A registered optimizer: whatever its state serializes (resolve_optimizer's probe checked the kinds).
      for (const auto& [field, v] : archived_fields(*it->second)) {
        if (v.isTensor())
          out.emplace_back(name + "." + field, v.toTensor());
        else if (v.isInt())
          out.emplace_back(name + "." + field, torch::tensor(v.toInt(), torch::kLong));
        else
          throw std::runtime_error("checkpoint: optimizer state field '" + field + "' of '" + name + "' is a " +
                                   v.tagKind() + " (keel checkpoints tensors and integer step counts)");
      }
    }
  }
  return out;
}

void load_optimizer_state(torch::optim::Optimizer& opt, const NamedTensorList& params, const NamedTensorList& state,
                          const OptimizerCodec& codec) {
  std::map<std::string, torch::Tensor> by_name(state.begin(), state.end());
  const bool fused = dynamic_cast<FusedOptimizer*>(&opt) != nullptr;
  const bool adamw = dynamic_cast<torch::optim::AdamW*>(&opt) != nullptr || dynamic_cast<FusedAdamW*>(&opt) != nullptr;
  std::string problems;
  size_t used = 0;
  auto& st = opt.state();
  st.clear();
  for (const auto& [name, p] : params) {
    auto get = [&](const std::string& field) -> torch::Tensor {
      auto it = by_name.find(name + "." + field);
      if (it == by_name.end()) return {};
      ++used;
      return it->second;
    };
    auto like_param = [&](const torch::Tensor& t, const std::string& field) -> torch::Tensor {
      if (!t.defined()) return t;
      if (t.sizes() != p.sizes() || t.scalar_type() != p.scalar_type()) {
        problems += "\n  " + name + "." + field + ": saved " + c10::toString(t.scalar_type()) + " " +
                    c10::str(t.sizes()) + ", parameter " + c10::toString(p.scalar_type()) + " " + c10::str(p.sizes());
        return {};
      }
      return t.to(p.device(), /*non_blocking=*/false, /*copy=*/true);
    };
    if (codec) {
      std::vector<std::pair<std::string, c10::IValue>> fields;
      for (const auto& [field, kind] : codec.fields) {
        const torch::Tensor t = get(field);
        if (!t.defined()) continue;
        if (kind == "scalar")
          fields.emplace_back(field, c10::IValue(t.item<int64_t>()));
        else if (const torch::Tensor x = like_param(t, field); x.defined())
          fields.emplace_back(field, c10::IValue(x));
      }
      if (fields.empty()) continue;  // never stepped (the loader checked each has what it was saved with)
      st[key_of(opt, p)] = archived_state(codec, fields);
      continue;
    }
    if (adamw) {
      auto step = get("step"), m = get("exp_avg"), v = get("exp_avg_sq"), vmax = get("max_exp_avg_sq");
      if (!step.defined() && !m.defined() && !v.defined()) continue;  // never stepped
      if (!step.defined() || !m.defined() || !v.defined()) {
        problems += "\n  " + name + ": partial AdamW state (step, exp_avg and exp_avg_sq are all needed)";
        continue;
      }
      if (fused) {
        auto s = std::make_unique<FusedAdamW::ParamState>();
        s->step = torch::full({}, static_cast<double>(step.item<int64_t>()), p.options().dtype(torch::kFloat));
        s->exp_avg = like_param(m, "exp_avg");
        s->exp_avg_sq = like_param(v, "exp_avg_sq");
        if (vmax.defined()) s->max_exp_avg_sq = like_param(vmax, "max_exp_avg_sq");
        st[key_of(opt, p)] = std::move(s);
        continue;
      }
      auto s = std::make_unique<torch::optim::AdamWParamState>();
      s->step(step.item<int64_t>());
      s->exp_avg(like_param(m, "exp_avg"));
      s->exp_avg_sq(like_param(v, "exp_avg_sq"));
      if (vmax.defined()) s->max_exp_avg_sq(like_param(vmax, "max_exp_avg_sq"));
      st[key_of(opt, p)] = std::move(s);
    } else {
      auto mb = get("momentum_buffer");
      if (!mb.defined()) continue;
      if (fused) {
        auto s = std::make_unique<FusedSgd::ParamState>();
        s->momentum_buffer = like_param(mb, "momentum_buffer");
        st[key_of(opt, p)] = std::move(s);
        continue;
      }
      auto s = std::make_unique<torch::optim::SGDParamState>();
      s->momentum_buffer(like_param(mb, "momentum_buffer"));
      st[key_of(opt, p)] = std::move(s);
    }
  }
  if (used != state.size()) {
    std::string extra;
    for (const auto& [n, t] : state) {
      bool known = false;
      for (const auto& [pn, p] : params)
        if (n.rfind(pn + ".", 0) == 0) known = true;
      if (!known) extra += (extra.empty() ? "" : ", ") + n;
    }
    problems += "\n  state for parameters the model does not have, or of another optimizer: " +
                (extra.empty() ? std::string("(fields of another optimizer type)") : extra);
  }
  if (!problems.empty())
    throw std::runtime_error("checkpoint: the optimizer state does not fit this optimizer:" + problems);
}

void zero_grads(const std::vector<torch::Tensor>& params) {
  for (const auto& p : params)
    if (p.grad().defined()) p.grad().zero_();
}

void free_grads(const std::vector<torch::Tensor>& params) {
  for (auto p : params) p.mutable_grad() = torch::Tensor();
}

std::map<std::string, std::string> optimizer_fields(torch::optim::Optimizer& opt, const OptimizerCodec& codec) {
  if (codec) return codec.fields;
  if (dynamic_cast<torch::optim::AdamW*>(&opt) || dynamic_cast<FusedAdamW*>(&opt)) {
    std::map<std::string, std::string> f = {{"step", "scalar"}, {"exp_avg", "param"}, {"exp_avg_sq", "param"}};
    if (static_cast<const torch::optim::AdamWOptions&>(opt.defaults()).amsgrad()) f["max_exp_avg_sq"] = "param";
    return f;
  }
  if (dynamic_cast<torch::optim::SGD*>(&opt) || dynamic_cast<FusedSgd*>(&opt)) return {{"momentum_buffer", "param"}};
  throw std::runtime_error("checkpoint: optimizer state of an unsupported optimizer type");
}

void OptimizerState::save(checkpoint::Component& mine) const {
  NamedTensorList state = optimizer_state(*opt_, params_);
  if (codec_) {
    // A registered optimizer's state must be what its probe promised, or no resume could use it.
    std::map<std::string, const torch::Tensor*> by_param;
    for (const auto& [n, p] : params_) by_param[n] = &p;
    for (const auto& [n, t] : state) {
      const size_t dot = n.find_last_of('.');
      const std::string field = n.substr(dot + 1);
      const auto kind = codec_.fields.find(field);
      const std::string problem =
          kind == codec_.fields.end()
              ? "its state field '" + field + "' of parameter '" + n.substr(0, dot) +
                    "' was not in its state at start (a step on a vector and a matrix parameter)"
              : state_field_problem(field, t, *by_param.at(n.substr(0, dot)), kind->second);
      if (!problem.empty())
        throw InputError("train.optimizer = \"" + codec_.name + "\": " + problem +
                         "; keel checkpoints tensors shaped like their parameter and integer step counts");
    }
  }
  const auto fields = optimizer_fields(*opt_, codec_);
  if (resharding_) state = resharding_.whole(state, fields);
  // Partitioned state, or whole state made from pieces or slices, is written by its owner alone.
  const bool partitioned = placement_.shards_optimizer_state();
  for (auto& [n, t] : state)
    mine.add(n, t, partitioned || resharding_ ? checkpoint::Placement::Owned : checkpoint::Placement::Replicated);
  // Which optimizer wrote the state: two with the same fields (adamw, a registered adam) would
  // otherwise read each other's moments as their own.
  if (!codec_.name.empty()) mine.values["optimizer_name"] = codec_.name;
  mine.values["zero"] = placement_.stage();
  mine.values["placement"] = placement_.describe();
  mine.values["partitioned"] = partitioned;
  mine.values["fields"] = fields;
  nlohmann::json params = nlohmann::json::array(), owners = nlohmann::json::object();
  if (!resharding_.parameters.empty())  // each stage's optimizer updates its own; the step records all
    for (const auto& n : resharding_.parameters) params.push_back(n);
  else if (!partitioned)
    for (const auto& [n, p] : params_) params.push_back(n);
  else
    for (size_t i = 0; i < placement_.num_params(); ++i)
      params.push_back(placement_.name(i)), owners[placement_.name(i)] = placement_.owner(i);
  mine.values["params"] = params;
  if (partitioned && resharding_.parameters.empty()) mine.values["owners"] = owners;
}

bool OptimizerState::wants(const std::string& name) const {
  return names_.count(name.substr(0, name.find_last_of('.'))) != 0;
}

int64_t OptimizerState::state_bytes() const {
  int64_t bytes = 0;
  for (const auto& [n, t] : optimizer_state(*opt_, params_)) bytes += static_cast<int64_t>(t.nbytes());
  return bytes;
}

namespace {

// What is wrong with the optimizer state tensor `name` ("<parameter>.<field>") of a step saved
// after `step` optimizer steps, or "": a step count (`step_count`) is one integer in [0, step];
// any other field has the shape and dtype of its parameter `param`.
std::string tensor_problem(const std::string& name, const torch::Tensor& t, bool step_count, const torch::Tensor& param,
                           int64_t step) {
  const std::string what =
      "optimizer state \"" + name + "\" (" + c10::toString(t.scalar_type()) + c10::str(t.sizes()) + ")";
  if (step_count) {
    if (t.numel() != 1 || !c10::isIntegralType(t.scalar_type(), /*includeBool=*/false))
      return what + " must be a single integer (a step count)";
    const int64_t v = t.reshape({}).item<int64_t>();
    if (v < 0 || v > step) return what + " = " + std::to_string(v) + " is outside [0, " + std::to_string(step) + "]";
  } else if (t.sizes() != param.sizes() || t.scalar_type() != param.scalar_type()) {
    const size_t dot = name.find_last_of('.');
    return what + " does not match its parameter " + name.substr(0, dot) + " (" + c10::toString(param.scalar_type()) +
           c10::str(param.sizes()) + ")";
  }
  return "";
}

// The form of the values (meta.json could say anything): "" or the problem, naming the key.
std::string values_problem(const nlohmann::json& o, int64_t world) {
  if (o.contains("optimizer_name") && !o["optimizer_name"].is_string()) return "values.optimizer_name is not a string";
  if (o.contains("zero")) {
    const auto& z = o["zero"];
    if (!z.is_number_integer() || z.get<int64_t>() < 0 || z.get<int64_t>() > 3)
      return "values.zero must be 0, 1, 2 or 3, got " + z.dump();
  }
  if (o.contains("placement") && !o["placement"].is_object()) return "values.placement is not an object";
  if (o.contains("fields")) {
    if (!o["fields"].is_object()) return "values.fields is not an object";
    for (auto it = o["fields"].begin(); it != o["fields"].end(); ++it)
      if (it.value() != "scalar" && it.value() != "param")
        return "values.fields[\"" + it.key() + "\"] must be \"scalar\" or \"param\", got " +
               it.value().dump().substr(0, 100);
  }
  if (o.contains("owners")) {
    if (!o["owners"].is_object()) return "values.owners is not an object";
    for (auto it = o["owners"].begin(); it != o["owners"].end(); ++it)
      if (!it.value().is_number_integer() || it.value().get<int64_t>() < 0 || it.value().get<int64_t>() >= world)
        return "values.owners[\"" + it.key() + "\"] must be a rank in [0, " + std::to_string(world) + "), got " +
               it.value().dump();
  }
  if (o.contains("params") && (!o["params"].is_array() || !std::all_of(o["params"].begin(), o["params"].end(),
                                                                       [](const auto& x) { return x.is_string(); })))
    return "values.params is not a list of names";
  if (o.contains("state") && !o["state"].is_object()) return "values.state is not an object";
  return "";
}

// Which fields of which parameter the step holds: every tensor of the index is a
// "<parameter>.<field>" of a recorded parameter and field, and a parameter has every field or
// none (never stepped). Format 1 recorded the same as "state" ({parameter: [fields]}): the index
// must list exactly it.
std::string index_problem(const nlohmann::json& o, const std::map<std::string, std::string>& index) {
  if (!o.contains("fields")) return "";
  std::map<std::string, std::set<std::string>> held;
  for (const auto& [n, f] : index) {
    const size_t dot = n.find_last_of('.');
    const std::string param = dot == std::string::npos ? n : n.substr(0, dot);
    if (dot == std::string::npos || !o["fields"].contains(n.substr(dot + 1)))
      return "optimizer state \"" + n + "\" (in " + f + ") is not <parameter>.<field> of a field of values.fields " +
             o["fields"].dump();
    held[param].insert(n.substr(dot + 1));
  }
  std::set<std::string> params;
  for (const auto& p : o.value("params", nlohmann::json::array())) params.insert(p.get<std::string>());
  if (o.contains("state")) {  // format 1: {parameter: [its fields]}, [] for one never stepped
    for (auto it = o["state"].begin(); it != o["state"].end(); ++it) {
      params.insert(it.key());
      if (!it.value().is_array()) return "values.state[\"" + it.key() + "\"] is not a list of fields";
      const auto h = held.find(it.key());
      const size_t n_held = h == held.end() ? 0 : h->second.size();
      std::string missing;
      for (const auto& f : it.value())
        if (!f.is_string() || h == held.end() || !h->second.count(f.get<std::string>()))
          missing += (missing.empty() ? "" : ", ") + it.key() + "." + (f.is_string() ? f.get<std::string>() : f.dump());
      if (!missing.empty()) return "the optimizer state of " + it.key() + " is missing (" + missing + ")";
      if (n_held != it.value().size())
        return "the index lists optimizer state of " + it.key() + " that meta.json does not record";
    }
  }
  for (const auto& [param, fields] : held) {
    if (!params.empty() && !params.count(param))
      return "optimizer state of \"" + param + "\", which is not a parameter the optimizer updates";
    if (fields.size() != o["fields"].size()) {
      std::string missing;
      for (auto it = o["fields"].begin(); it != o["fields"].end(); ++it)
        if (!fields.count(it.key())) missing += (missing.empty() ? "" : ", ") + param + "." + it.key();
      return "the optimizer state of " + param + " is missing (" + missing + "): it has some fields, not all";
    }
  }
  return "";
}

}  // namespace

std::string OptimizerState::check(const checkpoint::Loaded& loaded, const checkpoint::LoadedComponent& mine) const {
  // A step without the optimizer's part would resume with fresh moments: unusable, like a
  // missing file (every step keel wrote has one, if empty).
  if (!mine.present) return "the step has no optimizer state (no optimizer component)";
  const nlohmann::json& o = mine.values;
  if (std::string p = values_problem(o, loaded.saved_world_size); !p.empty()) return p;
  if (std::string p = index_problem(o, mine.index); !p.empty()) return p;
  // Every parameter it records is one of the step's model tensors.
  const auto model = loaded.component("model").tensors;
  std::map<std::string, torch::Tensor> in_step(model.begin(), model.end());
  std::vector<std::string> recorded;
  for (const auto& p : o.value("params", nlohmann::json::array())) recorded.push_back(p.get<std::string>());
  const nlohmann::json state = o.value("state", nlohmann::json::object());  // format 1
  for (auto it = state.begin(); it != state.end(); ++it) recorded.push_back(it.key());
  for (const auto& p : recorded)
    if (!in_step.count(p)) return "values name \"" + p + "\", which is not a model tensor of the step";
  // This rank's tensors, against the step's own parameters (or, where it has none, this run's:
  // a model that differs is load()'s InputError, never a fallback).
  std::map<std::string, torch::Tensor> params;
  for (const auto& [n, p] : params_) params[n] = p;
  for (const auto& [n, t] : in_step) params[n] = t;
  for (const auto& [n, t] : mine.tensors) {
    const size_t dot = n.find_last_of('.');
    const auto p = dot == std::string::npos ? params.end() : params.find(n.substr(0, dot));
    if (p == params.end()) continue;  // another model's or optimizer's: load() says so (exit 2)
    const std::string field = n.substr(dot + 1);
    const bool scalar = o.contains("fields") ? o["fields"].value(field, "param") == "scalar" : field == "step";
    if (resharding_ && !scalar && p->second.numel() != t.numel()) continue;  // this run's piece: load() compares
    const std::string problem = tensor_problem(n, t, scalar, p->second, loaded.step);
    if (!problem.empty()) return (mine.index.count(n) ? mine.index.at(n) + ": " : std::string()) + problem;
  }
  return "";
}

void OptimizerState::load(const checkpoint::Loaded& loaded, const checkpoint::LoadedComponent& mine) {
  // Another optimizer is told from the values, which every rank reads whole, so that every rank
  // refuses it alike (each reads only its own partition's tensors).
  const nlohmann::json& o = mine.values;
  if (o.contains("fields")) {
    const auto mine_fields = optimizer_fields(*opt_, codec_);
    const bool stepped = !mine.index.empty();
    std::string theirs;
    bool fits = true;
    for (auto it = o["fields"].begin(); it != o["fields"].end(); ++it) {
      theirs += (theirs.empty() ? "" : ", ") + it.key();
      const auto m = mine_fields.find(it.key());
      fits &= m != mine_fields.end() && m->second == it.value().get<std::string>();
    }
    if (stepped && !fits) {
      std::string ours;
      for (const auto& [f, k] : mine_fields) ours += (ours.empty() ? "" : ", ") + f;
      throw InputError(loaded.path + ": the optimizer state does not fit this run: it holds " + theirs +
                       " per parameter, this run's train.optimizer keeps " + ours +
                       " (train.optimizer differs from the run that saved it)");
    }
  }
  // Fields that fit may still be another optimizer's (adamw's moments read by an adam): the
  // values name the writer.
  const std::string saved = o.value("optimizer_name", std::string());
  if (!saved.empty() && !codec_.name.empty() && saved != codec_.name)
    throw InputError(loaded.path + ": its optimizer state was written by train.optimizer = \"" + saved +
                     "\", and this run's train.optimizer = \"" + codec_.name +
                     "\" would read it as its own; resume with train.optimizer = \"" + saved +
                     "\", or start another run (another checkpoint.dir)");
  try {
    load_optimizer_state(*opt_, params_, resharding_ ? resharding_.pieces(mine.tensors) : mine.tensors, codec_);
  } catch (const std::runtime_error& e) {
    throw InputError(loaded.path +
                     ": the optimizer state does not fit this run (train.optimizer or the model "
                     "differs from the run that saved it): " +
                     e.what());
  }
}

}  // namespace keel
