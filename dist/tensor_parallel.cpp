#include "dist/tensor_parallel.h"

#include <algorithm>
#include <map>
#include <stdexcept>
#include <string>

#include "dist/stage_checkpoint.h"
#include "dist/stages.h"
#include "dist/tp_checkpoint.h"
#include "dist/tp_ops.h"
#include "dist/zero.h"
#include "keel/common/error.h"

namespace keel::dist {

void shard_tensor_parallel(models::Model& model, const Mesh& mesh, bool sequence_parallel, TransformPlan& plan,
                           models::DeferredInit* deferred) {
  if (mesh.tp() == 1) {
    plan.applied(Transform::TensorParallel, "none (tp 1)");
    return;
  }
  // A pipeline stage's model is the whole one's (dist/stages.h): the family shards the whole
  // model (every stage's blocks alike), and what follows is of the parameters this rank's stages
  // hold, in their order.
  auto* stages = dynamic_cast<StageModel*>(&model);
  models::Model& whole = stages ? stages->whole() : model;
  TensorParallelShard shard = shard_model_tensor_parallel(whole, mesh.on(Axis::Tp), sequence_parallel, deferred);
  if (stages) {
    std::map<std::string, std::optional<models::TpRule>> by_name;
    const models::NamedTensors all = whole.named_parameters();
    for (size_t i = 0; i < all.size(); ++i) by_name.emplace(all[i].first, shard.rules[i]);
    shard.rules.clear();
    for (const auto& [name, t] : model.named_parameters()) shard.rules.push_back(by_name.at(name));
  }
  Collectives& tp = mesh.on(Axis::Tp);
  const std::vector<bool> partial = shard.partial();
  const auto summed = std::count(partial.begin(), partial.end(), true);
  plan.set_split_gradients({&tp, shard.replicated(), partial});
  auto slices = std::make_shared<TensorParallelParameters>(model.named_parameters(), shard.rules, mesh);
  if (auto* held = dynamic_cast<StageParameters*>(plan.sharded_parameters()))
    held->over_tensor_parallel(std::move(slices));  // a stage's parameters, each of them tp slices
  else
    plan.set_sharded_parameters(std::move(slices));
  const tp::VocabRange& range = shard.range;
  plan.applied(Transform::TensorParallel,
               "tp " + std::to_string(mesh.tp()) + ", rank " + std::to_string(mesh.coordinate(Axis::Tp)) +
                   "'s heads, MLP and vocabulary " + std::to_string(range.first) + "-" +
                   std::to_string(range.first + range.n - 1) +
                   (sequence_parallel ? ", sequence parallel (" + std::to_string(summed) +
                                            " replicated parameters' gradients summed over tp)"
                                      : std::string()));
}

namespace {

// Keeps rank `rank`'s part (of `size`) of each of `block`'s parameters that a rule of `plan` matches.
void keep_block_parts(models::TransformerBlockImpl& block, const std::vector<models::TpRule>& plan, int64_t rank,
                      int64_t size, models::DeferredInit* deferred) {
  const models::BlockOptions& o = block.o;
  for (const auto& [what, n] : {std::pair{"model.heads", o.heads}, std::pair{"model.kv_heads", o.kv_heads},
                                std::pair{"the MLP's width", o.ffn}})
    if (n % size != 0)
      throw InputError("tensor parallelism: " + std::string(what) + " = " + std::to_string(n) +
                       " does not divide by tp = " + std::to_string(size) +
                       (std::string(what) == "model.kv_heads"
                            ? " (each tp rank holds whole key/value heads; replicating fewer than tp is not done)"
                            : ""));
  for (auto& p : block.named_parameters())
    if (const models::TpRule* rule = models::tp_rule(plan, p.key()))
      models::keep_tp_slice(p.value(), *rule, rank, size, deferred);
}

// The family of `model` with a tensor-parallel plan whose vocabulary divides by `size`; throws
// InputError naming the key otherwise.
const models::TransformerFamily& shardable_family(const models::Model& model, int64_t size) {
  const models::TransformerFamily* family = models::transformer_family(model.name());
  if (!family || !family->shard)
    throw InputError("tensor parallelism: model.name = \"" + model.name() +
                     "\" has no tensor-parallel plan (gpt, gpt2 and llama have one)");
  const int64_t vocab = model.input_spec().num_classes;
  if (vocab % size != 0)
    throw InputError("tensor parallelism: model.vocab = " + std::to_string(vocab) +
                     " does not divide by tp = " + std::to_string(size));
  return *family;
}

}  // namespace

TensorParallelShard shard_model_tensor_parallel(models::Model& model, Collectives& tp, bool sequence_parallel,
                                                models::DeferredInit* deferred) {
  const int64_t size = tp.size(), vocab = model.input_spec().num_classes;
  const models::TransformerFamily* family = &shardable_family(model, size);
  const tp::VocabRange range = tp::VocabRange::of(vocab, size, tp.rank());
  models::TensorParallelParts parts;
  parts.rank = tp.rank();
  parts.size = size;
  parts.deferred = deferred;
  parts.block = [&](models::TransformerBlockImpl& b) {
    shard_block(b, family->tp_plan, tp, sequence_parallel, deferred);
  };
  parts.vocab.first = range.first;
  parts.vocab.n = range.n;
  if (sequence_parallel) {
    parts.vocab.sequence_parts = size;
    parts.vocab.sequence_index = tp.rank();
  }
  parts.vocab.embed = [&tp, range, sequence_parallel](const torch::Tensor& ids, const torch::Tensor& rows,
                                                      int64_t padding_idx) {
    return tp::vocab_parallel_embedding(ids, rows, range, tp, sequence_parallel, padding_idx);
  };
  if (sequence_parallel) {
    parts.vocab.enter_head = [&tp](const torch::Tensor& x) { return tp::gather_sequence(x, 1, tp); };
  } else {
    parts.vocab.enter_head = [&tp](const torch::Tensor& x) { return tp::copy_to_region(x, tp); };
  }
  family->shard(model, parts);
  TensorParallelShard shard{range, {}, sequence_parallel};
  for (const auto& [name, p] : model.named_parameters()) {
    const models::TpRule* rule = models::tp_rule(family->tp_plan, name);
    // A Replicate rule splits nothing (tp_slice returns the whole): recorded as no split.
    const bool splits = rule && rule->split != models::TpSplit::Replicate;
    shard.rules.push_back(splits ? std::optional<models::TpRule>(*rule) : std::nullopt);
  }
  return shard;
}

std::vector<bool> TensorParallelShard::replicated() const {
  std::vector<bool> out;
  for (const auto& rule : rules) out.push_back(!rule);
  return out;
}

std::vector<bool> TensorParallelShard::partial() const {
  // With sequence parallelism every parameter the plan does not split gets a partial gradient.
  return sequence_parallel ? replicated() : std::vector<bool>(rules.size(), false);
}

torch::Tensor clip_grad_norm_tensor_parallel(const std::vector<torch::Tensor>& held,
                                             const std::vector<bool>& replicated, Collectives& tp, double max_norm,
                                             Collectives* dp) {
  std::vector<torch::Tensor> grads, counted;
  for (size_t i = 0; i < held.size(); ++i) {
    const torch::Tensor& g = held[i].grad();
    if (!g.defined()) continue;
    grads.push_back(g.detach());
    if (!replicated[i] || tp.rank() == 0) counted.push_back(g.detach());
  }
  std::vector<Collectives*> groups;
  if (dp) groups.push_back(dp);
  groups.push_back(&tp);
  return clip_by_summed_squares(counted, grads, groups, max_norm, "tp: gradient norm");
}

void shard_block(models::TransformerBlockImpl& block, const std::vector<models::TpRule>& plan, Collectives& tp,
                 bool sequence_parallel, models::DeferredInit* deferred) {
  const int64_t size = tp.size(), rank = tp.rank();
  keep_block_parts(block, plan, rank, size, deferred);
  models::TpRegion region;
  region.rank = rank;
  region.size = size;
  region.own_positions = sequence_parallel;
  if (sequence_parallel) {
    region.enter = [&tp](const torch::Tensor& x) { return tp::gather_sequence(x, 1, tp); };
    region.leave = [&tp](const torch::Tensor& x) { return tp::scatter_sequence(x, 1, tp); };
  } else {
    region.enter = [&tp](const torch::Tensor& x) { return tp::copy_to_region(x, tp); };
    region.leave = [&tp](const torch::Tensor& x) { return tp::reduce_from_region(x, tp); };
  }
  block.tp = std::move(region);
}

void shard_as_tp_rank_0(models::Model& model, int64_t size) {
  const models::TransformerFamily& family = shardable_family(model, size);
  models::TensorParallelParts parts;
  parts.size = size;
  const auto same = [](const torch::Tensor& x) { return x; };
  parts.block = [&](models::TransformerBlockImpl& b) {
    keep_block_parts(b, family.tp_plan, 0, size, nullptr);
    b.tp = models::TpRegion{0, size, same, same, false};
  };
  parts.vocab.n = model.input_spec().num_classes / size;
  parts.vocab.embed = [](const torch::Tensor& ids, const torch::Tensor& rows, int64_t padding_idx) {
    return torch::embedding(rows, ids.remainder(rows.size(0)), padding_idx);  // in range: the values are not kept
  };
  parts.vocab.enter_head = same;
  family.shard(model, parts);
}

}  // namespace keel::dist
