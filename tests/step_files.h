// tests/step_files.h: two runs' checkpoint steps compared tensor by tensor (DIR/ckpt/step_<N>/,
// the layout of the tests' runs), and a run's directory copied for a resume.
#pragma once

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "checkpoint/io.h"
#include "checkpoint/safetensors.h"
#include "helpers.h"

namespace keel::testing {

// Every tensor of the `kind` files (model | optimizer) of step `step`, by name.
inline std::map<std::string, torch::Tensor> step_tensors(const std::string& dir, int step, const std::string& kind) {
  std::map<std::string, torch::Tensor> out;
  const std::string step_dir = dir + "/ckpt/step_" + std::to_string(step);
  for (const auto& f : keel::checkpoint::list_dir(step_dir))
    if (f.rfind(kind + "-", 0) == 0)
      for (auto& [n, t] : keel::checkpoint::read_safetensors(step_dir + "/" + f).tensors) out[n] = t;
  return out;
}

// The largest absolute difference between two runs' tensors of `kind` at `step` (0: bit-identical
// bytes; -1 when the sets of names, shapes or dtypes differ).
inline double max_diff(const std::string& a, const std::string& b, int step, const std::string& kind) {
  auto A = step_tensors(a, step, kind), B = step_tensors(b, step, kind);
  if (A.size() != B.size() || A.empty()) return -1;
  double worst = 0;
  for (const auto& [n, t] : A) {
    auto it = B.find(n);
    if (it == B.end() || it->second.sizes() != t.sizes() || it->second.scalar_type() != t.scalar_type()) return -1;
    if (torch::equal(t, it->second)) continue;
    worst = std::max(worst, (t.to(torch::kDouble) - it->second.to(torch::kDouble)).abs().max().item<double>());
    if (worst == 0) worst = 1e-300;  // equal values, different bits (-0.0, NaN payloads): not identical
  }
  return worst;
}

// ||a - b|| / ||a|| over every tensor of the `kind` files of `step` (-1 when the sets differ), and
// the root mean square of a's elements.
struct Distance {
  double relative = -1, rms = 0, norm = 0;
};
inline Distance distance(const std::string& a, const std::string& b, int step, const std::string& kind) {
  const auto A = step_tensors(a, step, kind), B = step_tensors(b, step, kind);
  if (A.size() != B.size() || A.empty()) return {};
  double diff = 0, norm = 0;
  int64_t n = 0;
  for (const auto& [name, t] : A) {
    const auto it = B.find(name);
    if (it == B.end() || it->second.sizes() != t.sizes()) return {};
    const auto x = t.to(torch::kDouble), y = it->second.to(torch::kDouble);
    diff += (x - y).pow(2).sum().item<double>();
    norm += x.pow(2).sum().item<double>();
    n += t.numel();
  }
  return {std::sqrt(diff / std::max(norm, 1e-300)), std::sqrt(norm / static_cast<double>(n)), std::sqrt(norm)};
}

// keel train on synthetic data for `steps` steps at a constant learning rate, its run in
// DIR/run and a checkpoint every 5 steps in DIR/ckpt (the layout the functions above read), then
// `extra` (the model, the batch, the mesh).
inline std::vector<std::string> checkpointed_run_args(const std::string& dir, int steps,
                                                      const std::vector<std::string>& extra) {
  std::vector<std::string> a = {"train",
                                "--data.name=synthetic",
                                "--train.steps=" + std::to_string(steps),
                                "--train.schedule=constant",
                                "--train.warmup_steps=0",
                                "--train.eval_interval=20",
                                "--run.threads=1",
                                "--run.dir=" + dir + "/run",
                                "--checkpoint.dir=" + dir + "/ckpt",
                                "--checkpoint.interval=5",
                                "--dist.timeout_s=60"};
  a.insert(a.end(), extra.begin(), extra.end());
  return a;
}

// Run `b`'s step `step` against `a`'s (one rank's): the same tensors (names, dtypes, shapes), and
// the model and optimizer state within AdamW's bounds for `roundings` reordered float32 sums per
// gradient element over `step` steps at learning rate `lr` (helpers.h).
inline void expect_step_within_reorder_bound(const std::string& a, const std::string& b, int step,
                                             const std::string& label, int roundings, double lr) {
  ASSERT_GE(max_diff(a, b, step, "model"), 0.0) << label << ": the step's model tensors differ from one rank's";
  ASSERT_GE(max_diff(a, b, step, "optimizer"), 0.0) << label << ": the optimizer tensors differ from one rank's";
  const Distance model = distance(a, b, step, "model"), state = distance(a, b, step, "optimizer");
  const double bound = adamw_reorder_bound(step, lr, roundings, model.rms);
  std::printf("%s: model relative L2 %g (bound %g), optimizer state %g (bound %g)\n", label.c_str(), model.relative,
              bound, state.relative, optimizer_state_reorder_bound(roundings, bound));
  EXPECT_LE(model.relative, bound) << label;
  EXPECT_LE(max_diff(a, b, step, "model"), adamw_element_bound(step, lr)) << label;
  EXPECT_LE(state.relative, optimizer_state_reorder_bound(roundings, bound)) << label;
}

inline void copy_tree(const std::string& from, const std::string& to) {
  auto r = run_process({"/bin/cp", "-r", from, to});
  ASSERT_EQ(r.exit_code, 0) << r.output;
}

}  // namespace keel::testing
