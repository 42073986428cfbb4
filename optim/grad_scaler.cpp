#include "optim/grad_scaler.h"

#include <ATen/ops/_amp_foreach_non_finite_check_and_unscale.h>
#include <ATen/ops/_amp_update_scale.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace fsdp::optim {

ShardedGradScaler::ShardedGradScaler(FSDPModule model, const GradScalerOptions& options)
    : model_(std::move(model)), options_(options) {
  TORCH_CHECK(options.init_scale() > 0 && std::isfinite(options.init_scale()), "fsdp::optim::ShardedGradScaler (rank ",
              model_.rank(), "): init_scale is ", options.init_scale(), "; it must be positive and finite.");
  TORCH_CHECK(options.growth_factor() > 1.0 && options.backoff_factor() > 0 && options.backoff_factor() < 1.0,
              "fsdp::optim::ShardedGradScaler (rank ", model_.rank(), "): growth_factor ", options.growth_factor(),
              " and backoff_factor ", options.backoff_factor(),
              " must satisfy growth_factor > 1 and 0 < backoff_factor < 1 (defaults 2 and 0.5).");
  TORCH_CHECK(options.growth_interval() > 0, "fsdp::optim::ShardedGradScaler (rank ", model_.rank(),
              "): growth_interval is ", options.growth_interval(), "; it must be positive (default 2000).");
  scale_ = at::full({1}, options.init_scale(), at::kFloat);
  growth_tracker_ = at::zeros({1}, at::kInt);
}

double ShardedGradScaler::get_scale() const {
  return options_.enabled() ? scale_.item<double>() : 1.0;
}

at::Tensor ShardedGradScaler::scale(const at::Tensor& loss) const {
  if (!options_.enabled()) return loss;
  return loss * scale_.to(loss.device());
}

void ShardedGradScaler::unscale_(torch::optim::Optimizer& optimizer) {
  if (!options_.enabled()) return;
  TORCH_CHECK(!unscaled_, "fsdp::optim::ShardedGradScaler::unscale_ (rank ", model_.rank(),
              "): called twice since the last update(); unscale once per step (step() unscales when you did not).");
  model_.check_gradients_reduced("ShardedGradScaler::unscale_");
  // PyTorch's own kernel, per device and dtype: multiplies by 1/scale (in fp32) and flags
  // anything not finite.
  const at::Tensor inv_scale = scale_.to(at::kDouble).reciprocal().to(at::kFloat);
  std::map<std::pair<std::string, int>, std::vector<at::Tensor>> grads;  // by device and dtype
  for (auto& group : optimizer.param_groups()) {
    for (auto& p : group.params()) {
      if (p.grad().defined() && p.grad().numel() > 0) {
        grads[{p.grad().device().str(), static_cast<int>(p.grad().scalar_type())}].push_back(p.grad());
      }
    }
  }
  at::Tensor found = at::zeros({1}, at::kFloat);
  for (auto& [key, list] : grads) {
    const c10::Device device = list.front().device();
    at::Tensor found_here = at::zeros({1}, at::TensorOptions().dtype(at::kFloat).device(device));
    at::_amp_foreach_non_finite_check_and_unscale_(list, found_here, inv_scale.to(device));
    found.add_(found_here.cpu());
  }
  // Each rank holds its own rows only: an overflow on any rank skips the step everywhere.
  model_.all_reduce(found, c10d::ReduceOp::MAX, "ShardedGradScaler: inf/NaN found in any rank's gradients");
  found_inf_ = found.item<float>() > 0;
  unscaled_ = true;
}

bool ShardedGradScaler::step(torch::optim::Optimizer& optimizer) {
  if (!options_.enabled()) {
    optimizer.step();
    return true;
  }
  if (!unscaled_) unscale_(optimizer);
  if (found_inf_) return false;
  optimizer.step();
  return true;
}

void ShardedGradScaler::update() {
  if (!options_.enabled()) return;
  TORCH_CHECK(unscaled_, "fsdp::optim::ShardedGradScaler::update (rank ", model_.rank(),
              "): no step() or unscale_() since the last update(); call update() once per step, after step().");
  at::Tensor found = at::full({1}, found_inf_ ? 1.0 : 0.0, at::kFloat);
  at::_amp_update_scale_(scale_, growth_tracker_, found, options_.growth_factor(), options_.backoff_factor(),
                         options_.growth_interval());
  unscaled_ = false;
}

}  // namespace fsdp::optim
