#include "dist/tensor_parallel.h"

#include <stdexcept>
#include <string>

#include "dist/tp_ops.h"
#include "keel/common/error.h"

namespace keel::dist {

void shard_tensor_parallel(models::Model& model, const Mesh& mesh, TransformPlan& plan) {
  if (mesh.tp() == 1) {
    plan.applied(Transform::TensorParallel, "none (tp 1)");
    return;
  }
  const tp::VocabRange range = shard_model_tensor_parallel(model, mesh.on(Axis::Tp));
  plan.applied(Transform::TensorParallel, "tp " + std::to_string(mesh.tp()) + ", rank " +
                                              std::to_string(mesh.coordinate(Axis::Tp)) +
                                              "'s heads, MLP and vocabulary " + std::to_string(range.first) + "-" +
                                              std::to_string(range.first + range.n - 1));
}

tp::VocabRange shard_model_tensor_parallel(models::Model& model, Collectives& tp) {
  const models::TransformerFamily* family = models::transformer_family(model.name());
  if (!family || !family->shard)
    throw InputError("tensor parallelism: model.name = \"" + model.name() +
                     "\" has no tensor-parallel plan (only gpt has one yet)");
  const int64_t vocab = model.input_spec().num_classes, size = tp.size();
  if (vocab % size != 0)
    throw InputError("tensor parallelism: model.vocab = " + std::to_string(vocab) +
                     " does not divide by tp = " + std::to_string(size));
  const tp::VocabRange range = tp::VocabRange::of(vocab, size, tp.rank());
  models::TensorParallelParts parts;
  parts.rank = tp.rank();
  parts.size = size;
  parts.block = [&](models::TransformerBlockImpl& b) {
    shard_block(b, family->tp_plan, tp, /*sequence_parallel=*/false);
  };
  parts.vocab.first = range.first;
  parts.vocab.n = range.n;
  parts.vocab.embed = [&tp, range](const torch::Tensor& ids, const torch::Tensor& rows) {
    return tp::vocab_parallel_embedding(ids, rows, range, tp);
  };
  parts.vocab.enter_head = [&tp](const torch::Tensor& x) { return tp::copy_to_region(x, tp); };
  family->shard(model, parts);
  return range;
}

void shard_block(models::TransformerBlockImpl& block, const std::vector<models::TpRule>& plan, Collectives& tp,
                 bool sequence_parallel) {
  const int64_t size = tp.size(), rank = tp.rank();
  const models::BlockOptions& o = block.o;
  for (const auto& [what, n] : {std::pair{"model.heads", o.heads}, std::pair{"model.kv_heads", o.kv_heads},
                                std::pair{"the MLP's width", o.ffn}})
    if (n % size != 0)
      throw std::invalid_argument("tensor parallel: " + std::string(what) + " = " + std::to_string(n) +
                                  " does not divide by tp = " + std::to_string(size));
  torch::NoGradGuard no_grad;
  for (auto& p : block.named_parameters())
    if (const models::TpRule* rule = models::tp_rule(plan, p.key()))
      p.value().set_data(models::tp_slice(p.value().detach(), *rule, rank, size));
  models::TpRegion region;
  region.rank = rank;
  region.size = size;
  if (sequence_parallel) {
    region.enter = [&tp](const torch::Tensor& x) { return tp::gather_sequence(x, 1, tp); };
    region.leave = [&tp](const torch::Tensor& x) { return tp::scatter_sequence(x, 1, tp); };
  } else {
    region.enter = [&tp](const torch::Tensor& x) { return tp::copy_to_region(x, tp); };
    region.leave = [&tp](const torch::Tensor& x) { return tp::reduce_from_region(x, tp); };
  }
  block.tp = std::move(region);
}

}  // namespace keel::dist
