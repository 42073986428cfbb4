#include "fsdp/internal/step_watch.h"

#include "fsdp/internal/check.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>

namespace fsdp::detail {
namespace {

constexpr int64_t kSample = 16;  // values of the watched gradient compared

// The bytes of the first `n` elements of `t`, appended to `out`: read in place from a contiguous
// CPU tensor, else through a small host copy.
void append_bytes(const at::Tensor& t, int64_t n, std::vector<uint8_t>& out) {
  const int64_t k = std::min<int64_t>(n, t.numel());
  if (k <= 0) return;
  const size_t bytes = static_cast<size_t>(k) * t.element_size();
  const size_t at = out.size();
  out.resize(at + bytes);
  if (t.is_cpu() && t.is_contiguous()) {
    std::memcpy(out.data() + at, t.data_ptr(), bytes);
  } else {
    const at::Tensor host = t.detach().reshape({-1}).narrow(0, 0, k).contiguous().cpu();
    std::memcpy(out.data() + at, host.data_ptr(), bytes);
  }
}

std::vector<uint8_t> sample_of(const at::Tensor& grad) {
  std::vector<uint8_t> out;
  append_bytes(grad, kSample, out);
  return out;
}

// The first values of every parameter with elements on this rank.
std::vector<uint8_t> sample_of(const std::vector<at::Tensor>& params) {
  std::vector<uint8_t> out;
  for (const auto& p : params) append_bytes(p, 4, out);
  return out;
}

}  // namespace

void StepWatch::after_backward(const Tensors& grads, const Tensors& params, bool holds_unsynced_grads) {
  params_.reset();
  if (holds_unsynced_grads) params_ = sample_of(params());
  grad_ = at::Tensor();
  sample_.clear();
  if (warned_ || watched_ >= kWatchedSteps) return;
  const std::vector<at::Tensor> sharded = grads();
  const at::Tensor* smallest = nullptr;
  for (const auto& g : sharded) {
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

int64_t StepWatch::vote(const Tensors& params, bool holds_unsynced_grads) {
  int64_t v = 0;
  if (grad_.defined()) {
    const std::vector<uint8_t> now = sample_of(grad_);
    // Bit for bit (a NaN stays equal to itself); zeroed in place (zero_grad(false)) is no rescaling.
    const bool zeroed = std::all_of(now.begin(), now.end(), [](uint8_t b) { return b == 0; });
    if (now != sample_ && !zeroed) v |= kRescaled;
    grad_ = at::Tensor();
    sample_.clear();
  }
  if (holds_unsynced_grads && params_ && sample_of(params()) != *params_) v |= kSteppedUnsynced;
  params_.reset();
  return v;
}

void StepWatch::act(const std::vector<int64_t>& votes, const ErrorContext& where,
                    const std::function<std::string()>& pending) {
  int64_t all = 0;
  std::string rescaled_on;
  for (size_t r = 0; r < votes.size(); ++r) {
    all |= votes[r];
    if ((votes[r] & kRescaled) != 0) rescaled_on += (rescaled_on.empty() ? "" : ", ") + std::to_string(r);
  }
  if ((all & kRescaled) != 0 && !warned_) {
    warned_ = true;
    TORCH_WARN(error_caller(where), ": after the last backward, the sharded gradients were rescaled in place by the ",
               "program, not by fsdp::optim::clip_grad_norm (seen on group rank(s) ", rescaled_on,
               "). If this was torch::nn::utils::clip_grad_norm_(model->parameters(), max_norm): between steps the ",
               "parameters are this rank's shards, so it computed this rank's part of the norm only and each rank ",
               "clipped by its own factor; the weights now differ from unsharded training. Use ",
               "fsdp::optim::clip_grad_norm(model, max_norm), which computes the global norm over every rank ",
               "(docs/usage.md, 'Clipping'). Warned once.");
  }
  if ((all & kSteppedUnsynced) == 0) return;
  FSDP_CHECK_IN(where, false, "the parameters were written (an optimizer step?) ",
                "after a backward with gradient sync off, while ", pending(),
                " hold gradients accumulated without sync and never reduced: the step did not see those micro-batches. "
                "Turn sync back on before the backward of the last micro-batch of each step: "
                "model.set_requires_gradient_sync(true); to drop them on purpose, call "
                "model.discard_unsynced_gradients() (docs/usage.md, 'Gradient accumulation').");
}

}  // namespace fsdp::detail
