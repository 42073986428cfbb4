#include "fsdp/internal/step_watch.h"

#include "fsdp/internal/check.h"

#include <ATen/ops/cat.h>
#include <ATen/ops/isnan.h>
#include <c10/util/Exception.h>

#include <algorithm>

namespace fsdp::detail {
namespace {

constexpr int64_t kSample = 16;  // values of the watched gradient compared

// The first `n` values of `t`, copied.
at::Tensor sample_of(const at::Tensor& t, int64_t n = kSample) {
  const at::Tensor flat = t.detach().reshape({-1});
  return flat.narrow(0, 0, std::min<int64_t>(n, flat.numel())).clone();
}

// The first values of every parameter with elements on this rank, in one tensor.
at::Tensor sample_of(const std::vector<at::Tensor>& params) {
  std::vector<at::Tensor> parts;
  for (const auto& p : params) {
    if (p.numel() > 0) parts.push_back(sample_of(p, 4).to(at::kFloat));
  }
  return parts.empty() ? at::Tensor() : at::cat(parts);
}

// Bit for bit the same values (NaN for NaN).
bool same_values(const at::Tensor& a, const at::Tensor& b) {
  return (a.eq(b) | (a.isnan() & b.isnan())).all().item<bool>();
}

}  // namespace

void StepWatch::after_backward(const std::vector<at::Tensor>& grads, const std::vector<at::Tensor>& params,
                               bool holds_unsynced_grads) {
  params_ = holds_unsynced_grads ? sample_of(params) : at::Tensor();
  grad_ = at::Tensor();
  sample_ = at::Tensor();
  if (warned_ || watched_ >= kWatchedSteps) return;
  const at::Tensor* smallest = nullptr;
  for (const auto& g : grads) {
    if (!g.defined() || g.numel() == 0 || !g.has_storage()) continue;
    if (smallest == nullptr || g.storage().nbytes() < smallest->storage().nbytes()) smallest = &g;
  }
  if (smallest == nullptr) return;
  ++watched_;
  grad_ = *smallest;
  sample_ = sample_of(grad_);
}

void StepWatch::rescaled_by_library() {
  if (grad_.defined()) sample_ = sample_of(grad_);
}

int64_t StepWatch::vote(const std::vector<at::Tensor>& params, bool holds_unsynced_grads) {
  int64_t v = 0;
  if (grad_.defined()) {
    const at::Tensor now = sample_of(grad_);
    // Zeroed in place (zero_grad(false)) is no rescaling.
    if (!same_values(now, sample_) && now.any().item<bool>()) v |= kRescaled;
    grad_ = at::Tensor();
    sample_ = at::Tensor();
  }
  if (holds_unsynced_grads && params_.defined() && !same_values(sample_of(params), params_)) v |= kSteppedUnsynced;
  params_ = at::Tensor();
  return v;
}

void StepWatch::act(const std::vector<int64_t>& votes, const std::string& where, const std::string& pending) {
  int64_t all = 0;
  std::string rescaled_on;
  for (size_t r = 0; r < votes.size(); ++r) {
    all |= votes[r];
    if ((votes[r] & kRescaled) != 0) rescaled_on += (rescaled_on.empty() ? "" : ", ") + std::to_string(r);
  }
  if ((all & kRescaled) != 0 && !warned_) {
    warned_ = true;
    TORCH_WARN("fsdp (", where, "): after the last backward, the sharded gradients were rescaled in place by the ",
               "program, not by fsdp::optim::clip_grad_norm (seen on group rank(s) ", rescaled_on,
               "). If this was torch::nn::utils::clip_grad_norm_(model->parameters(), max_norm): between steps the ",
               "parameters are this rank's shards, so it computed this rank's part of the norm only and each rank ",
               "clipped by its own factor; the weights now differ from unsharded training. Use ",
               "fsdp::optim::clip_grad_norm(model, max_norm), which computes the global norm over every rank ",
               "(docs/usage.md, 'Clipping'). Warned once.");
  }
  FSDP_CHECK((all & kSteppedUnsynced) == 0, "fsdp (", where, "): the parameters were written (an optimizer step?) ",
             "after a backward with gradient sync off, while ", pending,
             " hold gradients accumulated without sync and never reduced: the step did not see those micro-batches. "
             "Turn sync back on before the backward of the last micro-batch of each step: "
             "model.set_requires_gradient_sync(true); to drop them on purpose, call "
             "model.discard_unsynced_gradients() (docs/usage.md, 'Gradient accumulation').");
}

}  // namespace fsdp::detail
