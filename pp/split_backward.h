// fsdp::pp's split backward, for zero-bubble schedules: the input pass (I) computes the gradient
// at a stage's input, which the stage before waits for, and the weight pass (W) its weights'
// gradients later, in what would otherwise be a bubble. PyTorch's stage_backward_input /
// stage_backward_weight (torch/distributed/pipelining/_backward.py), in C++:
//
//   I  autograd from the stage's output to its input only (the graph kept). Before it runs, the
//      nodes where each weight meets the path from the input (a linear layer's matmul, a norm's
//      multiply: the weight-consuming operations) get a hook that keeps the gradients reaching
//      them. I computes only their input side (the matmul's dX, not its dW).
//   W  autograd from those nodes, with the kept gradients, to the weights only: each weight's own
//      part of the graph (dW = dY^T X), not the activation gradients again.
//
// Weights are grouped by the nodes they meet the input path at (weights sharing a node go
// together); a group whose nodes lie on one another's input path (a weight used twice along the
// stage, whose second use's gradient already flows into the first's) would count that gradient
// twice from its nodes, and its W runs from the stage's output instead. A stage whose input takes
// no gradient (the first stage: token ids) has nothing to split: its I is the whole backward,
// through autograd's accumulation, and its W does nothing.
//
// W adds into the weights' .grad without autograd's gradient accumulation (as PyTorch's does):
// hooks on the weights' accumulators do not fire. An FSDP stage (pp/pipeline.h) is therefore
// driven through FSDPModule's pipeline controls: gathered for W (unshard), its gradients
// accumulated without sync and reduced once after its last microbatch (reduce_gradients).
#pragma once

#include "fsdp/export.h"

#include <ATen/core/Tensor.h>

#include <memory>
#include <vector>

FSDP_PUBLIC_BEGIN

namespace fsdp::pp {

/// What an input pass kept for its weight pass. Movable; holds the part of the graph W needs
/// until run() (or its destruction) frees it.
class WeightPass {
 public:
  WeightPass();
  WeightPass(WeightPass&&) noexcept;
  WeightPass& operator=(WeightPass&&) noexcept;
  ~WeightPass();

  /// Computes the weights' gradients and adds them into their .grad (set where undefined). Once.
  void run();
  /// How many groups run from the nodes where they meet the input path, and how many from the
  /// stage's output (see above).
  int64_t groups_from_nodes() const;
  int64_t groups_from_output() const;
  /// Nothing to run (the first stage's I was its whole backward, or no weight is in the graph).
  bool empty() const;

  struct State;

 private:
  friend WeightPass backward_input(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                   const std::vector<at::Tensor>&, at::Tensor&);
  std::unique_ptr<State> state_;
};

/// The input pass: from `output` with the gradient `grad_output` (undefined: `output` is a scalar
/// loss, its gradient 1) to `input`, a leaf, keeping what the weight pass of `weights` needs.
/// Sets `grad_input` to the gradient at `input` (zeros where the output does not depend on it).
/// With `input` undefined or not requiring grad: the whole backward, `grad_input` undefined.
WeightPass backward_input(const at::Tensor& output, const at::Tensor& grad_output, const at::Tensor& input,
                          const std::vector<at::Tensor>& weights, at::Tensor& grad_input);

}  // namespace fsdp::pp

FSDP_PUBLIC_END
