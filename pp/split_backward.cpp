#include "pp/split_backward.h"

#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <unordered_map>
#include <unordered_set>
#include <utility>

namespace fsdp::pp {

using torch::autograd::Edge;
using torch::autograd::Node;

namespace {

// Keeps the gradients reaching a node (its inputs, in autograd's terms) for the weight pass.
class KeepGradients final : public torch::autograd::FunctionPreHook {
 public:
  explicit KeepGradients(std::shared_ptr<std::vector<at::Tensor>> into) : into_(std::move(into)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
    *into_ = grads;
    return grads;
  }

 private:
  std::shared_ptr<std::vector<at::Tensor>> into_;
};

// Adds `g` into w.grad as autograd's accumulation would (a contiguous weight gets a contiguous
// gradient: dW of a matmul comes transposed).
// A gradient of its own (never `g` itself, which autograd may have handed on unchanged from a
// node's input to several outputs: two weights would share one .grad).
void add_into_grad(at::Tensor w, const at::Tensor& g) {
  if (!g.defined()) return;
  TORCH_CHECK(g.sizes() == w.sizes(), "fsdp::pp::WeightPass::run: the weight gradient of shape ", g.sizes(),
              " is for a weight now of shape ", w.sizes(),
              ": an FSDP stage's parameters point at their shards. Give the pipeline the stage's FSDPModule "
              "(pp::Stage::module), which gathers it for the weight pass.");
  at::NoGradGuard no_grad;
  at::Tensor& grad = w.mutable_grad();
  if (grad.defined()) {
    grad.add_(g);
  } else {
    grad = g.clone(w.is_contiguous() ? at::MemoryFormat::Contiguous : at::MemoryFormat::Preserve);
  }
}

}  // namespace

struct WeightPass::State {
  struct Weight {
    at::Tensor tensor;
    std::shared_ptr<Node> accumulator;  // its AccumulateGrad in this graph
  };
  struct Group {
    std::vector<std::shared_ptr<Node>> nodes;                    // where its weights meet the input path
    std::vector<std::shared_ptr<std::vector<at::Tensor>>> kept;  // the gradients reaching each, from I
    std::vector<Weight> weights;
    bool from_output = false;
  };
  std::vector<Group> groups;
  at::Tensor output, grad_output;  // for the groups from the output
  bool ran = false;
  int64_t from_nodes = 0, from_output = 0;
};

WeightPass::WeightPass() = default;
WeightPass::WeightPass(WeightPass&&) noexcept = default;
WeightPass& WeightPass::operator=(WeightPass&&) noexcept = default;
WeightPass::~WeightPass() = default;

int64_t WeightPass::groups_from_nodes() const {
  return state_ ? state_->from_nodes : 0;
}
int64_t WeightPass::groups_from_output() const {
  return state_ ? state_->from_output : 0;
}
bool WeightPass::empty() const {
  return !state_ || state_->groups.empty();
}

WeightPass backward_input(const at::Tensor& output, const at::Tensor& grad_output, const at::Tensor& input,
                          const std::vector<at::Tensor>& weights, at::Tensor& grad_input) {
  WeightPass pass;
  pass.state_ = std::make_unique<WeightPass::State>();
  auto& st = *pass.state_;
  st.output = output;
  st.grad_output = grad_output;
  grad_input = at::Tensor();
  if (!output.requires_grad()) return pass;  // nothing to differentiate
  if (!input.defined() || !input.requires_grad()) {
    // Nothing to split (the first stage: token ids): the whole backward now, through autograd's
    // accumulation (an FSDP stage's hooks see an ordinary backward), and no weight pass.
    std::vector<at::Tensor> grads;
    if (grad_output.defined()) grads.push_back(grad_output);
    torch::autograd::backward({output}, grads);
    st.output = at::Tensor();
    st.grad_output = at::Tensor();
    return pass;
  }
  TORCH_CHECK(input.is_leaf(), "fsdp::pp::backward_input: the stage's input is not a leaf; pass it detached and ",
              "requiring grad (x.detach().requires_grad_(true)), as pp::Pipeline does");
  const std::shared_ptr<Node> input_node = torch::autograd::impl::try_get_grad_accumulator(input);
  // The graph the other way round: for each node, the nodes whose edges lead to it (its
  // consumers in forward), from the output's node down.
  std::unordered_map<Node*, std::vector<Node*>> consumers;
  std::unordered_map<Node*, std::shared_ptr<Node>> owned;
  if (output.grad_fn()) {
    std::vector<Node*> todo{output.grad_fn().get()};
    owned[todo[0]] = output.grad_fn();
    while (!todo.empty()) {
      Node* n = todo.back();
      todo.pop_back();
      for (const Edge& e : n->next_edges()) {
        if (!e.function) continue;
        consumers[e.function.get()].push_back(n);
        if (owned.emplace(e.function.get(), e.function).second) todo.push_back(e.function.get());
      }
    }
  }
  // The weights this graph uses, by the accumulators it holds (not the weights' own: an FSDP
  // parameter pointed at a shard of another dtype or device has lost its pointer to it).
  std::unordered_map<const c10::TensorImpl*, std::shared_ptr<Node>> accumulator_of;
  for (const auto& [node, ptr] : owned) {
    if (const auto* acc = dynamic_cast<const torch::autograd::AccumulateGrad*>(node)) {
      accumulator_of[acc->variable.unsafeGetTensorImpl()] = ptr;
    }
  }
  std::vector<WeightPass::State::Weight> used;
  for (const auto& w : weights) {
    if (!w.defined() || !w.requires_grad()) continue;
    const auto it = accumulator_of.find(w.unsafeGetTensorImpl());
    if (it != accumulator_of.end()) used.push_back({w, it->second});  // else: not in this graph
  }
  // What depends on the input: every node reached from its accumulator through consumers.
  std::unordered_set<Node*> on_input_path;
  if (input_node && owned.count(input_node.get())) {
    std::vector<Node*> todo{input_node.get()};
    on_input_path.insert(input_node.get());
    while (!todo.empty()) {
      Node* n = todo.back();
      todo.pop_back();
      for (Node* c : consumers[n]) {
        if (on_input_path.insert(c).second) todo.push_back(c);
      }
    }
  }
  // Each weight's meeting nodes: from its accumulator through consumers, stopping at the input
  // path. Weights sharing a node join one group.
  std::unordered_map<Node*, size_t> group_of;  // meeting node -> group
  WeightPass::State::Group from_output;
  from_output.from_output = true;
  for (const auto& w : used) {
    std::unordered_set<Node*> seen{w.accumulator.get()}, meets;
    std::vector<Node*> todo{w.accumulator.get()};
    while (!todo.empty()) {
      Node* n = todo.back();
      todo.pop_back();
      for (Node* c : consumers[n]) {
        if (on_input_path.count(c)) {
          meets.insert(c);
        } else if (seen.insert(c).second) {
          todo.push_back(c);
        }
      }
    }
    if (meets.empty()) {  // the weight reaches the output apart from the input path
      from_output.weights.push_back(w);
      continue;
    }
    std::vector<size_t> joined;
    for (Node* m : meets) {
      const auto it = group_of.find(m);
      if (it != group_of.end() && std::find(joined.begin(), joined.end(), it->second) == joined.end()) {
        joined.push_back(it->second);
      }
    }
    size_t g = joined.empty() ? st.groups.size() : joined.front();
    if (joined.empty()) st.groups.emplace_back();
    for (size_t k = 1; k < joined.size(); ++k) {  // merged into the first: their weights and nodes
      auto& other = st.groups[joined[k]];
      for (auto& n : other.nodes) group_of[n.get()] = g;
      auto& into = st.groups[g];
      into.nodes.insert(into.nodes.end(), other.nodes.begin(), other.nodes.end());
      into.weights.insert(into.weights.end(), other.weights.begin(), other.weights.end());
      other = WeightPass::State::Group{};
    }
    auto& group = st.groups[g];
    group.weights.push_back(w);
    for (Node* m : meets) {
      if (group_of.emplace(m, g).second) group.nodes.push_back(owned.at(m));
    }
  }
  // A group one of whose nodes reaches another along the input path would count the gradient
  // that flows between them twice: from the output instead.
  for (auto& group : st.groups) {
    if (group.nodes.size() < 2) continue;
    std::unordered_set<Node*> mine;
    for (const auto& n : group.nodes) mine.insert(n.get());
    bool chained = false;
    for (const auto& start : group.nodes) {
      std::unordered_set<Node*> seen{start.get()};
      std::vector<Node*> todo{start.get()};
      while (!todo.empty() && !chained) {
        Node* n = todo.back();
        todo.pop_back();
        for (const Edge& e : n->next_edges()) {
          Node* c = e.function.get();
          if (!c || !on_input_path.count(c) || !seen.insert(c).second) continue;
          if (mine.count(c)) chained = true;
          todo.push_back(c);
        }
      }
      if (chained) break;
    }
    if (chained) {
      from_output.weights.insert(from_output.weights.end(), group.weights.begin(), group.weights.end());
      group = WeightPass::State::Group{};
    }
  }
  st.groups.erase(std::remove_if(st.groups.begin(), st.groups.end(),
                                 [](const WeightPass::State::Group& g) { return g.weights.empty(); }),
                  st.groups.end());
  st.from_nodes = static_cast<int64_t>(st.groups.size());
  // The hooks that keep what reaches the meeting nodes, for the input pass only.
  std::vector<std::pair<Node*, torch::autograd::FunctionPreHook*>> hooks;
  for (auto& group : st.groups) {
    for (const auto& n : group.nodes) {
      auto kept = std::make_shared<std::vector<at::Tensor>>();
      auto hook = std::make_unique<KeepGradients>(kept);
      hooks.emplace_back(n.get(), hook.get());
      n->add_pre_hook(std::move(hook));
      group.kept.push_back(std::move(kept));
    }
  }
  auto remove_hooks = [&] {
    for (auto& [node, hook] : hooks) {
      auto& pre = node->pre_hooks();
      pre.erase(std::remove_if(pre.begin(), pre.end(), [h = hook](const auto& p) { return p.get() == h; }), pre.end());
    }
  };
  if (input_node && owned.count(input_node.get())) {
    std::vector<at::Tensor> grads;
    if (grad_output.defined()) grads.push_back(grad_output);
    try {
      torch::autograd::backward({output}, grads, /*retain_graph=*/true, /*create_graph=*/false, {input});
    } catch (...) {
      remove_hooks();
      throw;
    }
  }
  grad_input = input.grad().defined() ? input.grad() : at::zeros_like(input);
  remove_hooks();
  if (!from_output.weights.empty()) {
    st.groups.push_back(std::move(from_output));
    st.from_output = 1;
  } else {  // the graph above the meeting nodes is not needed again: let it go now
    st.output = at::Tensor();
    st.grad_output = at::Tensor();
  }
  return pass;
}

void WeightPass::run() {
  TORCH_CHECK(state_ && !state_->ran,
              "fsdp::pp::WeightPass::run: ", state_ ? "ran already (once per input pass)" : "no input pass");
  auto& st = *state_;
  st.ran = true;
  auto& engine = torch::autograd::Engine::get_default_engine();
  auto edges_of = [](const std::vector<State::Weight>& ws) {
    torch::autograd::edge_list edges;
    for (const auto& w : ws) edges.emplace_back(w.accumulator, 0);
    return edges;
  };
  // From the output first: that pass goes through the input path, whose nodes the passes from
  // the meeting nodes free.
  const bool from_nodes = st.from_nodes > 0;
  for (auto& group : st.groups) {
    if (!group.from_output) continue;
    const at::Tensor g = st.grad_output.defined() ? st.grad_output : at::ones_like(st.output);
    const auto dw = engine.execute({torch::autograd::impl::gradient_edge(st.output)}, {g},
                                   /*keep_graph=*/from_nodes, /*create_graph=*/false, /*accumulate_grad=*/false,
                                   edges_of(group.weights));
    for (size_t i = 0; i < dw.size(); ++i) add_into_grad(group.weights[i].tensor, dw[i]);
  }
  for (auto& group : st.groups) {
    if (group.from_output) continue;
    torch::autograd::edge_list roots;
    std::vector<at::Tensor> grads;
    for (size_t k = 0; k < group.nodes.size(); ++k) {
      const auto& kept = *group.kept[k];
      for (size_t i = 0; i < kept.size(); ++i) {
        if (!kept[i].defined()) continue;
        roots.emplace_back(group.nodes[k], static_cast<uint32_t>(i));
        grads.push_back(kept[i]);
      }
    }
    if (roots.empty()) continue;  // its nodes did not reach the output: no gradient, as in one backward
    const auto dw = engine.execute(roots, grads, /*keep_graph=*/false, /*create_graph=*/false,
                                   /*accumulate_grad=*/false, edges_of(group.weights));
    for (size_t i = 0; i < dw.size(); ++i) add_into_grad(group.weights[i].tensor, dw[i]);
  }
  // What the passes kept goes now (the counts stay).
  st.groups.clear();
  st.output = at::Tensor();
  st.grad_output = at::Tensor();
}

}  // namespace fsdp::pp
