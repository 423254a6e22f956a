// trainer/progress.h: the loop's counters and their part of a checkpoint.
#pragma once

#include <cmath>
#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

#include "checkpoint/stateful.h"

namespace keel {

// The loop's counters in a checkpoint (component "progress": step, skipped_steps, loss,
// total_steps, global_batch).
struct Progress : checkpoint::Stateful {
  int64_t steps_done = 0;
  int64_t skipped_steps = 0;
  double last_loss = std::nan("");
  int64_t total_steps = 0, global_batch = 0;

  void save(checkpoint::Component& mine) const override {
    mine.values["step"] = steps_done;
    mine.values["skipped_steps"] = skipped_steps;
    mine.values["loss"] = std::isfinite(last_loss) ? nlohmann::json(last_loss) : nlohmann::json(nullptr);
    mine.values["total_steps"] = total_steps;
    mine.values["global_batch"] = global_batch;
  }
  std::string check(const checkpoint::Loaded& l, const checkpoint::LoadedComponent& mine) const override {
    const auto& sh = mine.values;
    if (sh.contains("step") && sh["step"] != l.step)
      return "values.step = " + sh["step"].dump() + " but the step is " + std::to_string(l.step);
    const auto skipped = sh.value("skipped_steps", nlohmann::json(0));
    if (!skipped.is_number_integer() || skipped.get<int64_t>() < 0 || skipped.get<int64_t>() > l.step)
      return "values.skipped_steps = " + skipped.dump() + " is not an integer in [0, step]";
    if (sh.contains("loss") && !sh["loss"].is_null() && !sh["loss"].is_number())
      return "values.loss = " + sh["loss"].dump() + " is not a number";
    return "";
  }
  void load(const checkpoint::Loaded& l, const checkpoint::LoadedComponent& mine) override {
    steps_done = l.step;
    skipped_steps = mine.values.value("skipped_steps", int64_t{0});
    if (mine.values.contains("loss") && mine.values["loss"].is_number()) last_loss = mine.values["loss"].get<double>();
  }
};

}  // namespace keel
