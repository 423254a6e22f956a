// dist/tensor_parallel.h: the second transform of dist/transform_plan.h: each block's matrices
// sharded over the mesh's tp axis by its family's plan (models/transformer.h's TransformerFamily::
// tp_plan: column-wise, row-wise, vocabulary-parallel). Today tp is 1 (the config offers no
// other): nothing is sharded. Under tp > 1 the tp ranks of one dp coordinate read the same batch
// (the sampler asks mesh.dp()), and ZeRO shards over the dp axis only (distribute() takes its
// Collectives).
#pragma once

#include "dist/mesh.h"
#include "dist/transform_plan.h"
#include "keel/models/model.h"

namespace keel::dist {

/// Shards `model`'s parameters over the tp axis in place (tp = 1: none), recorded in `plan`.
void shard_tensor_parallel(models::Model& model, const Mesh& mesh, TransformPlan& plan);

}  // namespace keel::dist
