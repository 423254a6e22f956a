#include "dist/stages.h"

#include <algorithm>
#include <limits>
#include <set>
#include <stdexcept>
#include <string>

#include "dist/stage_checkpoint.h"
#include "keel/common/error.h"

namespace keel::dist {

using models::BlockStructure;

StageModel::StageModel(std::shared_ptr<models::Model> whole, std::vector<BlockStructure::Stage> ranges,
                       std::vector<int> mine)
    : whole_(std::move(whole)), ranges_(std::move(ranges)), mine_(std::move(mine)) {
  const std::vector<std::string> prefixes = whole_->block_prefixes();
  auto block_of = [&](const std::string& name) -> int64_t {
    for (size_t i = 0; i < prefixes.size(); ++i)
      if (name.compare(0, prefixes[i].size(), prefixes[i]) == 0) return static_cast<int64_t>(i);
    return -1;
  };
  const bool root = holds_first() || holds_last();
  for (const auto& [name, t] : whole_->named_parameters()) {
    built_[name] = t.sizes().vec();
    const int64_t b = block_of(name);
    if (b < 0) {
      root_.emplace_back(name, t);
      if (root) held_.emplace_back(name, t);
      continue;
    }
    for (int s : mine_)
      if (ranges_[static_cast<size_t>(s)].first <= static_cast<size_t>(b) &&
          static_cast<size_t>(b) < ranges_[static_cast<size_t>(s)].end)
        held_.emplace_back(name, t);
  }
  if (!root) root_.clear();
}

bool StageModel::holds_first() const { return std::find(mine_.begin(), mine_.end(), 0) != mine_.end(); }
bool StageModel::holds_last() const { return std::find(mine_.begin(), mine_.end(), stages() - 1) != mine_.end(); }

torch::Tensor StageModel::forward_stage(int s, const torch::Tensor& x) {
  BlockStructure* b = whole_->block_structure();
  const BlockStructure::Stage whole_model;
  b->stage = ranges_.at(static_cast<size_t>(s));
  try {
    torch::Tensor y = whole_->forward(x);
    b->stage = whole_model;
    return y;
  } catch (...) {
    b->stage = whole_model;
    throw;
  }
}

torch::Tensor StageModel::forward(const torch::Tensor&) {
  throw std::logic_error("StageModel::forward: a pipeline stage runs forward_stage(s, x), one stage at a time");
}

models::NamedTensors StageModel::named_parameters() const { return held_; }

void StageModel::release_others() {
  torch::NoGradGuard ng;
  std::set<std::string> mine;
  for (const auto& [name, t] : held_) mine.insert(name);
  for (const auto& [name, t] : whole_->named_parameters()) {
    if (mine.count(name) || released_.count(name)) continue;
    released_[name] = t.sizes().vec();
    t.set_data(torch::empty({0}, t.options()));
    t.mutable_grad() = torch::Tensor();
  }
}

void StageModel::remake_others() {
  torch::NoGradGuard ng;
  for (const auto& [name, t] : whole_->named_parameters())
    if (const auto it = released_.find(name); it != released_.end()) t.set_data(torch::empty(it->second, t.options()));
  released_.clear();
}

models::NamedTensors StageModel::whole_parameter_shapes() const {
  models::NamedTensors out;
  for (const auto& [name, t] : whole_->named_parameters())
    out.emplace_back(name, torch::empty(built_.at(name), t.options().device(torch::kMeta)));
  return out;
}

std::string StageModel::describe() const {
  std::string out;
  for (size_t s = 0; s < ranges_.size(); ++s) {
    const auto& r = ranges_[s];
    out += (s ? " | " : "") + std::string("blocks ") + std::to_string(r.first) + "-" + std::to_string(r.end - 1);
  }
  return out;
}

// The contiguous split of the blocks into `stages` that minimises the largest stage's parameters
// (a linear partition; ties go to the earliest boundary), the root counted half on either end.
static std::vector<size_t> even_split(const std::vector<int64_t>& block_params, int64_t root_params, int stages) {
  const size_t n = block_params.size(), S = static_cast<size_t>(stages);
  std::vector<int64_t> prefix(n + 1, 0);
  for (size_t i = 0; i < n; ++i) prefix[i + 1] = prefix[i] + 2 * block_params[i];  // doubled: the root's halves
  auto load = [&](size_t k, size_t i, size_t j) {                                  // stage k over blocks [i, j)
    return prefix[j] - prefix[i] + (k == 0 ? root_params : 0) + (k + 1 == S ? root_params : 0);
  };
  constexpr int64_t kInf = std::numeric_limits<int64_t>::max();
  // best[k][j]: the smallest largest load of blocks [0, j) in stages 0..k; from[k][j]: where stage k starts.
  std::vector<std::vector<int64_t>> best(S, std::vector<int64_t>(n + 1, kInf));
  std::vector<std::vector<size_t>> from(S, std::vector<size_t>(n + 1, 0));
  for (size_t j = 1; j <= n; ++j) best[0][j] = load(0, 0, j);
  for (size_t k = 1; k < S; ++k)
    for (size_t j = k + 1; j <= n; ++j)
      for (size_t i = k; i < j; ++i) {
        if (best[k - 1][i] == kInf) continue;
        const int64_t v = std::max(best[k - 1][i], load(k, i, j));
        if (v < best[k][j]) best[k][j] = v, from[k][j] = i;
      }
  std::vector<size_t> starts(S, 0);
  size_t j = n;
  for (size_t k = S - 1; k > 0; --k) j = starts[k] = from[k][j];
  return starts;
}

std::vector<BlockStructure::Stage> split_blocks(const std::vector<int64_t>& block_params, int64_t root_params,
                                                int stages, const std::vector<int64_t>& points) {
  const auto n = static_cast<int64_t>(block_params.size());
  if (n < stages)
    throw InputError("parallel.pp = " + std::to_string(stages) +
                     " stages (parallel.pp x the virtual stages per rank) for a model of " + std::to_string(n) +
                     " blocks: each stage needs at least one block");
  std::vector<size_t> starts;
  if (points.empty()) {
    starts = even_split(block_params, root_params, stages);
  } else {
    if (points.back() >= n)
      throw InputError("parallel.pp_split: block " + std::to_string(points.back()) + " is past the model's last (" +
                       std::to_string(n - 1) + ")");
    starts.push_back(0);
    for (int64_t p : points) starts.push_back(static_cast<size_t>(p));
  }
  std::vector<BlockStructure::Stage> ranges(static_cast<size_t>(stages));
  for (size_t s = 0; s < ranges.size(); ++s) {
    ranges[s].first = starts[s];
    ranges[s].end = s + 1 < ranges.size() ? starts[s + 1] : static_cast<size_t>(n);
    ranges[s].embed = s == 0;
    ranges[s].head = s + 1 == ranges.size();
  }
  return ranges;
}

std::shared_ptr<models::Model> split_into_stages(std::shared_ptr<models::Model> model, const Mesh& mesh,
                                                 const TransformOptions::Pipeline& pipeline, TransformPlan& plan) {
  if (mesh.pp() == 1) {
    plan.applied(Transform::Stages, "whole model (pp 1)");
    return model;
  }
  if (!model->block_structure())
    throw InputError("parallel.pp = " + std::to_string(mesh.pp()) + " splits a model's blocks into stages; model " +
                     model->name() + " declares none (BlockStructure)");
  const std::vector<std::string> prefixes = model->block_prefixes();
  std::vector<int64_t> block_params(prefixes.size(), 0);
  int64_t root = 0;
  for (const auto& [name, t] : model->named_parameters()) {
    bool in_block = false;
    for (size_t i = 0; i < prefixes.size() && !in_block; ++i)
      if (name.compare(0, prefixes[i].size(), prefixes[i]) == 0) block_params[i] += t.numel(), in_block = true;
    if (!in_block) root += t.numel();
  }
  const int stages = static_cast<int>(pipeline.stage_rank.size());
  if (stages < mesh.pp())
    throw std::logic_error("split_into_stages: pp = " + std::to_string(mesh.pp()) + " with " + std::to_string(stages) +
                           " stages (TransformOptions::pipeline holds the schedule's stage_rank)");
  auto ranges = split_blocks(block_params, root, stages, pipeline.split_points);
  std::vector<int> mine;
  for (int s = 0; s < stages; ++s)
    if (pipeline.stage_rank[static_cast<size_t>(s)] == mesh.coordinate(Axis::Pp)) mine.push_back(s);
  auto stage = std::make_shared<StageModel>(std::move(model), std::move(ranges), std::move(mine));
  // A checkpoint holds the whole model's parameters, each written by one stage's rank.
  plan.set_sharded_parameters(std::make_shared<StageParameters>(stage, mesh));
  std::string mine_text;
  for (int s : stage->mine()) mine_text += (mine_text.empty() ? "" : ", ") + std::to_string(s);
  plan.applied(Transform::Stages, std::to_string(stages) + " stages over pp " + std::to_string(mesh.pp()) + " (" +
                                      stage->describe() + "); this rank runs stage " + mine_text);
  return stage;
}

}  // namespace keel::dist
