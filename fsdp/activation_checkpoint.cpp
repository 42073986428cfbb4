// The autograd node of fsdp::activation_checkpoint (the "reentrant" checkpoint, the one LibTorch
// allows: PyTorch's non-reentrant one rests on saved-tensor hooks that take only Python objects).
// Forward runs the body with gradients off and keeps its inputs; backward puts back the random and
// autocast state of the forward, runs the body again with gradients on from detached copies of the
// inputs, and runs a nested backward through it with the incoming gradients: parameters
// accumulate their gradients there (their hooks fire as in any backward: an FSDP unit reduces as
// soon as its gradients are ready), inputs give theirs back to this node.
#include "fsdp/activation_checkpoint.h"

#include "fsdp/internal/check.h"

#include <ATen/Context.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/Generator.h>
#include <ATen/ops/empty.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/engine.h>

#include <mutex>
#include <sstream>
#include <string>
#include <utility>

namespace fsdp::detail {
namespace {

thread_local int recomputing = 0;

// The state of the generators a forward may draw from (dropout): the CPU's and those of the CUDA
// devices of its inputs, as torch.utils.checkpoint keeps.
struct RandomState {
  std::vector<std::pair<at::Generator, at::Tensor>> generators;

  static RandomState capture(const std::vector<at::Device>& devices) {
    RandomState out;
    for (const auto& d : devices) {
      at::Generator gen = at::globalContext().defaultGenerator(d);
      std::lock_guard<std::mutex> lock(gen.mutex());
      out.generators.emplace_back(gen, gen.get_state());
    }
    return out;
  }
  void restore() const {
    for (const auto& [gen, state] : generators) {
      at::Generator g = gen;
      std::lock_guard<std::mutex> lock(g.mutex());
      g.set_state(state);
    }
  }
};

// Autocast as the forward saw it: the backward's thread may have another (usually none).
struct AutocastState {
  bool cpu = false, cuda = false;
  at::ScalarType cpu_dtype = at::kBFloat16, cuda_dtype = at::kHalf;
  static AutocastState capture() {
    return {at::autocast::is_autocast_enabled(at::kCPU), at::autocast::is_autocast_enabled(at::kCUDA),
            at::autocast::get_autocast_dtype(at::kCPU), at::autocast::get_autocast_dtype(at::kCUDA)};
  }
  void apply() const {
    at::autocast::set_autocast_enabled(at::kCPU, cpu);
    at::autocast::set_autocast_enabled(at::kCUDA, cuda);
    at::autocast::set_autocast_dtype(at::kCPU, cpu_dtype);
    at::autocast::set_autocast_dtype(at::kCUDA, cuda_dtype);
  }
};

// What the node keeps besides its inputs (LibTorch's autograd context holds it as a capsule).
struct Recompute : torch::CustomClassHolder {
  c10::intrusive_ptr<CheckpointBody> body;
  std::vector<at::Device> devices;
  RandomState random;
  AutocastState autocast;
  std::vector<std::vector<int64_t>> output_shapes;
  std::string label;                 // how errors name it: "fsdp::activation_checkpoint" or "... of unit 'h.0'"
  std::function<void(bool)> on_end;  // true: after the backward; false: freed without one
  bool done = false;
  bool ended = false;
  ~Recompute() override {
    if (on_end && !ended) on_end(false);
  }
};

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

class CheckpointFunction : public torch::autograd::Function<CheckpointFunction> {
 public:
  // `inputs` ends with a tensor that needs a gradient when none of the body's does, so that
  // autograd runs this node's backward even then (the first block after a frozen embedding).
  static variable_list forward(AutogradContext* ctx, c10::intrusive_ptr<Recompute> recompute, at::TensorList inputs,
                               int64_t body_inputs) {
    const variable_list own(inputs.begin(), inputs.begin() + body_inputs);
    ctx->save_for_backward(own);
    ctx->set_materialize_grads(false);  // an output without a gradient is left out of the recompute's backward
    recompute->devices.emplace_back(at::kCPU);
    for (const auto& t : own) {
      if (t.defined() && t.is_cuda() &&
          std::find(recompute->devices.begin(), recompute->devices.end(), t.device()) == recompute->devices.end()) {
        recompute->devices.push_back(t.device());
      }
    }
    recompute->random = RandomState::capture(recompute->devices);
    recompute->autocast = AutocastState::capture();
    variable_list outputs = recompute->body->run(own);
    for (const auto& t : outputs)
      recompute->output_shapes.push_back(t.defined() ? t.sizes().vec() : std::vector<int64_t>{-1});
    ctx->saved_data["recompute"] = c10::IValue::make_capsule(recompute);
    return outputs;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    auto recompute = c10::static_intrusive_pointer_cast<Recompute>(ctx->saved_data["recompute"].toCapsule());
    FSDP_CHECK(!recompute->done, recompute->label,
               ": a second backward through a checkpointed forward (retain_graph=true). "
               "Its recompute's graph is freed by the first backward; run the forward again for each backward, or "
               "do not checkpoint this part.");
    FSDP_CHECK(torch::autograd::Engine::get_default_engine().is_checkpoint_valid(), recompute->label,
               ": torch::autograd::grad, or backward with `inputs`, over a checkpointed "
               "forward. The recompute's backward accumulates into the parameters' .grad, which those calls must "
               "not touch; use tensor.backward() (or torch::autograd::backward without inputs).");
    FSDP_CHECK(!c10::GradMode::is_enabled(), recompute->label,
               ": backward with create_graph=true (double backward) through a "
               "checkpointed forward is not supported; do not checkpoint this part.");
    recompute->done = true;

    const variable_list saved = ctx->get_saved_variables();
    variable_list inputs;
    for (const auto& t : saved) {
      inputs.push_back(t.defined() ? t.detach().requires_grad_(t.requires_grad()) : at::Tensor());
    }
    variable_list outputs;
    {
      // The forward's random and autocast state for the recompute; this thread's put back after.
      const RandomState now = RandomState::capture(recompute->devices);
      const AutocastState autocast_now = AutocastState::capture();
      struct Restore {
        const RandomState& random;
        const AutocastState& autocast;
        ~Restore() {
          random.restore();
          autocast.apply();
          --recomputing;
        }
      } restore{now, autocast_now};
      ++recomputing;
      recompute->random.restore();
      recompute->autocast.apply();
      torch::AutoGradMode grad(true);
      outputs = recompute->body->run(inputs);
    }
    auto shapes = [](const std::vector<std::vector<int64_t>>& list) {
      std::ostringstream os;
      for (size_t i = 0; i < list.size(); ++i) {
        os << (i ? ", " : "")
           << (list[i] == std::vector<int64_t>{-1} ? "undefined" : c10::str(c10::IntArrayRef(list[i])));
      }
      return os.str();
    };
    std::vector<std::vector<int64_t>> got;
    for (const auto& t : outputs) got.push_back(t.defined() ? t.sizes().vec() : std::vector<int64_t>{-1});
    FSDP_CHECK(got == recompute->output_shapes, recompute->label, ": the recompute in backward returned ", got.size(),
               " tensor(s) of shapes ", shapes(got), " where the forward returned ", recompute->output_shapes.size(),
               " of shapes ", shapes(recompute->output_shapes),
               ". The checkpointed function must depend only on its arguments, its parameters and the random "
               "state; pass what else it reads as an argument.");
    variable_list roots, grads;
    for (size_t i = 0; i < outputs.size(); ++i) {
      if (outputs[i].defined() && outputs[i].requires_grad() && i < grad_outputs.size() && grad_outputs[i].defined()) {
        roots.push_back(outputs[i]);
        grads.push_back(grad_outputs[i]);
      }
    }
    if (!roots.empty()) torch::autograd::backward(roots, grads);
    // The nested backward ran its parameters' gradient hooks; an FSDP unit whose forward was
    // checkpointed more than once (modules sharing it, a tied weight) waits for each recompute
    // before it takes its gradients as complete.
    recompute->ended = true;
    if (recompute->on_end) recompute->on_end(true);

    // One gradient per argument of forward: the capsule, each input (the tail tensor too), the count.
    variable_list out{at::Tensor()};
    for (const auto& t : inputs) out.push_back(t.defined() && t.requires_grad() ? t.grad() : at::Tensor());
    out.resize(out.size() + 2);  // the tail tensor (when there is one) and the count: none (extra ones are dropped)
    return out;
  }
};

}  // namespace

std::vector<at::Tensor> run_checkpointed(const c10::intrusive_ptr<CheckpointBody>& body, std::vector<at::Tensor> inputs,
                                         std::string label, std::function<void(bool)> on_end) {
  const auto body_inputs = static_cast<int64_t>(inputs.size());
  bool any = false;
  for (const auto& t : inputs) any = any || (t.defined() && t.requires_grad());
  if (!any) inputs.push_back(at::empty({0}).requires_grad_());
  auto recompute = c10::make_intrusive<Recompute>();
  recompute->body = body;
  recompute->label = std::move(label);
  recompute->on_end = std::move(on_end);
  // As a TensorList, so that autograd sees each tensor as an input (a std::vector would be one
  // opaque argument).
  return CheckpointFunction::apply(recompute, at::TensorList(inputs), body_inputs);
}

bool in_activation_recompute() {
  return recomputing > 0;
}

}  // namespace fsdp::detail
