// Loss scaling for fp16 mixed precision over sharded gradients (PyTorch's ShardedGradScaler, FSDP's
// torch.amp.GradScaler): the same scale on every rank, and a step skipped on every rank when any
// rank's shard of the gradients holds an inf or a NaN (each rank sees only its own rows, so the
// finding is all-reduced).
//
//   fsdp::optim::ShardedGradScaler scaler(model);
//   scaler.scale(loss).backward();
//   scaler.unscale_(opt);                              // optional: before clipping
//   fsdp::optim::clip_grad_norm(model, 1.0);
//   scaler.step(opt);                                  // skipped on every rank after an overflow
//   scaler.update();
//
// Over a pipeline's stages (fsdp::pp), one scaler for this rank's stages and their optimizers: an
// overflow in any stage skips the step on every rank of every stage.
//   fsdp::optim::ShardedGradScaler scaler(stages, mesh.group("pp"));
//   ... the last stage's loss function returns scaler.scale(loss) ...
//   scaler.unscale_({&opt0, &opt1});  scaler.step({&opt0, &opt1});  scaler.update();
//
// Its state goes into a checkpoint with the user's metadata, and comes back from it:
//   auto meta = scaler.state_dict();             // "grad_scaler.scale", ...
//   fsdp::checkpoint::save(root, model, opt, fsdp::checkpoint::SaveOptions().metadata(meta));
//   scaler.load_state_dict(fsdp::checkpoint::load(root, model, opt).metadata);
//
// bf16 has fp32's exponent range and needs none of this.
#pragma once

#include "fsdp/export.h"
#include "fsdp/fully_shard.h"

#include <torch/arg.h>
#include <torch/optim/optimizer.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

FSDP_PUBLIC_BEGIN

namespace fsdp::optim {

/// torch.amp.GradScaler's defaults.
struct GradScalerOptions {
  TORCH_ARG(double, init_scale) = 65536.0;
  TORCH_ARG(double, growth_factor) = 2.0;
  TORCH_ARG(double, backoff_factor) = 0.5;
  /// Steps without an overflow after which the scale grows by growth_factor.
  TORCH_ARG(int64_t, growth_interval) = 2000;
  /// Off: scale() returns the loss, step() always steps, update() does nothing.
  TORCH_ARG(bool, enabled) = true;
};

class ShardedGradScaler {
 public:
  explicit ShardedGradScaler(FSDPModule model, const GradScalerOptions& options = {});
  /// Over a pipeline: `models` are this rank's stages (each wrapped over its stage's ranks), and
  /// `pipeline` the mesh's pp group (mesh.group("pp")). The inf/NaN finding is all-reduced over the
  /// stages' ranks, then over `pipeline`: every rank of every stage skips the same steps. Give
  /// unscale_ and step this rank's optimizers, one per model. Every rank builds it.
  ShardedGradScaler(std::vector<FSDPModule> models, c10::intrusive_ptr<c10d::ProcessGroup> pipeline,
                    const GradScalerOptions& options = {});

  /// loss * scale, as torch.amp.GradScaler computes it (the scale is a one-element fp32 tensor).
  at::Tensor scale(const at::Tensor& loss) const;
  /// Divides the gradients of `optimizer`'s parameters (this rank's shards) by the scale and finds
  /// whether any rank's are not finite: one all-reduce, so every rank calls it. At most once per
  /// step; step() calls it when it was not.
  void unscale_(torch::optim::Optimizer& optimizer);
  /// Steps `optimizer` unless an inf or NaN was found on some rank; returns whether it stepped.
  /// Throws on every rank when no rank had a gradient to check (no backward since zero_grad), as
  /// PyTorch's GradScaler does.
  bool step(torch::optim::Optimizer& optimizer);
  /// The same over several optimizers (a pipeline's stages': every one steps, or none).
  void unscale_(const std::vector<torch::optim::Optimizer*>& optimizers);
  bool step(const std::vector<torch::optim::Optimizer*>& optimizers);
  /// Backs the scale off after an overflow, grows it after growth_interval clean steps; ends the
  /// step (the next unscale_ is the next step's).
  void update();

  double get_scale() const;
  /// Whether the last unscale_ found an inf or NaN (on any rank).
  bool found_inf() const { return found_inf_; }
  const GradScalerOptions& options() const { return options_; }

  /// The scale, the clean steps counted towards the next growth and the options, as exact
  /// decimal key/values for a checkpoint's metadata: grad_scaler.scale, grad_scaler.growth_tracker
  /// (PyTorch's GradScaler.state_dict "_growth_tracker"), grad_scaler.growth_factor,
  /// grad_scaler.backoff_factor, grad_scaler.growth_interval. Empty when the scaler is disabled.
  std::map<std::string, std::string> state_dict() const;
  /// Restores what state_dict gave, options included (they replace the constructor's, as in
  /// PyTorch); keys outside "grad_scaler." are ignored, so a checkpoint's whole metadata may be
  /// passed. Call it between steps. Throws, naming the key, when one of ours is unknown, missing or
  /// unusable (a scale fp32 cannot hold, a count not below the interval), and on a disabled scaler.
  void load_state_dict(const std::map<std::string, std::string>& state);

 private:
  FSDPModule model_;                                 // the first of models_, which errors name
  std::vector<FSDPModule> models_;                   // one, or this rank's pipeline stages
  c10::intrusive_ptr<c10d::ProcessGroup> pipeline_;  // null without a pipeline
  GradScalerOptions options_;
  at::Tensor scale_;           // [1] fp32, as PyTorch keeps it
  at::Tensor growth_tracker_;  // [1] int32
  bool unscaled_ = false;
  bool found_inf_ = false;
  bool any_grads_ = false;  // whether any rank had a gradient at the last unscale_
  bool stepped_ = false;    // step() since the last update()
};

}  // namespace fsdp::optim

FSDP_PUBLIC_END
