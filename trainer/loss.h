// trainer/loss.h: the registry of losses (train.loss): cross_entropy built in, users' by
// register_loss (keel/trainer/trainer.h).
#pragma once

#include "common/registry.h"
#include "keel/trainer/trainer.h"

namespace keel {

/// The registry train.loss names from.
Registry<LossFn>& losses();

}  // namespace keel
