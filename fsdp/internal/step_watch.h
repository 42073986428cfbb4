// What the program did between the end of a backward and the next forward, where the library sees
// no call of its own: two LibTorch habits that are silently wrong on a sharded model.
//   - torch::nn::utils::clip_grad_norm_(model->parameters(), max): between steps the parameters are
//     this rank's shards, so it computes this rank's part of the norm and each rank clips by its
//     own factor (FSDP2's DTensors give PyTorch's function the global norm; LibTorch's cannot be
//     intercepted). Seen as a sharded gradient rescaled in place by something other than
//     fsdp::optim::clip_grad_norm or ShardedGradScaler::unscale_: warned once, on every rank.
//   - an optimizer step while gradients accumulated with sync off wait unreduced (sync never turned
//     back on): the step did not see them. Seen as parameter values changed since that backward
//     (not version counters: torch::optim::SGD writes through .data(), which has its own):
//     every rank throws. (An optimizer that finds no gradient at all writes nothing, and is seen
//     where the library is called: zero_grad of the model, clipping, FusedAdamW.)
// Both are decided at the next forward, through the votes of its step-boundary agreement, so every
// rank acts alike at no extra collective. Internal to the library.
#pragma once

#include "fsdp/error.h"

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace fsdp::detail {

class StepWatch {
 public:
  /// The votes a rank casts into the forward's agreement.
  static constexpr int64_t kRescaled = 1;         ///< a gradient was rescaled in place by the program
  static constexpr int64_t kSteppedUnsynced = 2;  ///< parameters written while unsynced gradients wait

  /// Lists of tensors, asked for only when they are read: most steps watch nothing, and a step's
  /// hot path should not build them.
  using Tensors = std::function<std::vector<at::Tensor>()>;

  /// At the end of a backward: `grads`, the sharded gradients that exist now (one is watched: the one
  /// whose storage is smallest, so that keeping it until the next forward costs least), and, when
  /// units hold unsynced gradients, a few values of each of `params`.
  void after_backward(const Tensors& grads, const Tensors& params, bool holds_unsynced_grads);
  /// The library rescaled the gradients on purpose (clipping, the scaler's unscale_).
  void rescaled_by_library();
  /// At the next forward, before its agreement: this rank's votes. Lets go of the watched gradient.
  int64_t vote(const Tensors& params, bool holds_unsynced_grads);
  /// After the agreement, with every rank's votes: warns once (kRescaled) or throws (kSteppedUnsynced),
  /// prefixed by `where` (the call and this rank) and naming `pending()` (the units holding
  /// unsynced gradients).
  void act(const std::vector<int64_t>& votes, const ErrorContext& where, const std::function<std::string()>& pending);

  /// Steps watched for the first habit: its sample is compared at the next forward, which on a
  /// GPU waits for the device, so only the first steps are (a loop clips from its first step).
  static constexpr int kWatchedSteps = 16;

 private:
  // Samples are host bytes, not tensors: taking them allocates nothing through the CPU allocator
  // whose counts the memory statistics and their tests read.
  using Bytes = std::vector<uint8_t>;
  at::Tensor grad_;              // the watched gradient
  Bytes sample_;                 // ... its first values
  std::optional<Bytes> params_;  // unsynced gradients wait: the first values of every parameter
  int watched_ = 0;
  bool warned_ = false;
};

}  // namespace fsdp::detail
