// What a checkpoint keeps of a LibTorch optimizer, and how it is put back: per parameter its state
// tensors (Adam/AdamW: exp_avg, exp_avg_sq, and max_exp_avg_sq with amsgrad; SGD: momentum_buffer),
// which have the parameter's layout (this rank's rows of it), and its step count; per param group
// its hyperparameters. Supported: torch::optim::SGD, Adam, AdamW, and fsdp::optim::FusedAdamW (an
// AdamW). Dispatch is on the optimizer's C++ type, never on a name. Internal to the checkpoint
// library.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace fsdp::checkpoint::detail {

/// "SGD", "Adam" or "AdamW" (FusedAdamW is an AdamW); any other optimizer is refused, naming its
/// type and `where`.
std::string optimizer_type(const torch::optim::Optimizer& opt, const std::string& where);

/// The names of the state tensors `type` keeps per parameter.
std::vector<std::string> state_names(const std::string& type);

/// A param group's hyperparameters as numbers (betas as beta1 and beta2; flags as 0 or 1).
std::map<std::string, double> group_options(const torch::optim::OptimizerParamGroup& group, const std::string& type);
/// Sets them; a key the type does not have, or one missing, is refused.
void set_group_options(torch::optim::OptimizerParamGroup& group, const std::string& type,
                       const std::map<std::string, double>& options, const std::string& where);

/// One parameter's state as saved: its tensors by name (this rank's rows) and its step (-1: none
/// kept, as SGD).
struct ParamState {
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  int64_t step = -1;
};

/// The state of `param`, or nothing (no tensors, step -1) when the optimizer has none for it yet.
ParamState param_state(const torch::optim::Optimizer& opt, const std::string& type, const at::Tensor& param);

/// Where a load puts `param`'s state: its existing tensors of those names when it has them with the
/// parameter's shape, new ones otherwise (installed by install_state). Nothing of the optimizer
/// changes here.
std::vector<at::Tensor> state_destinations(const torch::optim::Optimizer& opt, const std::string& type,
                                           const at::Tensor& param, const std::vector<std::string>& names);

/// Makes `tensors` (the destinations above, filled) and `step` the state of `param`; with no
/// tensors and step -1, the parameter has no state afterwards (Adam's moments are zeroed first:
/// FusedAdamW's flat buffers, which they alias, then start again from zero too).
void install_state(torch::optim::Optimizer& opt, const std::string& type, const at::Tensor& param,
                   const std::vector<std::string>& names, const std::vector<at::Tensor>& tensors, int64_t step);

}  // namespace fsdp::checkpoint::detail
