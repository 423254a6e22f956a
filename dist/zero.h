// dist/zero.h: the pieces of ZeRO (dist.zero, docs/zero.md) that DataParallel (dist/ddp.h) puts
// together beside the placement (dist/placement.h, which says who owns what): the global
// gradient norm over the owners' gradients or over this rank's pieces (stages 2 and 3,
// dist/fsdp.h), and stage 1's broadcast of the updated parameters.
// Does not own: the optimizer (trainer/), or the checkpoint layout of a partition (checkpoint/).
// Not installed: DataParallel's and DistributedModel's methods are the public surface.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "keel/dist/collectives.h"
#include "keel/models/model.h"

namespace keel::dist {

/// Collective, after the optimizer step: every rank's updated parameters (`owner[i] == rank`)
/// reach every rank, one validated broadcast_coalesced per owner in messages of at most
/// `bucket_bytes`. (Measured on gpt at 2 ranks over Gloo, the step's keel::optimizer region:
/// 8 ms at zero = 0, 19 ms with these broadcasts, 25-35 ms with an all-gather of flat
/// partitions instead, whose flatten and unflatten copies cost more than they save.)
void zero_broadcast_parameters(const models::NamedTensors& params, const std::vector<int64_t>& owner, Collectives& coll,
                               size_t bucket_bytes);

/// Clips the gradients to a global L2 norm of `max_norm` and returns the norm before clipping
/// (a 0-dim tensor on the gradients' device: nothing is read by the host); a `max_norm` of
/// infinity only measures the norm (no gradient is written), here and in every clip below. The arithmetic of
/// torch.nn.utils.clip_grad_norm_ (foreach): per-parameter norms in one _foreach_norm, the norm
/// of their vector, one _foreach_mul_ by the clamped coefficient. `sharded` (collective; ZeRO):
/// only the gradients this rank owns (`owner[i] == coll.rank()`) are read and scaled, and the
/// per-parameter norms are summed across ranks in one all-reduce (each is non-zero on its owner
/// only, so the sum is exact and the norm bit-identical to the unsharded one).
torch::Tensor clip_grad_norm(const models::NamedTensors& params, const std::vector<int64_t>& owner, Collectives& coll,
                             double max_norm, bool sharded);

/// The clip that every layout whose ranks hold parts of the gradients shares (collective over
/// each of `groups`, in order): the squared L2 norms of `counted` summed over the groups' ranks,
/// one all-reduce of one number per group (`what` names it), every tensor of `scaled` multiplied
/// by max_norm / (norm + 1e-6) clamped to 1. Returns the norm (0-dim). ZeRO-3's pieces count and
/// scale the same tensors; tensor parallelism scales every gradient but counts a replicated one
/// on one rank only; the two together sum over dp, then tp.
torch::Tensor clip_by_summed_squares(const std::vector<torch::Tensor>& counted,
                                     const std::vector<torch::Tensor>& scaled, const std::vector<Collectives*>& groups,
                                     double max_norm, const char* what);

/// clip_grad_norm for dist.zero = 3 (collective): `pieces` are this rank's elements of the
/// parameters, so the squared norms are summed across ranks (one all-reduce of one number); equal
/// to the unsharded norm up to the order of the sums.
torch::Tensor clip_grad_norm_of_pieces(const models::NamedTensors& pieces, Collectives& coll, double max_norm);

}  // namespace keel::dist
