// fsdp::activation_checkpoint: run a forward without keeping its intermediate tensors, and run it
// again in backward to get them (torch.utils.checkpoint for LibTorch). Works with or without
// fsdp::fully_shard; not to be confused with fsdp::checkpoint (sharded model checkpoints on disk).
//
//   at::Tensor y = fsdp::activation_checkpoint([this](const at::Tensor& x) { return block(x); }, x);
//
// In forward, `fn(args...)` runs with gradients off: only the tensors among the arguments are kept
// (and, for the recompute, copies of the other arguments and of `fn`). In backward, the forward runs
// again with gradients on, from the same inputs and the same random-number state (CPU and the CUDA
// devices of the tensor inputs, and the autocast state), and backward runs through it: parameters
// get their gradients as without the checkpoint, inputs that need one get theirs. A block's
// activations then cost memory only between its recompute and its backward: activation memory
// drops from every block's to one block's, for about one extra forward per step.
//
// Under fsdp::fully_shard, checkpoint units rather than wrapping their calls:
// ShardedUnit::set_activation_checkpointing(true) or FullyShardOptions::activation_checkpointing_every
// recompute the unit while it is gathered for its backward (no extra all-gather).
//
// What it takes and gives:
//   - arguments: tensors, and tensors in std::vector, std::optional, std::pair and std::tuple, are
//     the inputs; every other argument is copied and given again to the recompute (`fn` receives
//     lvalues: a non-const reference parameter sees a copy). A tensor hidden inside another type
//     (a struct) is not an input: the recompute's own backward reaches it as a captured tensor
//     (twice, and then fails, if the loss also reaches it another way); pass it as an argument.
//   - outputs: a tensor, or tensors in vectors, optionals, pairs and tuples, with numbers and
//     strings; another type does not compile (a struct's tensors would lose their gradients).
//   - with gradients off (torch::NoGradGuard, inference) it is fn(args...): nothing is recomputed.
// What it refuses, with an fsdp::Error: a second backward through it (retain_graph=true; the
// recompute's graph is freed by the first), torch::autograd::grad or backward with `inputs` over
// it (the recompute's gradients go to the parameters' .grad, which those calls must not touch), a
// recompute whose outputs differ in number or shape from the forward's (a forward that depends on
// something other than its inputs, parameters and random state), and an input modified in place
// between forward and backward (LibTorch's own version check).
#pragma once

#include "fsdp/export.h"
#include "fsdp/tensor_tree.h"

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <c10/core/GradMode.h>

#include <functional>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

FSDP_PUBLIC_BEGIN

namespace fsdp {

namespace detail {

/// What activation_checkpoint runs twice: the forward, from the tensors among its arguments to the
/// tensors of its output.
class CheckpointBody : public torch::CustomClassHolder {
 public:
  virtual std::vector<at::Tensor> run(const std::vector<at::Tensor>& inputs) = 0;
};

/// Runs `body` once with gradients off inside an autograd node that recomputes it in backward;
/// returns the node's outputs (one per tensor the body returned). `label` starts its errors;
/// `on_end(true)` runs at the end of the node's backward, `on_end(false)` when the node is freed
/// without its backward having run (an FSDP unit counts its recomputes).
std::vector<at::Tensor> run_checkpointed(const c10::intrusive_ptr<CheckpointBody>& body, std::vector<at::Tensor> inputs,
                                         std::string label, std::function<void(bool)> on_end = nullptr);

/// Whether this thread is recomputing a checkpointed forward (inside a backward).
bool in_activation_recompute();

template <typename Fn, typename... Args>
class TypedCheckpointBody final : public CheckpointBody {
 public:
  using Stored = std::tuple<std::decay_t<Args>...>;
  using Out = std::decay_t<std::invoke_result_t<std::decay_t<Fn>&, std::decay_t<Args>&...>>;
  static_assert(!std::is_void_v<Out>, "fsdp::activation_checkpoint: the function returns nothing; return its tensors");
  static_assert(is_tensor_tree<Out>::value,
                "fsdp::activation_checkpoint: the function returns a type whose tensors cannot be seen (a struct, "
                "array or map holding tensors would lose their gradients): return a tensor, a std::vector or "
                "std::optional of tensors, or a std::tuple / std::pair of those, numbers and strings");

  TypedCheckpointBody(Fn&& fn, Args&&... args) : fn_(std::forward<Fn>(fn)), args_(std::forward<Args>(args)...) {}

  /// Moves the tensors out of the stored arguments (they are the node's inputs, saved by it).
  std::vector<at::Tensor> take_inputs() {
    std::vector<at::Tensor> inputs;
    visit_tensors(args_, [&](at::Tensor& t) { inputs.push_back(std::exchange(t, at::Tensor())); });
    return inputs;
  }

  std::vector<at::Tensor> run(const std::vector<at::Tensor>& inputs) override {
    Stored call = args_;
    size_t next = 0;
    visit_tensors(call, [&](at::Tensor& t) { t = inputs.at(next++); });
    Out out = std::apply([&](auto&... a) { return fn_(a...); }, call);
    std::vector<at::Tensor> tensors = tensors_of(out);
    if (!ran_) first_ = std::move(out);  // the forward's: its structure and non-tensor values
    ran_ = true;
    return tensors;
  }

  /// The forward's output with the node's outputs in place of its tensors.
  Out output(const std::vector<at::Tensor>& tensors) {
    Out out = std::move(*first_);
    first_.reset();
    size_t next = 0;
    visit_tensors(out, [&](at::Tensor& t) { t = tensors.at(next++); });
    return out;
  }

 private:
  std::decay_t<Fn> fn_;
  Stored args_;
  std::optional<Out> first_;
  bool ran_ = false;
};

}  // namespace detail

namespace detail {
/// activation_checkpoint with its errors starting with `label` (a checkpointed unit names itself);
/// `on_end` (if set): see run_checkpointed.
template <typename Fn, typename... Args>
auto activation_checkpoint_labelled(std::string label, std::function<void(bool)> on_end, Fn&& fn, Args&&... args) {
  using Body = TypedCheckpointBody<Fn, Args...>;
  // Gradients off: nothing to keep, nothing to recompute (fn gets lvalues, as in the recompute).
  if (!c10::GradMode::is_enabled()) return typename Body::Out(fn(args...));
  auto body = c10::make_intrusive<Body>(std::forward<Fn>(fn), std::forward<Args>(args)...);
  std::vector<at::Tensor> outputs = run_checkpointed(body, body->take_inputs(), std::move(label), std::move(on_end));
  return body->output(outputs);
}
}  // namespace detail

/// Runs fn(args...) without keeping its activations, recomputing them in backward (see above).
/// `fn` is kept until backward: capture what it uses by value (or `this`), not locals by reference.
template <typename Fn, typename... Args>
auto activation_checkpoint(Fn&& fn, Args&&... args) {
  return detail::activation_checkpoint_labelled("fsdp::activation_checkpoint", nullptr, std::forward<Fn>(fn),
                                                std::forward<Args>(args)...);
}

}  // namespace fsdp

FSDP_PUBLIC_END
