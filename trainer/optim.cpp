#include "trainer/optim.h"

#include <cmath>

namespace keel {

std::unique_ptr<torch::optim::Optimizer> make_optimizer(const TrainConfig& cfg,
                                                        const std::vector<torch::Tensor>& params) {
  if (cfg.optimizer == "sgd") {
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
      cosine_(cfg.schedule == "cosine") {}

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

}  // namespace keel
