#include "keel/trainer/optim.h"

#include <cmath>
#include <map>
#include <sstream>
#include <type_traits>

#include "keel/common/error.h"

namespace keel {

std::unique_ptr<torch::optim::Optimizer> make_optimizer(const TrainConfig& cfg,
                                                        const std::vector<torch::Tensor>& params) {
  if (cfg.optimizer == OptimizerKind::Sgd) {
    auto o = torch::optim::SGDOptions(cfg.lr).momentum(cfg.momentum).weight_decay(cfg.weight_decay);
    return std::make_unique<torch::optim::SGD>(params, o);
  }
  auto o = torch::optim::AdamWOptions(cfg.lr)
               .betas({cfg.beta1, cfg.beta2})
               .eps(cfg.eps)
               .weight_decay(cfg.weight_decay);
  return std::make_unique<torch::optim::AdamW>(params, o);
}

LrSchedule::LrSchedule(const TrainConfig& cfg, int64_t total_steps)
    : lr_(cfg.lr), min_lr_(cfg.min_lr), warmup_(cfg.warmup_steps), total_(total_steps),
      cosine_(cfg.schedule == ScheduleKind::Cosine) {}

double LrSchedule::at(int64_t step) const {
  if (step < warmup_) return lr_ * double(step + 1) / double(warmup_);
  if (!cosine_) return lr_;
  const int64_t span = std::max<int64_t>(1, total_ - warmup_);
  const double progress = std::min(1.0, double(step - warmup_) / double(span));
  return min_lr_ + 0.5 * (lr_ - min_lr_) * (1.0 + std::cos(M_PI * progress));
}

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

NamedTensorList optimizer_state(torch::optim::Optimizer& opt, const NamedTensorList& params) {
  NamedTensorList out;
  auto& st = opt.state();
  for (const auto& [name, p] : params) {
    auto it = st.find(key_of(opt, p));
    if (it == st.end()) continue;  // no step has touched this parameter yet
    if (auto* a = dynamic_cast<torch::optim::AdamWParamState*>(it->second.get())) {
      out.emplace_back(name + ".step", torch::tensor(a->step(), torch::kLong));
      out.emplace_back(name + ".exp_avg", a->exp_avg());
      out.emplace_back(name + ".exp_avg_sq", a->exp_avg_sq());
      if (a->max_exp_avg_sq().defined()) out.emplace_back(name + ".max_exp_avg_sq", a->max_exp_avg_sq());
    } else if (auto* s = dynamic_cast<torch::optim::SGDParamState*>(it->second.get())) {
      if (s->momentum_buffer().defined()) out.emplace_back(name + ".momentum_buffer", s->momentum_buffer());
    } else {
      throw std::runtime_error("checkpoint: optimizer state of an unsupported optimizer type");
    }
  }
  return out;
}

void load_optimizer_state(torch::optim::Optimizer& opt, const NamedTensorList& params, const NamedTensorList& state) {
  std::map<std::string, torch::Tensor> by_name(state.begin(), state.end());
  const bool adamw = dynamic_cast<torch::optim::AdamW*>(&opt) != nullptr;
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
    if (adamw) {
      auto step = get("step"), m = get("exp_avg"), v = get("exp_avg_sq"), vmax = get("max_exp_avg_sq");
      if (!step.defined() && !m.defined() && !v.defined()) continue;  // never stepped
      if (!step.defined() || !m.defined() || !v.defined()) {
        problems += "\n  " + name + ": partial AdamW state (step, exp_avg and exp_avg_sq are all needed)";
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
  if (!problems.empty()) throw std::runtime_error("checkpoint: the optimizer state does not fit this optimizer:" + problems);
}

void zero_grads(const std::vector<torch::Tensor>& params) {
  for (const auto& p : params)
    if (p.grad().defined()) p.grad().zero_();
}

std::map<std::string, std::string> optimizer_fields(torch::optim::Optimizer& opt) {
  if (auto* a = dynamic_cast<torch::optim::AdamW*>(&opt)) {
    std::map<std::string, std::string> f = {{"step", "scalar"}, {"exp_avg", "param"}, {"exp_avg_sq", "param"}};
    if (static_cast<const torch::optim::AdamWOptions&>(a->defaults()).amsgrad()) f["max_exp_avg_sq"] = "param";
    return f;
  }
  if (dynamic_cast<torch::optim::SGD*>(&opt)) return {{"momentum_buffer", "param"}};
  throw std::runtime_error("checkpoint: optimizer state of an unsupported optimizer type");
}

void OptimizerState::save(checkpoint::State& state) const {
  state.optimizer = optimizer_state(*opt_, params_);
  state.optimizer_owners = owners_;
  state.zero = zero_;
  state.optimizer_fields = optimizer_fields(*opt_);
  state.optimizer_params.clear();
  if (owners_.empty())
    for (const auto& [n, p] : params_) state.optimizer_params.push_back(n);
  else
    for (const auto& [n, r] : owners_) state.optimizer_params.push_back(n);
}

bool OptimizerState::wants(const std::string& name) const {
  return names_.count(name.substr(0, name.find_last_of('.'))) != 0;
}

int64_t OptimizerState::state_bytes() const {
  int64_t bytes = 0;
  for (const auto& [n, t] : optimizer_state(*opt_, params_)) bytes += static_cast<int64_t>(t.nbytes());
  return bytes;
}

std::string OptimizerState::check(const checkpoint::Loaded& loaded) const {
  if (loaded.meta.value("optimizer", nlohmann::json::object()).contains("fields")) return "";
  std::map<std::string, const torch::Tensor*> params;
  for (const auto& [n, p] : params_) params[n] = &p;
  for (const auto& [n, t] : loaded.state.optimizer) {
    const size_t dot = n.find_last_of('.');
    const auto p = dot == std::string::npos ? params.end() : params.find(n.substr(0, dot));
    if (p == params.end()) continue;  // another model's or optimizer's: load() says so (exit 2)
    const std::string problem =
        checkpoint::optimizer_tensor_problem(n, t, n.substr(dot + 1) == "step", *p->second, loaded.step);
    if (!problem.empty()) return problem;
  }
  return "";
}

void OptimizerState::load(const checkpoint::Loaded& loaded) {
  // Another optimizer is told from meta.json, which every rank reads whole, so that every rank
  // refuses it alike (each reads only its own partition's tensors).
  const auto& o = loaded.meta.value("optimizer", nlohmann::json::object());
  if (o.contains("fields") && o.contains("state")) {
    const auto mine = optimizer_fields(*opt_);
    bool stepped = false;
    for (const auto& f : o["state"]) stepped |= !f.empty();
    std::string theirs;
    bool fits = true;
    for (auto it = o["fields"].begin(); it != o["fields"].end(); ++it) {
      theirs += (theirs.empty() ? "" : ", ") + it.key();
      const auto m = mine.find(it.key());
      fits &= m != mine.end() && m->second == it.value().get<std::string>();
    }
    if (stepped && !fits) {
      std::string ours;
      for (const auto& [f, k] : mine) ours += (ours.empty() ? "" : ", ") + f;
      throw InputError(loaded.path + ": the optimizer state does not fit this run: it holds " + theirs +
                       " per parameter, this run's train.optimizer keeps " + ours +
                       " (train.optimizer differs from the run that saved it)");
    }
  }
  try {
    load_optimizer_state(*opt_, params_, loaded.state.optimizer);
  } catch (const std::runtime_error& e) {
    throw InputError(loaded.path + ": the optimizer state does not fit this run (train.optimizer or the model "
                     "differs from the run that saved it): " + e.what());
  }
}

}  // namespace keel
