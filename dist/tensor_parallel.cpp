#include "dist/tensor_parallel.h"

#include <stdexcept>
#include <string>

#include "dist/tp_ops.h"

namespace keel::dist {

void shard_tensor_parallel(models::Model& model, const Mesh& mesh, TransformPlan& plan) {
  if (mesh.tp() != 1)
    throw std::logic_error("shard_tensor_parallel: tp = " + std::to_string(mesh.tp()) + " for model " + model.name() +
                           ": tensor parallelism of a whole model is not implemented yet (only tp = 1)");
  plan.applied(Transform::TensorParallel, "none (tp 1)");
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
  for (auto& p : block.named_parameters()) {
    for (const auto& rule : plan) {
      if (!models::tp_matches(p.key(), rule)) continue;
      p.value().set_data(models::tp_slice(p.value().detach(), rule, rank, size));
      break;
    }
  }
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
