// AdamW that updates each unit's flat shard in one fused pass, instead of one loop per parameter:
//   fsdp::optim::FusedAdamW opt(model, torch::optim::AdamWOptions(3e-4));
#pragma once

#include "fsdp/export.h"
#include "fsdp/fully_shard.h"

#include <torch/optim/adamw.h>

#include <vector>

FSDP_PUBLIC_BEGIN

namespace fsdp::optim {

/// The same update as torch::optim::AdamW (to the parity tolerance), over ATen's fused AdamW
/// kernel, working from the model's shard contract (fsdp/shard_spec.h). A unit whose gradients all
/// landed in its flat gradient buffer (the usual case after a backward) is updated as one flat
/// tensor, padding included (it stays 0); a unit with frozen or unused parameters is updated per
/// parameter, skipping those without a gradient, as AdamW does. Options come from
/// param_groups()[0] at every step, so learning-rate schedules work. amsgrad is not supported.
///
/// It is a torch::optim::AdamW: its state is AdamW's, one AdamWParamState per parameter whose
/// moments are this rank's rows (views into flat per-unit buffers), so torch::save / torch::load
/// of the optimizer and code that reads AdamW's state work unchanged. A state loaded from a file
/// is copied into the flat buffers at the next step.
class FusedAdamW : public torch::optim::AdamW {
 public:
  explicit FusedAdamW(const FSDPModule& model,
                      const torch::optim::AdamWOptions& options = torch::optim::AdamWOptions());

  at::Tensor step(LossClosure closure = nullptr) override;

  /// Tensors the last step() handed to the fused kernel: one per unit when every unit took the
  /// flat path.
  size_t tensors_last_step() const { return tensors_last_step_; }

 private:
  /// The AdamW state of `p`, its moments aliasing the unit's flat moments at its offset (created,
  /// or copied in after a load, as needed).
  torch::optim::AdamWParamState& param_state(const ShardSpec& p, size_t unit);

  FSDPModule model_;  // shares the model: its shard contract is read at every step
  struct Moments {
    at::Tensor exp_avg, exp_avg_sq;  // flat, [shard_numel], padding included
  };
  std::vector<Moments> moments_;  // per unit
  size_t tensors_last_step_ = 0;
};

}  // namespace fsdp::optim

FSDP_PUBLIC_END
