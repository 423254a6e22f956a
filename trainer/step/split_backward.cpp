#include "trainer/step/split_backward.h"

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>

#include <map>
#include <tuple>
#include <unordered_map>
#include <utility>

namespace keel {

using torch::autograd::Edge;
using torch::autograd::Node;

namespace {

// Whether each node from `root` down reaches `target` (iteratively: a stage's graph is deep).
std::unordered_map<const Node*, bool> reaches(Node* root, const Node* target) {
  std::unordered_map<const Node*, bool> memo;
  std::vector<std::pair<Node*, size_t>> stack{{root, 0}};
  memo[root] = root == target;
  while (!stack.empty()) {
    auto& [node, next] = stack.back();
    if (next < node->num_outputs()) {
      const Edge& e = node->next_edge(next++);
      Node* child = e.function.get();
      if (!child || memo.count(child)) continue;
      memo[child] = child == target;
      stack.emplace_back(child, 0);
      continue;
    }
    bool r = memo[node];
    for (const Edge& e : node->next_edges())
      if (e.function && memo.at(e.function.get())) r = true;
    memo[node] = r;
    stack.pop_back();
  }
  return memo;
}

}  // namespace

WeightBackward backward_input(torch::Tensor output, torch::Tensor grad, const torch::Tensor& input) {
  WeightBackward w;
  w.output = std::move(output);
  w.grad = grad.defined() ? std::move(grad) : torch::ones_like(w.output);
  if (!input.defined() || !input.requires_grad() || !w.output.requires_grad()) {
    w.whole = true;
    return w;
  }
  const Edge root = torch::autograd::impl::gradient_edge(w.output);
  const Edge to_input = torch::autograd::impl::gradient_edge(input);
  const auto on_path = reaches(root.function.get(), to_input.function.get());
  torch::autograd::edge_list outputs{to_input};
  for (const auto& [node, r] : on_path) {
    if (!r || node == to_input.function.get()) continue;
    std::vector<size_t> towards_input;
    bool leads_to_weights = false;
    for (size_t e = 0; e < node->num_outputs(); ++e) {
      const Edge& edge = node->next_edge(e);
      if (!edge.function) continue;
      if (on_path.at(edge.function.get()))
        towards_input.push_back(e);
      else
        leads_to_weights = true;
    }
    if (!leads_to_weights) continue;
    auto shared = const_cast<Node*>(node)->getptr();
    for (uint32_t k = 0; k < node->num_inputs(); ++k) w.roots.emplace_back(shared, k);
    w.towards_input.emplace_back(std::move(shared), std::move(towards_input));
  }
  outputs.insert(outputs.end(), w.roots.begin(), w.roots.end());
  auto got = torch::autograd::Engine::get_default_engine().execute({root}, {w.grad}, /*keep_graph=*/true,
                                                                   /*create_graph=*/false,
                                                                   /*accumulate_grad=*/false, outputs);
  input.mutable_grad() = got[0];
  w.grads.assign(got.begin() + 1, got.end());
  return w;
}

void backward_weight(WeightBackward& w) {
  if (w.whole) {
    torch::autograd::backward({w.output}, {w.grad});
    w = WeightBackward();
    return;
  }
  // Each intermediate once more from the gradients captured, its edges towards the input cut (a
  // node computes no output whose edge is invalid), so that only the weights' side runs. No
  // intermediate reaches another through the weights' side (that side does not reach the input,
  // which every intermediate does): each weight's gradient is reached once.
  std::map<const Node*, bool> any;
  for (size_t i = 0; i < w.roots.size(); ++i) any[w.roots[i].function.get()] |= w.grads[i].defined();
  torch::autograd::edge_list roots;
  torch::autograd::variable_list grads;
  for (size_t i = 0; i < w.roots.size(); ++i) {
    const Edge& r = w.roots[i];
    if (!any.at(r.function.get())) continue;  // nothing flowed into it: no weight gradient
    roots.push_back(r);
    grads.push_back(w.grads[i]);  // undefined where none flowed, as the whole backward passes it
  }
  std::vector<std::tuple<Node*, size_t, Edge>> saved;
  for (auto& [node, edges] : w.towards_input)
    for (size_t e : edges) {
      // In place (set_next_edge refuses a node with a parent; removing an edge, and putting it
      // back, keeps every node's topological number valid).
      saved.emplace_back(node.get(), e, node->next_edge(e));
      node->next_edges()[e] = Edge();
    }
  auto restore = [&] {
    for (auto& [node, e, edge] : saved) node->next_edges()[e] = std::move(edge);
  };
  try {
    if (!roots.empty())
      torch::autograd::Engine::get_default_engine().execute(roots, grads, /*keep_graph=*/false,
                                                            /*create_graph=*/false, /*accumulate_grad=*/true);
  } catch (...) {
    restore();
    throw;
  }
  restore();
  w = WeightBackward();
}

}  // namespace keel
