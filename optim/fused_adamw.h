// AdamW that updates each unit's flat shard buffer in one fused pass, instead of one loop per
// parameter: fsdp::optim::FusedAdamW opt(model, torch::optim::AdamWOptions(3e-4));
#pragma once

#include "fsdp/fully_shard.h"

#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>

#include <vector>

namespace fsdp::optim {

/// The same update as torch::optim::AdamW (to the parity tolerance), over ATen's fused AdamW
/// kernel. A unit whose gradients all landed in its flat gradient buffer (the usual case after a
/// backward) is updated as one flat tensor, padding included (it stays 0); a unit with frozen or
/// unused parameters is updated per parameter, skipping those without a gradient, as AdamW does.
/// Options come from param_groups()[0] at every step, so learning-rate schedules work. amsgrad is
/// not supported.
class FusedAdamW : public torch::optim::Optimizer {
 public:
  explicit FusedAdamW(const detail::RootHandle& model,
                      const torch::optim::AdamWOptions& options = torch::optim::AdamWOptions());

  at::Tensor step(LossClosure closure = nullptr) override;

  /// Every state tensor (first and second moments per unit, step counts), for memory accounting.
  std::vector<at::Tensor> state_tensors() const;
  /// Tensors the last step() handed to the fused kernel: one per unit when every unit took the
  /// flat path.
  size_t tensors_last_step() const { return tensors_last_step_; }

 private:
  struct UnitState {
    std::weak_ptr<detail::ParamGroup> group;
    at::Tensor exp_avg, exp_avg_sq;  // flat, [shard_numel]
    std::vector<at::Tensor> steps;   // per parameter: float scalars, as the fused kernel wants
    std::vector<int64_t> counts;     // the same counts on the host, compared without a device read
  };
  std::vector<UnitState> units_;
  size_t tensors_last_step_ = 0;
};

}  // namespace fsdp::optim
