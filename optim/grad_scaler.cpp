#include "optim/grad_scaler.h"
#include "fsdp/internal/check.h"
#include "fsdp/internal/core_access.h"
#include "fsdp/process_group.h"

#include <ATen/ops/_amp_foreach_non_finite_check_and_unscale.h>
#include <ATen/ops/_amp_update_scale.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <iomanip>
#include <limits>
#include <map>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace fsdp::optim {
namespace {

// What an error of the scaler's call `api` names: the call, and the model's rank of its ranks.
ErrorContext in_call(const FSDPModule& model, const char* api) {
  return ErrorContext().api(api).rank(model.rank()).world_size(model.world_size());
}

}  // namespace

ShardedGradScaler::ShardedGradScaler(FSDPModule model, const GradScalerOptions& options)
    : ShardedGradScaler(std::vector<FSDPModule>{std::move(model)}, nullptr, options) {}

ShardedGradScaler::ShardedGradScaler(std::vector<FSDPModule> models, c10::intrusive_ptr<c10d::ProcessGroup> pipeline,
                                     const GradScalerOptions& options)
    : model_(models.empty() ? throw std::invalid_argument(
                                  "fsdp::optim::ShardedGradScaler: no models (give this rank's pipeline stages)")
                            : models.front()),
      models_(std::move(models)),
      pipeline_(std::move(pipeline)),
      options_(options) {
  FSDP_CHECK_IN(in_call(model_, "fsdp::optim::ShardedGradScaler"),
                options.init_scale() > 0 && std::isfinite(options.init_scale()), "init_scale is ", options.init_scale(),
                "; it must be positive and finite.");
  FSDP_CHECK_IN(in_call(model_, "fsdp::optim::ShardedGradScaler"),
                options.growth_factor() > 1.0 && options.backoff_factor() > 0 && options.backoff_factor() < 1.0,
                "growth_factor ", options.growth_factor(), " and backoff_factor ", options.backoff_factor(),
                " must satisfy growth_factor > 1 and 0 < backoff_factor < 1 (defaults 2 and 0.5).");
  FSDP_CHECK_IN(in_call(model_, "fsdp::optim::ShardedGradScaler"), options.growth_interval() > 0, "growth_interval is ",
                options.growth_interval(), "; it must be positive (default 2000).");
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
  unscale_(std::vector<torch::optim::Optimizer*>{&optimizer});
}

void ShardedGradScaler::unscale_(const std::vector<torch::optim::Optimizer*>& optimizers) {
  if (!options_.enabled()) return;
  FSDP_CHECK_IN(in_call(model_, "fsdp::optim::ShardedGradScaler::unscale_"), !stepped_,
                "called after step(), which unscales; call unscale_() before step() (for clipping), or not at all, "
                "and update() after step().");
  FSDP_CHECK_IN(in_call(model_, "fsdp::optim::ShardedGradScaler::unscale_"), !unscaled_,
                "called twice since the last update(); unscale once per step (step() unscales when you did not).");
  for (const auto& m : models_) fsdp::detail::check_gradients_reduced(m, "ShardedGradScaler::unscale_");
  // PyTorch's own kernel, per device and dtype: multiplies by 1/scale (in fp32) and flags
  // anything not finite.
  const at::Tensor inv_scale = scale_.to(at::kDouble).reciprocal().to(at::kFloat);
  std::map<std::pair<std::string, int>, std::vector<at::Tensor>> grads;  // by device and dtype
  for (auto* optimizer : optimizers) {
    for (auto& group : optimizer->param_groups()) {
      for (auto& p : group.params()) {
        if (p.grad().defined() && p.grad().numel() > 0) {
          grads[{p.grad().device().str(), static_cast<int>(p.grad().scalar_type())}].push_back(p.grad());
        }
      }
    }
  }
  // [found inf or NaN, had a gradient], both all-reduced by MAX.
  at::Tensor found = at::zeros({2}, at::kFloat);
  if (!grads.empty()) found[1] = 1.0;
  for (auto& [key, list] : grads) {
    const c10::Device device = list.front().device();
    at::Tensor found_here = at::zeros({1}, at::TensorOptions().dtype(at::kFloat).device(device));
    at::_amp_foreach_non_finite_check_and_unscale_(list, found_here, inv_scale.to(device));
    found.narrow(0, 0, 1).add_(found_here.cpu());
  }
  // Each rank holds its own rows only: an overflow on any rank skips the step everywhere.
  // A pipeline's stages on this rank share their ranks (the stage's mesh): one all-reduce over
  // them, then one over the pipeline.
  fsdp::detail::all_reduce(model_, found, c10d::ReduceOp::MAX,
                           "ShardedGradScaler: inf/NaN found in any rank's gradients");
  if (pipeline_) fsdp::all_reduce(pipeline_, found, c10d::ReduceOp::MAX);
  found_inf_ = found[0].item<float>() > 0;
  any_grads_ = found[1].item<float>() > 0;
  unscaled_ = true;
  for (const auto& m : models_) fsdp::detail::gradients_rescaled(m);
}

bool ShardedGradScaler::step(torch::optim::Optimizer& optimizer) {
  return step(std::vector<torch::optim::Optimizer*>{&optimizer});
}

bool ShardedGradScaler::step(const std::vector<torch::optim::Optimizer*>& optimizers) {
  if (!options_.enabled()) {
    for (auto* o : optimizers) o->step();
    return true;
  }
  FSDP_CHECK_IN(in_call(model_, "fsdp::optim::ShardedGradScaler::step"), !stepped_,
                "step() was called already since the last update() (PyTorch refuses it too); call update() after "
                "each step().");
  if (!unscaled_) unscale_(optimizers);
  if (!any_grads_) unscaled_ = false;  // nothing was unscaled: the next backward's step may unscale
  FSDP_CHECK_IN(in_call(model_, "fsdp::optim::ShardedGradScaler::step"), any_grads_,
                "no parameter of the optimizer has a gradient on any rank, so no inf/NaN check was made (PyTorch: "
                "\"No inf checks were recorded for this optimizer\"). Run scaler.scale(loss).backward() before "
                "scaler.step(optimizer), and zero_grad() after the step, not between.");
  stepped_ = true;
  if (found_inf_) return false;
  for (auto* o : optimizers) o->step();
  return true;
}

void ShardedGradScaler::update() {
  if (!options_.enabled()) return;
  FSDP_CHECK_IN(in_call(model_, "fsdp::optim::ShardedGradScaler::update"), unscaled_,
                "no step() or unscale_() since the last update(); call update() once per step, after step().");
  if (!any_grads_) unscaled_ = false;  // nothing was checked: the next backward's step starts over
  FSDP_CHECK_IN(in_call(model_, "fsdp::optim::ShardedGradScaler::update"), any_grads_,
                "no inf/NaN check was made since the last update() (no rank had a gradient at unscale_()), so "
                "the scale cannot be updated (PyTorch: \"No inf checks were recorded prior to update\"). Run "
                "scaler.scale(loss).backward() before unscale_() and step().");
  at::Tensor found = at::full({1}, found_inf_ ? 1.0 : 0.0, at::kFloat);
  at::_amp_update_scale_(scale_, growth_tracker_, found, options_.growth_factor(), options_.backoff_factor(),
                         options_.growth_interval());
  unscaled_ = false;
  stepped_ = false;
}

namespace {
constexpr const char* kScale = "grad_scaler.scale";
constexpr const char* kTracker = "grad_scaler.growth_tracker";
constexpr const char* kGrowth = "grad_scaler.growth_factor";
constexpr const char* kBackoff = "grad_scaler.backoff_factor";
constexpr const char* kInterval = "grad_scaler.growth_interval";

// Enough digits that the value reads back to the same bits.
std::string exact(double v) {
  std::ostringstream os;
  os << std::setprecision(std::numeric_limits<double>::max_digits10) << v;
  return os.str();
}
}  // namespace

std::map<std::string, std::string> ShardedGradScaler::state_dict() const {
  if (!options_.enabled()) return {};
  return {{kScale, exact(scale_.item<float>())},
          {kTracker, std::to_string(growth_tracker_.item<int>())},
          {kGrowth, exact(options_.growth_factor())},
          {kBackoff, exact(options_.backoff_factor())},
          {kInterval, std::to_string(options_.growth_interval())}};
}

void ShardedGradScaler::load_state_dict(const std::map<std::string, std::string>& state) {
  const auto where = [&] {
    return fsdp::detail::error_caller(in_call(model_, "fsdp::optim::ShardedGradScaler::load_state_dict"));
  };
  FSDP_CHECK(options_.enabled(), where(),
             ": the scaler is disabled (GradScalerOptions::enabled false); load into an enabled one.");
  FSDP_CHECK(!unscaled_ && !stepped_, where(), ": called between unscale_()/step() and update(); load between steps.");
  for (const auto& [key, value] : state) {  // a misspelt key of ours would otherwise be ignored
    const bool ours = key.rfind("grad_scaler.", 0) == 0;
    const bool known = key == kScale || key == kTracker || key == kGrowth || key == kBackoff || key == kInterval;
    FSDP_CHECK(!ours || known, where(), ": unknown key '", key, "' (", value, "); the scaler's keys are ", kScale, ", ",
               kTracker, ", ", kGrowth, ", ", kBackoff, " and ", kInterval, ".");
  }
  const auto number = [&](const char* key) {
    const auto it = state.find(key);
    FSDP_CHECK(it != state.end(), where(), ": '", key,
               "' is missing: pass what scaler.state_dict() gave (saved in the checkpoint's metadata with "
               "SaveOptions::metadata).");
    const std::string& text = it->second;
    // Decimal only (strtod would also take hexadecimal, "inf" and leading blanks).
    const bool decimal = !text.empty() && text.find_first_not_of("0123456789+-.eE") == std::string::npos;
    char* end = nullptr;
    const double v = decimal ? std::strtod(text.c_str(), &end) : 0.0;
    FSDP_CHECK(decimal && end == text.c_str() + text.size() && std::isfinite(v), where(), ": '", key, "' is '", text,
               "', not a finite decimal number.");
    return v;
  };
  const double scale = number(kScale), growth = number(kGrowth), backoff = number(kBackoff);
  const double tracker = number(kTracker), interval = number(kInterval);
  // What the scale is kept in (converted only when in range: beyond, the conversion is undefined).
  const float scale32 = scale > 0 && scale <= std::numeric_limits<float>::max() ? static_cast<float>(scale) : 0.0F;
  FSDP_CHECK(std::isnormal(scale32), where(), ": '", kScale, "' is ", scale,
             "; a scale is a positive number that fp32 holds (", std::numeric_limits<float>::min(), " to ",
             std::numeric_limits<float>::max(), ").");
  constexpr double kIntMax = std::numeric_limits<int32_t>::max();
  FSDP_CHECK(interval >= 1 && interval <= kIntMax && interval == std::floor(interval), where(), ": '", kInterval,
             "' is ", interval, "; it is a whole number of steps from 1 to ", kIntMax, ".");
  FSDP_CHECK(tracker >= 0 && tracker < interval && tracker == std::floor(tracker), where(), ": '", kTracker, "' is ",
             tracker, "; it counts the clean steps since the scale last changed: a whole number below the interval (",
             interval, ").");
  FSDP_CHECK(growth > 1.0 && backoff > 0 && backoff < 1.0, where(), ": growth_factor ", growth, " and backoff_factor ",
             backoff, " must satisfy growth_factor > 1 and 0 < backoff_factor < 1.");
  scale_.fill_(scale32);
  growth_tracker_.fill_(static_cast<int64_t>(tracker));
  options_.growth_factor(growth).backoff_factor(backoff).growth_interval(static_cast<int64_t>(interval));
}

}  // namespace fsdp::optim
