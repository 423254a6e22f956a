// trainer/step/split_backward.h: a stage's backward split into its input's gradient (I) and its
// weights' (W), for the zero-bubble schedules (interleaved-zb, zbv, dualpipev; issue 66 item 3),
// as torch.distributed.pipelining's stage_backward_input / stage_backward_weight do it.
//
// I runs the autograd engine from the stage's output to its input only, keeping the graph: the
// nodes on the way to the input run, with their outputs towards the weights left out (a linear
// layer computes its input's product, not its weight's). Where such a node also leads to weights
// (an "intermediate": a node that reaches the input with a next edge that does not), the gradient
// flowing into it is captured. W runs each intermediate again from what was captured, its edges
// towards the input cut, so that only the weights' side runs and accumulates into their .grad;
// then the graph is freed. The sums are those of the whole backward: every weight's gradient is
// the same products, reached once. A block under activation checkpointing (dist/recompute.h)
// computes its weights' gradients inside its own node during I (its recomputation has no edge
// to them): correct, not split. An intermediate runs twice (its hooks too: keel registers none on
// a stage's activations), and its saved activations live from I to W, as in PyTorch's split.
// Does not own: the schedule, the messages (trainer/step/pipelined.h).
#pragma once

#include <torch/csrc/autograd/edge.h>
#include <torch/torch.h>

#include <memory>
#include <utility>
#include <vector>

namespace keel {

/// What I leaves for W.
struct WeightBackward {
  torch::Tensor output, grad;                // the stage's output (its graph) and its gradient
  bool whole = false;                        // no input gradient to take first (the first stage): W runs it all
  std::vector<torch::autograd::Edge> roots;  // (intermediate, input number)
  std::vector<torch::Tensor> grads;          // captured there
  /// Each intermediate's next edges towards the input (cut while W runs it).
  std::vector<std::pair<std::shared_ptr<torch::autograd::Node>, std::vector<size_t>>> towards_input;
};

/// I: the gradient of `output` (with `grad`; undefined for a scalar loss: 1) with respect to
/// `input` (a leaf) set as input's .grad, the graph kept; the weights' part left to W. `input`
/// undefined or not requiring grad (or an output without a graph): nothing runs now (whole).
WeightBackward backward_input(torch::Tensor output, torch::Tensor grad, const torch::Tensor& input);

/// W: the weights' gradients accumulated into their .grad; the graph is freed.
void backward_weight(WeightBackward& w);

}  // namespace keel
